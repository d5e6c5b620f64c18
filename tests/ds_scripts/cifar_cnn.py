"""DeepSpeed's CIFAR-10 tutorial, shrunk: a small CNN classifier trained from a dataset that
``deepspeed.initialize(training_data=...)`` turns into a distributed loader, inputs moved with
``get_accelerator().device_name(local_rank)`` and cast by ``fp16_enabled()`` /
``bfloat16_enabled()``. The images are synthetic (8x8, 10 classes whose mean colour differs),
so it needs no download.
"""
import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs")
    parser.add_argument("--out", type=str, default=None, help="results (JSON, rank 0)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def synthetic_cifar(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    centres = torch.linspace(-1, 1, 10)
    images = torch.randn(n, 3, 8, 8, generator=g) * 0.3 + 2 * centres[labels].view(n, 1, 1, 1)
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    trainset = synthetic_cifar(256, seed=1)
    testset = synthetic_cifar(128, seed=2)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank

    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):  # noqa: B007 - as in the original script
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs.float(), labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            losses.append(loss.item())
        if local_rank == 0:
            print(f"[epoch {epoch + 1}] loss: {running_loss / (i + 1):.3f}")

    correct = total = 0
    model_engine.eval()
    with torch.no_grad():
        for images, labels in torch.utils.data.DataLoader(testset, batch_size=32):
            images = images.to(local_device)
            if target_dtype is not None:
                images = images.to(target_dtype)
            predicted = model_engine(images).argmax(dim=1).cpu()
            total += labels.size(0)
            correct += (predicted == labels).sum().item()
    if model_engine.global_rank == 0:
        print(f"Accuracy of the network on the {total} test images: {100 * correct / total:.1f} %")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"losses": losses, "accuracy": correct / total, "device": local_device,
                           "fp16": model_engine.fp16_enabled(), "bf16": model_engine.bfloat16_enabled()}, f)


if __name__ == "__main__":
    main()

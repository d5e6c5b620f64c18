"""DeepSpeed's CIFAR-10 tutorial, shrunk: a small CNN classifier trained from a dataset that
``deepspeed.initialize(training_data=...)`` turns into a distributed loader, inputs moved with
``get_accelerator().device_name(local_rank)`` and cast by ``fp16_enabled()`` /
``bfloat16_enabled()``. The images are synthetic (8x8, 10 classes whose mean colour differs),
so it needs no download. The tutorial's mixture-of-experts flags are kept (``--moe``,
``--ep-world-size``, ``--num-experts``, ``--mlp-type``, ``--top-k``, ``--min-capacity``,
``--noisy-gate-policy``, ``--moe-param-group``): one ``deepspeed.moe.layer.MoE`` per entry of
``--num-experts`` after the second linear layer.
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
    parser.add_argument("--moe", default=False, action="store_true", help="use deepspeed mixture of experts (moe)")
    parser.add_argument("--ep-world-size", default=1, type=int, help="(moe) expert parallel world size")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1], help="number of experts list, MoE related.")
    parser.add_argument("--mlp-type", type=str, default="standard",
                        help="Only applicable when num-experts > 1, accepts [standard, residual]")
    parser.add_argument("--top-k", default=1, type=int, help="(moe) gating top 1 and 2 supported")
    parser.add_argument("--min-capacity", default=0, type=int,
                        help="(moe) minimum capacity of an expert regardless of the capacity_factor")
    parser.add_argument("--noisy-gate-policy", default=None, type=str,
                        help="(moe) noisy gating (only supported with top-1). Valid values are None, RSample, "
                        "and Jitter")
    parser.add_argument("--moe-param-group", default=False, action="store_true",
                        help="(moe) create separate moe param groups, required when using ZeRO w. MoE")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def synthetic_cifar(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    centres = torch.linspace(-1, 1, 10)
    images = torch.randn(n, 3, 8, 8, generator=g) * 0.3 + 2 * centres[labels].view(n, 1, 1, 1)
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self, args=None):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 2 * 2, 32)
        self.moe = args is not None and args.moe
        if self.moe:
            self.fc2 = nn.Linear(32, 24)
            fc3 = nn.Linear(24, 24)
            self.moe_layer_list = []
            for n_e in args.num_experts:
                # create moe layers based on the number of experts
                self.moe_layer_list.append(
                    deepspeed.moe.layer.MoE(hidden_size=24, expert=fc3, num_experts=n_e, ep_size=args.ep_world_size,
                                            use_residual=args.mlp_type == "residual", k=args.top_k,
                                            min_capacity=args.min_capacity, noisy_gate_policy=args.noisy_gate_policy))
            self.moe_layer_list = nn.ModuleList(self.moe_layer_list)
            self.fc4 = nn.Linear(24, 10)
        else:
            self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        if not self.moe:
            return self.fc2(x)
        x = F.relu(self.fc2(x))
        for layer in self.moe_layer_list:
            x, _, _ = layer(x)
        return self.fc4(x)


def create_moe_param_groups(model):
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    trainset = synthetic_cifar(256, seed=1)
    testset = synthetic_cifar(128, seed=2)
    net = Net(args)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)
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

"""DeepSpeed's pipeline-parallelism tutorial (an AlexNet-shaped CNN on CIFAR-10), in its shape:
the network's layers joined into a list, ``PipelineModule(layers=..., loss_fn=..., num_stages=...)``,
``deepspeed.initialize(..., training_data=trainset)`` and ``engine.train_batch()`` per step. The
images are synthetic (3 x 16 x 16, ten classes), so nothing is downloaded.

    deepspeed pipeline_tutorial.py --deepspeed_config ds_config.json -p 2 --steps 8 --out out.json
"""
import argparse
import json

import deepspeed
import torch
import torch.nn as nn
from deepspeed.pipe import PipelineModule


class SmallAlexNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=2),
            nn.Conv2d(8, 16, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=2))
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Linear(16 * 2 * 2, 32), nn.ReLU(inplace=True), nn.Linear(32, num_classes))

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


class SyntheticCifar(torch.utils.data.Dataset):
    """Images whose class shifts their mean, so the network can learn something."""

    def __init__(self, size=256, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 10, (size,), generator=g)
        self.images = torch.randn(size, 3, 16, 16, generator=g) + self.labels.view(-1, 1, 1, 1) * 0.1

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def join_layers(vision_model):
    layers = [
        *vision_model.features,
        vision_model.avgpool,
        lambda x: torch.flatten(x, 1),
        *vision_model.classifier,
    ]
    return layers


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=8, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="gloo", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser.add_argument("--out", type=str, default=None, help="write the losses here (rank 0)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def train_pipe(args, part="parameters"):
    torch.manual_seed(args.seed)
    net = SmallAlexNet(num_classes=10)
    net = PipelineModule(layers=join_layers(net), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method=part,
                         activation_checkpoint_interval=0)
    trainset = SyntheticCifar()
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)
    losses = []
    for _ in range(args.steps):
        loss = engine.train_batch()
        losses.append(loss.item())
    if args.out and torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "stages": engine.num_stages, "first": engine.is_first_stage(),
                       "zero_stage": engine.zero_optimization_stage(), "global_steps": engine.global_steps}, f)


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    train_pipe(args)

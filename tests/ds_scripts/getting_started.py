"""DeepSpeed's getting-started loop, as its tutorial writes it: command-line config,
initialize, forward / backward / step, save a checkpoint with client state, load it back.

Runs under torchrun with DeepSpeed (``--deepspeed --deepspeed_config ds_config.json``); rank 0
writes what it saw to ``--out`` as JSON.
"""
import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F


def add_argument():
    parser = argparse.ArgumentParser(description="getting started")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=6, help="training steps (optimizer updates)")
    parser.add_argument("--save_dir", type=str, required=True, help="checkpoint directory")
    parser.add_argument("--out", type=str, default=None, help="results (JSON, rank 0)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 4)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def batch(step, micro_step, rank, size):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro_step + rank)
    x = torch.randn(size, 16, generator=g)
    y = torch.randn(size, 4, generator=g)
    return x, y


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(42)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=parameters)

    def train(step):
        losses = []
        for micro in range(model_engine.gradient_accumulation_steps()):
            x, y = batch(step, micro, model_engine.global_rank, model_engine.train_micro_batch_size_per_gpu())
            x, y = x.to(model_engine.device), y.to(model_engine.device)
            if model_engine.bfloat16_enabled():
                x = x.bfloat16()
            elif model_engine.fp16_enabled():
                x = x.half()
            loss = F.mse_loss(model_engine(x).float(), y)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
        return sum(losses) / len(losses)

    half = args.steps // 2
    losses = [train(step) for step in range(half)]
    client_sd = {"step": half, "losses": losses}
    model_engine.save_checkpoint(args.save_dir, client_state=client_sd)
    losses += [train(step) for step in range(half, args.steps)]
    lr = model_engine.get_lr()

    # as after a restart: load the latest checkpoint and train on from its step
    _, client_sd = model_engine.load_checkpoint(args.save_dir)
    step = client_sd["step"]
    resumed = client_sd["losses"] + [train(s) for s in range(step, args.steps)]

    if model_engine.global_rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "resumed": resumed, "lr": lr,
                       "stage": model_engine.zero_optimization_stage(),
                       "world_size": model_engine.world_size,
                       "global_steps": model_engine.global_steps}, f)


if __name__ == "__main__":
    main()

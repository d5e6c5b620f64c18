"""A 2-rank stage-3 job whose ranks stop running the same modules once prefetching is under way:

    torchrun --nproc-per-node 2 diverge_script.py DIR [unit | gathered | raises]

Two steps agree, so the order of units is recorded and prefetched from; in the third, rank 0
runs a branch that rank 1 skips (with ``gathered``, the forward then reads a later unit's weight
with ``GatheredParameters``; with ``raises``, rank 0's forward raises an error of its own instead,
which is the one it must end with). Every rank must raise the error that names what each ran, and
the job must end instead of hanging, although the rank that kept to the plan may have started
collectives its peer never joins. Each rank writes ``step S: ...`` to ``DIR/rankR.txt`` and,
before raising, waits (up to a minute) for the other rank's file: torchrun stops the other
ranks as soon as one fails, which would otherwise race with the other rank's own error.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
from parity_model import batch, build_model, make_config
from torch import nn

import zerodp


class ReadsLaterWeight(nn.Module):
    """A branch, then a read of ``b.weight`` in ``GatheredParameters`` before ``a`` and ``b`` run."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.branch, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        # held apart: reading self.b.weight in a forward would gather it then (core/access.py), before
        # GatheredParameters, whose collective this script is about
        self.b_weight = (self.b.weight,)

    def forward(self, x, take_branch: bool):
        if take_branch and mode == "raises":
            raise ValueError("rank 0 fails in its forward")
        if take_branch:
            x = self.branch(x)
        with zerodp.GatheredParameters(self.b_weight[0]):
            scale = self.b_weight[0].abs().mean().item()
        return self.b(torch.tanh(self.a(x))).pow(2).mean() * scale


out_dir = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "unit"
gathered = mode in ("gathered", "raises")
cfg = make_config(3, 2)
cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 1
engine, _, _, _ = zerodp.initialize(model=ReadsLaterWeight() if gathered else build_model(), config=cfg)
rank, world = dist.get_rank(), dist.get_world_size()
for step in range(3):
    take_branch = rank == 0 and step == 2
    try:
        if gathered:
            loss = engine(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)), take_branch)
        else:
            loss = engine(*batch(step, rank, 0), take_branch)
    except (RuntimeError, ValueError) as e:
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"step {step}: {e}")
        deadline = time.monotonic() + (0 if mode == "raises" else 60)
        while time.monotonic() < deadline and len(os.listdir(out_dir)) < world:
            time.sleep(0.1)
        raise
    engine.backward(loss)
    engine.step()
print(f"rank {rank}: no error", flush=True)

"""Worker tasks for stage-3 specific tests."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zerodp


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}


def modify_with_gathered_parameters(group, stage: int) -> dict:
    """Rank 0 writes into a weight inside GatheredParameters(modifier_rank=0); every rank must
    see rank 0's values afterwards, gathered again from the re-sharded state."""
    rank = dist.get_rank(group)
    engine, _, _, _ = zerodp.initialize(model=_mlp(), config=_config(stage), process_group=group)
    w = engine.module[2].weight
    with zerodp.GatheredParameters([w], modifier_rank=0):
        full_inside = w.detach().clone()
        with torch.no_grad():
            w.fill_(float(rank + 1))           # only rank 0's edit may survive
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        after = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    sharded_at_rest = engine.memory_breakdown()["gathered_parameters"] == 0
    engine.destroy()
    return {"inside_shape": tuple(full_inside.shape), "after": after, "sharded_at_rest": sharded_at_rest}


class Gate(nn.Module):
    """A unit whose second weight is used only when asked (per rank, per step)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(dim, dim) * 0.3)
        self.w2 = nn.Parameter(torch.randn(dim, dim) * 0.3)

    def forward(self, x, use_w2: bool):
        y = x @ self.w1
        return y + x @ self.w2 if use_w2 else y


class GatedNet(nn.Module):
    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.gate = Gate(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, use_w2: bool):
        return self.out(torch.tanh(self.gate(torch.tanh(self.inp(x)), use_w2))).pow(2).mean()


def gated_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def gated_use(step: int, rank: int) -> bool:
    return (step + rank) % 2 == 0


def gated_reference(world: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = GatedNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    for step in range(steps):
        opt.zero_grad()
        losses = [model(gated_batch(step, r), gated_use(step, r)) for r in range(world)]
        (sum(losses) / world).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def gated_train(group, steps: int) -> dict:
    """Stage 3 with a parameter inside a unit used on some ranks only, between other units."""
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1,
                                 "overlap_comm": True}}
    engine, _, _, _ = zerodp.initialize(model=GatedNet(), config=cfg, process_group=group)
    for step in range(steps):
        engine.backward(engine(gated_batch(step, rank), gated_use(step, rank)))
        engine.step()
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        out = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    units = [u.name for u in engine.units]
    engine.destroy()
    return {"params": out, "units": units}

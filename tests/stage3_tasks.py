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

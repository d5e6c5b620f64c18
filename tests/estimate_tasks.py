"""Worker tasks and factories for the memory estimator tests (``test_estimate.py``)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from zerodp.tools.memory_check import compare_with_engine

#: Devices the parameters of the last ``recording_mlp`` were created on.
BUILT_ON: list[str] = []


def build_mlp(widths: list[int], bias: bool = True) -> nn.Module:
    """Linear layers with tanh between them (no seeding: the estimator only counts)."""
    layers = [nn.Linear(a, b, bias=bias) for a, b in zip(widths[:-1], widths[1:])]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())])


def recording_mlp(widths: list[int], frozen_first: bool = False) -> nn.Module:
    """A factory for ``--model estimate_tasks:recording_mlp``: records where it was built."""
    model = build_mlp(widths)
    if frozen_first:
        model[0].weight.requires_grad_(False)
    BUILT_ON[:] = sorted({p.device.type for p in model.parameters()})
    return model


def not_a_module() -> str:
    return "not a module"


def compare(group, stage: int, widths: list[int], bucket: int, steps: int = 1,
            bf16: bool = False) -> dict:
    """Train the MLP with AdamW (fp32, or bf16 with fp32 masters) for ``steps`` steps; return
    this rank's ledger, the estimator's comparison rows and the flat-group layout."""
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    model = build_mlp(widths)
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**9,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                 "stage3_param_persistence_threshold": 1},
           "bf16": {"enabled": bf16}}
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, process_group=group)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(2, widths[0], generator=gen)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    rows = compare_with_engine(engine)
    out = {"memory": engine.memory_breakdown(),
           "rows": {r.category: {"estimated": r.estimated, "measured": r.measured, "slack": r.slack,
                                 "shortfall": r.shortfall, "kind": r.kind, "ok": r.ok} for r in rows},
           "groups": [(g.numel, g.padded_numel, g.trainable) for g in engine.flat_groups]}
    engine.destroy()
    return out

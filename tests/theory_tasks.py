"""Worker tasks for the memory and communication accounting tests."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zerodp


def build_known_model(widths: list[int], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(a, b, bias=False) for a, b in zip(widths[:-1], widths[1:])]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())])


def measure(group, stage: int, widths: list[int], gas: int = 1, steps: int = 2,
            bucket: int = 500_000_000, precision: str = "fp32", prefetch: int = 50_000_000) -> dict:
    """Train a bias-free MLP with AdamW (``precision``: fp32, bf16 or fp16; ``prefetch``: the
    stage-3 prefetch bucket, elements); return the engine's ledger and byte counts."""
    rank = dist.get_rank(group)
    model = build_known_model(widths)
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**9,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "overlap_comm": True,
                                 "stage3_param_persistence_threshold": 1,
                                 "stage3_prefetch_bucket_size": prefetch,
                                 "stage3_max_reuse_distance": 0}}
    if precision != "fp32":  # a small fp16 loss scale: no overflow, so no skipped step
        cfg[precision] = {"enabled": True, **({"initial_scale_power": 4} if precision == "fp16" else {})}
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, process_group=group)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps * gas):
        x = torch.randn(3, widths[0], generator=gen)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert engine.skipped_steps == 0
    held = [g.grads.full if g.grads.full is not None else g.grads.shard for g in engine.trainable]
    out = {"memory": engine.memory_breakdown(), "comm": engine.comm_stats(),
           "layout": [(g.numel, g.padded_numel) for g in engine.flat_groups],
           # gradient memory still allocated after the update
           "grads_between_steps": sum(t.numel() * t.element_size() for t in held if t is not None)}
    engine.destroy()
    return out


def collective_buffers(group, stage: int, widths: list[int], gas: int = 1) -> dict:
    """The ledger's ``collective_buffers`` after two steps of ``gas`` micro-batches, with the
    pool emptied first, and what the pool holds once the engine is destroyed."""
    from zerodp.core.collectives import SCRATCH
    SCRATCH.release()
    out = measure(group, stage, widths, gas=gas, bucket=1)  # one bucket per group
    out["held_after_destroy"] = SCRATCH.held_bytes
    return out

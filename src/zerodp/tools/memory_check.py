"""Estimated vs measured memory: the ZeRO accounting (``estimator/``) beside a live
engine's ledger (``engine.memory_breakdown()``), with the padding each may differ by.

``compare_with_engine(engine)`` returns one :class:`Comparison` per category and
``format_comparison`` prints them; ``zerodp train`` prints rank 0's estimate under its
memory table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ..core.flat import ALIGN_BYTES
from ..estimator import FP32, EstimateError, ModelInfo, estimate_buffers

if TYPE_CHECKING:
    from ..engine import ZeroEngine

__all__ = ["Comparison", "compare_with_engine", "format_comparison"]


def _elementwise_states(optimizer: torch.optim.Optimizer, group: dict) -> int:
    """State values per parameter element that ``optimizer`` keeps for ``group``."""
    name = type(optimizer).__name__.lower()
    if name == "muonwithauxadam":  # Muon's momentum; its AdamW half's two moments
        return 1 if group.get("use_muon") else 2
    if name in ("adam", "adamw"):
        return 3 if group.get("amsgrad") else 2
    if name == "sgd":
        return 1 if group.get("momentum", 0) else 0
    if name == "rmsprop":
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    counts = {"adamax": 2, "nadam": 2, "radam": 2, "adadelta": 2, "adagrad": 1, "lion": 1, "asgd": 1}
    if name not in counts:
        raise EstimateError("optimizer", f"no state count known for {type(optimizer).__name__}; "
                            f"known: Adam, AdamW, SGD, RMSprop, MuonWithAuxAdam, "
                            f"{', '.join(c.title() for c in counts)}")
    return counts[name]


@dataclass(frozen=True)
class Comparison:
    """One category on this rank: the estimate, the engine's measurement, and how far apart
    they may be. ``exact``: estimated - ``shortfall`` <= measured <= estimated + ``slack``
    (padding); ``upper bound``: measured <= estimated + ``slack``."""

    category: str
    estimated: Optional[int]
    measured: int
    slack: int
    shortfall: int = 0
    kind: str = "exact"

    @property
    def ok(self) -> bool:
        if self.estimated is None:
            return True
        low = self.estimated - self.shortfall if self.kind == "exact" else 0
        return low <= self.measured <= self.estimated + self.slack


def compare_with_engine(engine: "ZeroEngine") -> list[Comparison]:
    """This rank's estimated and measured bytes per category of ``engine.memory_breakdown()``.

    The estimate uses the engine's real parameter count, stage, world size, dtypes and
    optimizer (measure after at least one step: optimizers create their state lazily); 16-bit
    groups count an fp32 master copy and fp32 optimizer states (the ``mixed`` accounting).

    Padding (``flat.py``): flat group ``g`` of ``n_g`` elements splits into P shards (P = N
    from stage 1, else 1) of ``S_g`` elements, ``ceil(n_g / P)`` rounded up to a multiple of
    ``a = 16 / parameter element size``, so ``n_g/P <= S_g < n_g/P + a``. A shard therefore
    exceeds its share by fewer than ``a`` elements per group and a full buffer by fewer than
    ``a·P``. Master copies and optimizer states may exist for a rank's real elements only:
    rank 0 always holds a whole shard (at least the average); later ranks may hold up to
    ``(P - 1)·a`` elements fewer per group.
    """
    groups, trained = engine.flat_groups, engine.trainable
    stage, n = engine.zero_stage, engine.comm.world_size  # the ranks ZeRO shards over
    parts = n if stage >= 1 else 1
    measured = engine.memory_breakdown()

    def param_bytes(g) -> int:
        return g.full.element_size()

    def grad_bytes(g) -> int:
        return g.grads.dtype.itemsize

    def master_bytes(g) -> int:  # 16-bit groups, and every group under optimizer offload
        offloaded = getattr(engine, "offload", None) is not None
        return FP32 if g.dtype in (torch.float16, torch.bfloat16) or offloaded else 0

    def state_bytes(g) -> int:
        count = _elementwise_states(engine.optimizer, engine.optimizer.param_groups[g.param_group])
        return count * (master_bytes(g) or param_bytes(g))

    def share(bytes_of, gs, ranks: int) -> int:
        return -(-sum(bytes_of(g) * g.numel for g in gs) // ranks)

    def padding(bytes_of, gs, shards: int) -> int:
        """Most bytes that padding adds to ``shards`` shards of every group in ``gs``."""
        return sum(ALIGN_BYTES // param_bytes(g) * shards * bytes_of(g) for g in gs)

    sharded_params, sharded_grads = stage == 3, stage >= 2
    rows = [
        Comparison("parameters", share(param_bytes, groups, n if sharded_params else 1),
                   measured["parameters"], padding(param_bytes, groups, 1 if sharded_params else parts)),
        Comparison("gradients", share(grad_bytes, trained, n if sharded_grads else 1),
                   measured["gradients"], padding(grad_bytes, trained, 1 if sharded_grads else parts)),
        Comparison("master_weights", share(master_bytes, trained, parts), measured["master_weights"],
                   padding(master_bytes, trained, 1), padding(master_bytes, trained, parts - 1)),
        Comparison("optimizer_states", share(state_bytes, trained, parts), measured["optimizer_states"],
                   padding(state_bytes, trained, 1), padding(state_bytes, trained, parts - 1)),
    ]
    rows.append(Comparison("model_states", sum(r.estimated for r in rows), measured["model_states"],
                           sum(r.slack for r in rows), sum(r.shortfall for r in rows)))
    rows += _compare_buffers(engine, measured, max(grad_bytes(g) for g in trained),
                             max(param_bytes(g) for g in groups))
    rows.append(Comparison("optimizer_scalars", None, measured["optimizer_scalars"], 0,
                           kind="not estimated"))
    return rows


def _compare_buffers(engine: "ZeroEngine", measured: dict, grad_elem: int,
                     param_elem: int) -> list[Comparison]:
    """Peak gradient buckets (stages 2-3) and stage-3 gathered parameters: upper bounds, with
    the padding of every group as slack (buckets and gathered buffers are full-size)."""
    stage, n = engine.zero_stage, engine.comm.world_size
    trained, groups = engine.trainable, engine.flat_groups
    largest = max((s.numel for g in groups for s in g.slots), default=0)  # stage 3: parameters are empty
    units = engine.sharded.unit_sizes() if getattr(engine, "sharded", None) is not None else []
    info = ModelInfo("engine", "module", sum(g.numel for g in groups), sum(g.numel for g in trained),
                     largest, units[0] if units else 0, max(units[1:], default=0))
    zc = engine.zero_config
    sizes = (int(zc.reduce_bucket_size), int(zc.stage3_max_live_parameters))
    buckets = estimate_buffers(info, grad_elem, *sizes).gradient_buckets(stage)
    gathered = estimate_buffers(info, param_elem, *sizes).gathered if stage == 3 else 0
    return [Comparison("gradient_buckets_peak", buckets,
                       measured["gradient_buckets_peak"],
                       len(trained) * ALIGN_BYTES * n if stage >= 2 else 0, kind="upper bound"),
            Comparison("gathered_parameters_peak", gathered, measured["gathered_parameters_peak"],
                       len(groups) * ALIGN_BYTES * n if stage == 3 else 0, kind="upper bound")]


def format_comparison(rows: list[Comparison]) -> str:
    """A table of estimated vs measured bytes (one rank)."""
    head = ("category", "estimated", "measured", "allowed", "ok")
    body = []
    for r in rows:
        if r.estimated is None:
            allowed = "not estimated"
        elif r.kind == "upper bound":
            allowed = f"<= {r.estimated + r.slack:,}"
        else:
            allowed = f"{r.estimated - r.shortfall:,} .. {r.estimated + r.slack:,}"
        body.append((r.category, "-" if r.estimated is None else f"{r.estimated:,}",
                     f"{r.measured:,}", allowed, "yes" if r.ok else "NO"))
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths)))
                     for line in (head, *body))

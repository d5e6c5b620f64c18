"""Which layout is fastest: :func:`rank_layouts` tries tensor x pipeline x data-parallel splits,
micro-batch sizes and activation checkpointing for a fixed global batch, keeps every stage and
offload that fits, and ranks them by predicted step time (``zerodp estimate --time --search``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from torch import nn

from .cluster import Cluster, resolve_cluster
from .inputs import _gb, _positive_int
from .model import ModelInfo, resolve_model
from .recommend import estimate
from .stages import Row


@dataclass(frozen=True)
class Layout:
    """One configuration that fits, with its predicted step."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    gradient_accumulation: int
    checkpointing: bool
    row: Row
    virtual_stages: int = 1

    @property
    def label(self) -> str:
        ckpt = ", checkpointing" if self.checkpointing else ""
        chunks = f" ({self.virtual_stages} chunks, interleaved)" if self.virtual_stages > 1 else ""
        return (f"TP {self.tp} x PP {self.pp}{chunks} x DP {self.dp}, {self.row.label}, micro-batch "
                f"{self.micro_batch} x {self.gradient_accumulation}{ckpt}")

    def to_dict(self) -> dict:
        t = self.row.step_time
        return {"tp": self.tp, "pp": self.pp, "virtual_stages": self.virtual_stages, "dp": self.dp,
                "micro_batch": self.micro_batch,
                "gradient_accumulation": self.gradient_accumulation, "checkpointing": self.checkpointing,
                "stage": self.row.stage, "offload": self.row.offload, "label": self.label,
                "device_total": self.row.device_total, "step_time_s": t.step_time_s, "tokens_per_s": t.tokens_per_s,
                "tokens_per_s_per_device": t.tokens_per_s_per_device, "mfu": t.mfu, "step": t.to_dict()}


@dataclass
class Search:
    layouts: list[Layout]
    """The layouts that fit, fastest first: for each split, stage and offload, its fastest micro-batch
    and checkpointing choice."""
    tried: int
    cluster: Cluster
    global_batch: int
    seq_len: int

    @property
    def reason(self) -> str:
        if not self.layouts:
            return (f"none of the {self.tried} layouts tried fits; use more devices, offload or a smaller "
                    "micro-batch")
        best, t = self.layouts[0], self.layouts[0].row.step_time
        text = (f"{best.label}: {t.step_time_s:.3g} s per step, {t.tokens_per_s_per_device:,.0f} tokens/s per "
                f"device, {100 * t.mfu:.0f}% of peak, most of it {t.dominant}")
        if len(self.layouts) > 1:
            nxt = self.layouts[1]
            text += f"; next: {nxt.label} at {nxt.row.step_time.step_time_s / t.step_time_s:.2f}x"
        return text

    def format(self, top: int = 10) -> str:
        head = (f"{self.tried} layouts tried on {self.cluster.name} (global batch {self.global_batch} x "
                f"{self.seq_len} tokens); the fastest of each split, stage and offload that fit, fastest first:")
        lines = [head, "  #  step s   tok/s/dev   MFU  device  layout"]
        for i, lay in enumerate(self.layouts[:top], 1):
            t = lay.row.step_time
            lines.append(f"{i:3d}  {t.step_time_s:6.3g}  {t.tokens_per_s_per_device:10,.0f}  {100 * t.mfu:3.0f}%  "
                         f"{_gb(lay.row.device_total):>6}  {lay.label}")
        lines.append(f"fastest: {self.reason}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"cluster": self.cluster.to_dict(), "global_batch": self.global_batch, "seq_len": self.seq_len,
                "tried": self.tried, "layouts": [lay.to_dict() for lay in self.layouts], "reason": self.reason}


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= limit and n % d == 0]


def rank_layouts(model: Union[str, int, nn.Module, ModelInfo], *, cluster: Union[str, dict, Cluster],
                 global_batch: int, seq_len: int, nodes: int = 1, ranks_per_node: Optional[int] = None,
                 micro_batches: Sequence[int] = (1, 2, 4, 8, 16), checkpointing: Sequence[bool] = (False, True),
                 model_kwargs: Union[None, str, dict] = None, recalibrate: bool = False, **options) -> Search:
    """Every layout of ``global_batch`` sequences of ``seq_len`` tokens per step on ``nodes`` nodes of
    ``cluster`` (``ranks_per_node`` default: the cluster's devices per node) that fits: tensor-parallel
    sizes within a node, pipeline stages up to the layer count (1F1B, and interleaved with 2 or 4
    chunks per stage where they divide the layers and the micro-batches are a multiple of the
    stages), each micro-batch size that divides the batch, with and without activation
    checkpointing, at every ZeRO stage and offload; ranked by
    predicted step time. ``options`` go to :func:`zerodp.estimate` (``precision``, ``optimizer``, ...)."""
    machines = resolve_cluster(cluster, recalibrate=recalibrate)
    ranks_per_node = _positive_int(ranks_per_node or machines.devices_per_node, "ranks_per_node")
    global_batch = _positive_int(global_batch, "global_batch")
    seq_len = _positive_int(seq_len, "seq_len")
    info = resolve_model(model, model_kwargs)
    world = _positive_int(nodes, "nodes") * ranks_per_node
    layers = info.transformer.layers if info.transformer else 1
    # without layer shapes tensor parallelism's traffic is unknown: data parallelism only
    most_tp = ranks_per_node if info.transformer else 1
    found, tried = [], 0
    for tp in _divisors(ranks_per_node, most_tp):
        for pp in _divisors(world // tp, layers):
            dp = world // (tp * pp)
            for mb in micro_batches:
                if global_batch % (dp * mb):
                    continue
                gas = global_batch // (dp * mb)
                # the interleaved schedule: 2 or 4 chunks per stage where they divide the layers
                chunks = [1] + [v for v in (2, 4) if pp > 1 and not gas % pp and not layers % (pp * v)]
                for ckpt, v in ((c, v) for c in checkpointing for v in chunks):
                    est = estimate(info, nodes=nodes, ranks_per_node=ranks_per_node, tp=tp, pp=pp, micro_batch=mb,
                                   seq_len=seq_len, checkpointing=ckpt, cluster=machines, gradient_accumulation=gas,
                                   virtual_stages=v, **options)
                    for row in [r for r in est.rows if r.runnable]:
                        tried += 1
                        if row.fits is not False:
                            found.append(Layout(tp, pp, dp, mb, gas, ckpt, row, v))
    # fastest first; among equals the simpler: lower stage, no offload, no recomputation, fewer splits
    found.sort(key=lambda lay: (round(lay.row.step_time.step_time_s, 9), lay.row.stage, lay.row.offload != "none",
                                lay.checkpointing, lay.tp * lay.pp, lay.virtual_stages, -lay.micro_batch))
    best: dict = {}
    for lay in found:  # one per split, stage and offload: its fastest micro-batch, checkpointing and chunks
        best.setdefault((lay.tp, lay.pp, lay.row.stage, lay.row.offload), lay)
    return Search(list(best.values()), tried, machines, global_batch, seq_len)

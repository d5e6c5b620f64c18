"""The estimate's result, :class:`Estimate`, and its text: the table of configurations and the
report ``zerodp estimate`` prints."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Optional

from .inputs import _gb, _num

if TYPE_CHECKING:
    from .accounting import Accounting, OptimizerSpec
    from .activations import Activations
    from .buffers import Buffers
    from .cluster import Cluster
    from .model import ModelInfo
    from .stages import Row


@dataclass
class Estimate:
    """Everything ``zerodp estimate`` prints; :meth:`to_dict` for JSON, :meth:`format` for text."""

    model: ModelInfo
    nodes: int
    ranks_per_node: int
    precision: str
    optimizer: OptimizerSpec
    accounting: Accounting
    device_memory: Optional[int]
    cpu_memory: Optional[int]
    buffers: Buffers
    activations: Activations
    rows: list[Row]
    recommendation: Optional[Row]
    reason: str
    notes: list[str] = field(default_factory=list)
    tp: int = 1
    """Tensor-parallel size: the model is one rank's slice of it."""
    shard_size: Optional[int] = None
    """The ranks ZeRO shards over (N in the formulas): data-parallel ranks, or a hybrid group."""
    pp: int = 1
    """Pipeline stages: the model is one stage's share of it."""
    cluster: Optional[Cluster] = None
    """The cluster step times were predicted for (None: memory only)."""
    hpz: int = 1
    """ZeRO++ hpZ's secondary group size (1: off)."""
    sp: int = 1
    """Ulysses sequence-parallel size (1: off)."""
    ep: int = 1
    """Expert-parallel size (1: off)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def shards(self) -> int:
        return self.shard_size or self.world_size // (self.tp * self.pp)

    def row(self, stage: int, offload: str = "none") -> Row:
        """The row of ``stage`` with ``offload``."""
        return next(r for r in self.rows if (r.stage, r.offload) == (stage, offload))

    def to_dict(self) -> dict:
        rec = self.recommendation
        return {
            "model": asdict(self.model),
            "nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "world_size": self.world_size,
            "tp": self.tp, "pp": self.pp, "sp": self.sp, "ep": self.ep, "shards": self.shards, "hpz": self.hpz,
            "precision": self.precision,
            "optimizer": asdict(self.optimizer),
            "accounting": {**asdict(self.accounting), "k": self.accounting.k,
                           "description": self.accounting.describe(self.optimizer),
                           "formulas": self.accounting.formulas()},
            "device_memory": self.device_memory, "cpu_memory_per_node": self.cpu_memory,
            "units": "bytes per rank unless named per node",
            "buffers": asdict(self.buffers),
            "activations": asdict(self.activations),
            "rows": [r.to_dict() for r in self.rows],
            "recommendation": None if rec is None else {"stage": rec.stage, "offload": rec.offload,
                                                        "label": rec.label},
            "reason": self.reason,
            "notes": self.notes,
            "cluster": None if self.cluster is None else self.cluster.to_dict(),
        }

    def format(self) -> str:
        """The human-readable report."""
        return format_estimate(self)


def _unit_for(largest: int) -> tuple[str, int]:
    for name, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if largest >= size:
            return name, size
    return "B", 1


def _fits_text(row: Row) -> str:
    if row.fits_device is None:
        return "?"
    if not row.fits_device:
        return "no"
    if row.fits_cpu is False:
        return "no (CPU)"
    return "yes (CPU unchecked)" if row.offload != "none" and row.fits_cpu is None else "yes"


def _table(est: Estimate) -> list[str]:
    unit, size = _unit_for(est.row(0).model_states)  # the largest model states set the unit

    def cell(b: Optional[int]) -> str:
        if b is None:
            return "-"
        return f"{b / size:.1f}" if size > 1 else str(b)

    timed, hpz = est.cluster is not None, est.hpz > 1
    head = ["configuration", "params", "grads", "master", "optim"] + (["hpZ copy"] if hpz else []) + [
        "states", "buffers", "activ", "device", "CPU/node"] + (["step s", "tok/s/dev"] if timed else []) + ["fits"]
    lines = [[r.label, cell(r.parameters), cell(r.gradients), cell(r.master_weights),
              cell(r.optimizer_states)] + ([cell(r.secondary_parameters)] if hpz else []) + [
              cell(r.model_states), cell(r.buffers), cell(r.activations),
              cell(r.device_total), cell(r.cpu_per_node) if r.offload != "none" else "-"]
             + ([f"{r.step_time.step_time_s:.3g}", f"{r.step_time.tokens_per_s_per_device:,.0f}"] if timed else [])
             + [_fits_text(r)] for r in est.rows]
    widths = [max(len(x[i]) for x in [head] + lines) for i in range(len(head))]

    def fmt(cols: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in (0, len(cols) - 1) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cols, widths))).rstrip()
    copy = " + hpZ copy (the secondary parameters)" if hpz else ""
    legend = (f"{unit} per rank ({unit} = {size:,} bytes); states = params + grads + master + "
              f"optim (optimizer states){copy}; device = states + buffers + activ (activations); "
              "CPU/node = offloaded states of all ranks of a node")
    return [legend, fmt(head)] + [fmt(x) for x in lines]


_SOURCES = {"count": "a parameter count", "factory": "a factory, built on the meta device",
            "transformers": "a transformers config, built on the meta device", "module": "a module"}


def format_estimate(est: Estimate) -> str:
    """The report ``zerodp estimate`` prints."""
    m, acc = est.model, est.accounting
    device = _gb(est.device_memory) if est.device_memory else "not given"
    cpu = _gb(est.cpu_memory) if est.cpu_memory else "not given"
    trained = "" if m.trainable_params == m.params else f", {_num(m.trainable_params)} trainable"
    lines = [
        f"model: {m.description} ({_SOURCES[m.source]}): {_num(m.params)} parameters{trained}",
        f"ranks: {est.nodes} node(s) x {est.ranks_per_node} = {est.world_size}; precision "
        f"{est.precision}; optimizer {est.optimizer.name}; device memory {device}; "
        f"CPU memory per node {cpu}",
        f"accounting: {acc.describe(est.optimizer)}",
        f"  model states per rank: {acc.formulas()} (Ψ parameters, N = {est.shards} ranks"
        + (f"; Ψ per tensor-parallel rank of {est.tp}" if est.tp > 1 else "")
        + (f"; Ψ per pipeline stage of {est.pp}" if est.pp > 1 else "")
        + (f"; experts over groups of {est.ep}: their states over N/{est.ep}" if est.ep > 1 else "") + ")",
        "",
        *_table(est),
        "",
        "buffers (stages 2-3, in 'buffers' above):",
        f"  gradient buckets: stage 2 {_gb(est.buffers.buckets_stage2)}, stage 3 "
        f"{_gb(est.buffers.buckets_stage3)}: {est.buffers.bucket_note}",
        f"  gathered parameters (stage 3): {_gb(est.buffers.gathered)} = {est.buffers.gathered_note}",
    ]
    a = est.activations
    if a.bytes is None:
        lines.append(f"activations: {a.note}; 'fits' counts model states and buffers only")
    else:
        lines += [f"activations: {_gb(a.bytes)} per rank (micro-batch {a.micro_batch}, sequence "
                  f"{a.seq_len}" + (f", {a.seq_len // a.sp} per rank" if a.sp > 1 else "")
                  + f"; per layer {_gb(a.per_layer)}, logits {_gb(a.logits)}), included in 'fits'"
                  + (f"; {_gb(a.host)} in host memory" if a.host else ""),
                  f"  formula: {a.formula}", f"  {a.note}"]
    longest = [(r.label, r.longest_seq) for r in est.rows if r.runnable and r.longest_seq is not None]
    if est.device_memory and a.bytes is not None:
        lines.append(f"longest sequence within {_gb(est.device_memory)} (micro-batch {a.micro_batch}"
                     + (f", sequence-parallel {est.sp}" if est.sp > 1 else "") + "): "
                     + ("; ".join(f"{label} {n:,}" for label, n in longest) if longest else "none fits"))
    lines += [f"note: {n}" for n in est.notes if n != a.note]
    if est.cluster is not None and est.recommendation is not None:
        t = est.recommendation.step_time
        lines.append(f"step time of {est.recommendation.label}: compute {t.compute_s:.3g} s, exposed "
                     f"communication {t.communication_s:.3g} s, optimizer {t.optimizer_s:.3g} s, offload "
                     f"{t.offload_s:.3g} s, pipeline bubble {t.bubble_s:.3g} s")
    label = est.recommendation.label if est.recommendation else "none"
    lines.append(f"recommendation: {label}: {est.reason}")
    return "\n".join(lines)

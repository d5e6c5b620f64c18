"""Per-rank memory of each ZeRO stage with and without offload: one :class:`Row` per
configuration (model states, buffers, activations, the CPU side) and whether it fits."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

from .accounting import FP32, Accounting
from .buffers import Buffers
from .model import ModelInfo
from .timing import StepTime

ROW_KEYS = [(0, "none"), (0, "optimizer"), (1, "none"), (1, "optimizer"), (2, "none"),
            (2, "optimizer"), (3, "none"), (3, "optimizer"), (3, "optimizer+params")]


def _share(bytes_per_element: int, elements: int, ranks: int) -> int:
    """Bytes of ``elements`` split over ``ranks`` (rounded up to whole bytes)."""
    return -(-bytes_per_element * elements // ranks)


@dataclass(frozen=True)
class Row:
    """One configuration's memory per rank, in bytes. Device columns: ``parameters``,
    ``gradients``, ``master_weights``, ``optimizer_states`` (model states), then
    ``gradient_buckets``, ``gathered_parameters`` and ``activations`` (None: unknown).
    ``cpu`` is what offload keeps in CPU memory per rank, ``cpu_per_node`` for all ranks of a
    node. ``fits`` is None when no device memory was given."""

    stage: int
    offload: str
    parameters: int
    gradients: int
    master_weights: int
    optimizer_states: int
    gradient_buckets: int
    gathered_parameters: int
    activations: Optional[int]
    cpu: int
    cpu_per_node: int
    secondary_parameters: int = 0
    """hpZ's secondary copy of the parameters (stage 3, ``zero_hpz_partition_size``): 16-bit, 1/k."""
    fits_device: Optional[bool] = None
    fits_cpu: Optional[bool] = None
    step_time: Optional[StepTime] = None
    """Predicted step time on a cluster (``estimate(..., cluster=...)``), else None."""
    longest_seq: Optional[int] = None
    """The longest sequence whose activations fit beside this row's states and buffers (device memory given)."""

    @property
    def label(self) -> str:
        extra = {"none": "", "optimizer": " + offload opt",
                 "optimizer+params": " + offload opt+params"}[self.offload]
        return f"stage {self.stage}{extra}"

    @property
    def runnable(self) -> bool:
        """Whether zerodp runs this configuration: offload needs stage 1 or more (the stage 0
        offload row is there for comparison only)."""
        return self.stage > 0 or self.offload == "none"

    @property
    def model_states(self) -> int:
        return (self.parameters + self.gradients + self.master_weights + self.optimizer_states
                + self.secondary_parameters)

    @property
    def buffers(self) -> int:
        return self.gradient_buckets + self.gathered_parameters

    @property
    def device_total(self) -> int:
        return self.model_states + self.buffers + (self.activations or 0)

    @property
    def fits(self) -> Optional[bool]:
        if self.fits_device is None:
            return None
        return self.fits_device and self.fits_cpu is not False

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(label=self.label, model_states=self.model_states, buffers=self.buffers,
                   device_total=self.device_total, fits=self.fits)
        if self.step_time is not None:
            out.update(step_time_s=self.step_time.step_time_s, tokens_per_s=self.step_time.tokens_per_s)
        return out


def estimate_row(acc: Accounting, model: ModelInfo, stage: int, offload: str, n: int,
                 ranks_per_node: int, buffers: Buffers, activations: Optional[int], hpz: int = 1) -> Row:
    """Per-rank memory of ``stage`` with ``offload`` ("none", "optimizer", "optimizer+params").

    Without offload: parameters sharded at stage 3, gradients from stage 2, master weights and
    optimizer states from stage 1. With optimizer offload, the device keeps only the 16-bit
    parameters and gradients (or their shards); the CPU holds, for this rank's optimizer
    partition, the weights it updates (the fp32 master, or the parameters without one) and the
    optimizer states (the gradient shard comes to the CPU a tile at a time, through transfer
    buffers of at most ``sub_group_size`` elements, not counted here). Parameter offload (stage
    3) moves the parameter shard to the CPU too. ``hpz`` (stage 3): hpZ's secondary copy of the
    parameters, sharded over ``hpz`` ranks, in the parameters' dtype, beside the shards (on the CPU
    with parameter offload), as DeepSpeed keeps it.
    """
    psi, trained = model.params, model.trainable_params
    opt_ranks = n if stage >= 1 else 1
    params = _share(acc.params, psi, n if stage == 3 else 1)
    grads = _share(acc.grads, trained, n if stage >= 2 else 1)
    master = _share(acc.master, trained, opt_ranks)
    states = _share(acc.states, trained, opt_ranks)
    cpu = 0
    if offload != "none":
        weights = FP32 if acc.master else acc.params  # what the CPU optimizer updates
        cpu = _share(weights + acc.states, trained, opt_ranks)
        master = states = 0
    secondary = _share(acc.params, psi, hpz) if stage == 3 and hpz > 1 else 0
    if offload == "optimizer+params":
        cpu += params + secondary
        params = secondary = 0
    return Row(stage, offload, params, grads, master, states,
               gradient_buckets=buffers.gradient_buckets(stage),
               gathered_parameters=buffers.gathered if stage == 3 else 0,
               activations=activations, cpu=cpu, cpu_per_node=cpu * ranks_per_node, secondary_parameters=secondary)


def _with_fit(row: Row, device_memory: Optional[int], cpu_memory: Optional[int]) -> Row:
    fits_device = None if device_memory is None else row.device_total <= device_memory
    fits_cpu = None if cpu_memory is None or row.offload == "none" else row.cpu_per_node <= cpu_memory
    return replace(row, fits_device=fits_device, fits_cpu=fits_cpu)

"""ZeRO++ hpZ: a secondary copy of a stage-3 flat group's parameters, sharded over a few ranks.

With ``zero_hpz_partition_size: k`` the optimizer states, fp32 masters, gradients and the
parameters' own (primary) shards stay sharded over all N data-parallel ranks, as plain stage 3
keeps them. What hpZ adds is a second, 16-bit (the parameters' dtype) copy of the parameters,
sharded over groups of k consecutive data-parallel ranks (a node): a gather over all N ranks (the
first of a step, in forward) also keeps this rank's k-th of the full buffer, and the gathers that
follow (backward's, and later micro-batches' in the same accumulation window) all-gather those
parts within the k ranks only, over the fast links inside a node. The copy of a trained group is
dropped after each optimizer step, since the parameters changed; a frozen group's is kept (it
never goes stale), as DeepSpeed keeps it. Memory per rank: plain stage 3 plus 2Ψ/k bytes (16-bit);
traffic over the whole data-parallel group: one gather per step instead of two or more.

A :class:`SecondaryCopy` belongs to one flat group (``FlatGroup.secondary``): the group asks it to
keep its part after a gather over all ranks and to fill the full buffer before a gather within the
k ranks; ``ShardAxes.gather`` (``axes.py``) sends a group whose copy is there over the copy's own ``comm``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from .collectives import Comm


class SecondaryCopy:
    """This rank's part of hpZ's secondary copy of one flat group (see module docstring).

    ``comm``: the k consecutive data-parallel ranks this rank shares the copy with (rank ``i``
    of them keeps the ``i``-th of ``k`` equal parts of the padded full buffer, ``padded_numel``
    elements); ``pin``: keep the copy in page-locked host memory when it lives on the host of a GPU
    machine (parameter offload)."""

    def __init__(self, comm: "Comm", padded_numel: int, pin: bool = False) -> None:
        k = comm.world_size
        if padded_numel % k:
            raise ValueError(f"hpZ: a flat group of {padded_numel} elements does not split into {k} parts")
        self.comm = comm
        self.numel = padded_numel // k
        self.lo = comm.rank * self.numel
        self.pin = pin
        self.tensor: Optional[torch.Tensor] = None

    @property
    def valid(self) -> bool:
        """Whether the copy holds the parameters' current values (a gather within the k ranks can
        then replace one over every rank)."""
        return self.tensor is not None

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()

    def keep(self, full: torch.Tensor, device: torch.device) -> None:
        """Keep this rank's part of ``full`` (just gathered over every rank), on ``device`` (where
        the group's primary shard lives)."""
        part = full[self.lo:self.lo + self.numel]
        pin = self.pin and device.type == "cpu" and full.device.type == "cuda"
        self.tensor = torch.empty(self.numel, dtype=full.dtype, device=device, pin_memory=pin)
        self.tensor.copy_(part)

    def fill(self, full: torch.Tensor) -> None:
        """Put this rank's part into ``full`` before the all-gather within the k ranks."""
        full[self.lo:self.lo + self.numel].copy_(self.tensor, non_blocking=True)

    def drop(self) -> None:
        """The parameters changed (an optimizer step, a load, an edit): the copy is stale."""
        self.tensor = None

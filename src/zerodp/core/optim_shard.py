"""OptimizerShard: what the optimizer updates for one trainable flat group on this rank.

A flat group (``flat.py``) holds parameter storage; the optimizer's side of it lives here:

* ``master``: an fp32 copy of this rank's shard when the parameters are 16-bit, or when the
  optimizer runs on the host (``offload/optimizer.py``); ``None`` when the optimizer updates
  the group's shard itself (fp32 training on the device);
* ``leaves``: for each parameter that overlaps the shard (each ``Piece``), a leaf tensor aliasing
  that part of the master (or shard). The optimizer sees these, so each parameter keeps its own
  optimizer state and step count, exactly as an unsharded optimizer would;
* ``page``: with optimizer offload to disk, the file that master and states live in
  (``offload/swap.py``); ``FlatGroup.swapped_in`` brings it in with the group's own pages.

The engine makes one per trainable group (``OptimizerShard.on_device``; the offload makes its
own) and reaches it as ``group.optim``; the update is ``attach_grads``, the optimizer's step,
``write_back``.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
from torch import nn

from .flat import FlatGroup


class OptimizerShard:
    """The optimizer's view of ``group``'s shard on this rank (see module docstring): leaves over
    ``master`` if given, else over the group's shard itself. Attaches itself as ``group.optim``."""

    def __init__(self, group: FlatGroup, master: Optional[torch.Tensor]) -> None:
        self.group = group
        self.master = master
        self.page: Optional[Any] = None
        values = master if master is not None else group.shard
        self.leaves: list[nn.Parameter] = [nn.Parameter(values[pc.shard_lo:pc.shard_hi], requires_grad=True)
                                           for pc in group.pieces]
        group.attach_optimizer(self)

    @classmethod
    def on_device(cls, group: FlatGroup, keep_master: bool) -> "OptimizerShard":
        """The optimizer on the group's device: over an fp32 copy of the shard if ``keep_master``
        (16-bit parameters), else over the shard itself."""
        master = group.shard.detach().to(torch.float32).clone() if keep_master else None
        return cls(group, master)

    def values(self) -> torch.Tensor:
        """The most precise values of the shard: the fp32 master if there is one, else the shard."""
        return self.master if self.master is not None else self.group.shard

    def attach_grads(self, used: list[bool], grad: torch.Tensor) -> None:
        """Point each leaf's ``.grad`` at its part of ``grad`` (the reduced gradient shard, or an
        fp32 copy of it); ``None`` where the parameter got no gradient on any rank (the optimizer
        then skips it, as unsharded PyTorch does)."""
        for pc, leaf in zip(self.group.pieces, self.leaves):
            leaf.grad = grad[pc.shard_lo:pc.shard_hi] if used[pc.slot] else None

    def clear_grads(self) -> None:
        for leaf in self.leaves:
            leaf.grad = None

    def write_back(self) -> None:
        """Round the updated fp32 master into the group's parameter shard (nothing without one)."""
        if self.master is not None:
            with self.group.swapped_in():
                self.group.shard.copy_(self.master)

    def refresh(self) -> None:
        """Take the master from the parameter shard again (after the parameters were overwritten)."""
        if self.master is not None:
            with self.group.swapped_in():
                self.master.copy_(self.group.shard)


class HostOptimizer(Protocol):
    """What the engine's parts read of the optimizer when it runs on the host or from disk
    (``offload/optimizer.py``'s ``OptimizerOffload``, which the engine builds; declared here so
    that ``core/`` does not import ``offload/``)."""

    location: str             # "host" or "disk"
    peak_resident_bytes: int  # disk: the most bytes of tiles in memory at once

    @property
    def buffer_bytes(self) -> int: ...

    def adopt_states(self, g: FlatGroup, optimizer: torch.optim.Optimizer) -> None: ...


class WholeMatrixOptimizer(Protocol):
    """An optimizer whose update of a parameter needs the parameter whole (Muon, ``optim/muon.py``).
    It says so with ``whole_matrices = True``; the engine then calls ``plan_whole_matrices`` once,
    after building it, with the trainable groups, the comm of each group's shard axis, the
    engine's device (where NCCL's buffers must be) and the tensor-parallel ranks' comm, and
    before each step ``whole_matrix_update`` for every trainable group, in group order on every
    rank, with the group's fp32 gradient shard (unscaled, clipped, attached to the leaves), which
    the call replaces by the update (its collectives go through that comm)."""

    whole_matrices: bool
    comm_kinds: tuple[str, ...]  # what its collectives count under, declared to the engine's counter after planning

    def plan_whole_matrices(self, groups: list[FlatGroup], comm_of: Any, wire: torch.device,
                            tensor_comm: Any) -> None: ...

    def whole_matrix_update(self, group: FlatGroup, grad: torch.Tensor) -> None: ...


def needs_whole_matrices(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a :class:`WholeMatrixOptimizer`."""
    return bool(getattr(optimizer, "whole_matrices", False))


def values_of(group: FlatGroup) -> torch.Tensor:
    """A group's shard at its most precise: the optimizer's fp32 master if it keeps one, else the
    parameter shard (frozen groups have no optimizer shard)."""
    return group.optim.values() if group.optim is not None else group.shard


def master_of(group: FlatGroup) -> Optional[torch.Tensor]:
    """The optimizer's fp32 master of ``group``'s shard, or ``None``."""
    return group.optim.master if group.optim is not None else None


def leaves_of(group: FlatGroup) -> list[Optional[nn.Parameter]]:
    """The optimizer's leaf per piece of ``group``'s shard (``None`` each for a frozen group)."""
    return group.optim.leaves if group.optim is not None else [None] * len(group.pieces)

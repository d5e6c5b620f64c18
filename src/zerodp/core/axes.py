"""The axis each flat group shards and reduces over, and the stage-3 gather of a group.

Every flat group names one axis of the process grid (``FlatGroup.axis``). Its ``partitions`` are
that axis' ranks; its gradients are reduced over them; at stage 3 its parameters are gathered
from them; its optimizer shard, its part of the gradient norm and its checkpoint pieces are this
rank's part of that axis. ``ShardAxes`` maps each axis name to its collectives (``Comm``), and is
what the reducer, ``ShardedParams``, ``GatheredParameters`` and the checkpoint code look a group's
collectives up in.

Today's engine uses one axis, ``DATA``: the ranks ZeRO shards over (the data-parallel ranks of a
pipeline stage and tensor rank, or a slice of them under hybrid sharding). A parallelism that
shards some parameters over other ranks (expert parameters over the expert-data ranks, say) adds
its axis to the engine's ``ShardAxes`` and names it for those parameters
(``parallel.Parallelism.shard_axis_of``); nothing else in the engine changes.

The stage-3 gather protocol lives here too (``ShardAxes.gather``), not in ``Comm``: a group's
full buffer is opened, all-gathered over the group's axis (or, with a valid hpZ copy, over the
copy's few ranks, ``secondary.py``), and handed back to the group to wait on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from .collectives import Comm, ScratchPool
    from .flat import FlatGroup

DATA = "data"
"""The axis of ZeRO's shard group; every flat group's axis unless a parallelism names another."""


class ShardAxes:
    """The collectives of every axis a flat group may shard over, by name (``DATA`` always)."""

    def __init__(self, comms: Mapping[str, "Comm"]) -> None:
        if DATA not in comms:
            raise ValueError(f"the shard axes must include '{DATA}' (got {sorted(comms)})")
        self._comms = dict(comms)

    @property
    def names(self) -> list[str]:
        return list(self._comms)

    def comm(self, name: str = DATA) -> "Comm":
        """The collectives of axis ``name``."""
        try:
            return self._comms[name]
        except KeyError:
            raise KeyError(f"no shard axis '{name}' (the engine has {sorted(self._comms)})") from None

    def of(self, group: "FlatGroup") -> "Comm":
        """The collectives of the axis ``group`` shards and reduces over."""
        return self.comm(group.axis)

    def with_axis(self, name: str, comm: "Comm") -> "ShardAxes":
        """These axes and one more (a parallelism's own)."""
        if name in self._comms:
            raise ValueError(f"shard axis '{name}' is already defined")
        return ShardAxes({**self._comms, name: comm})

    def using(self, scratch: "ScratchPool") -> "ShardAxes":
        """The same axes, their collectives borrowing transient buffers from ``scratch``."""
        return ShardAxes({n: c.using(scratch) for n, c in self._comms.items()})

    def gather(self, group: "FlatGroup", async_op: bool = False, what: str = "") -> None:
        """Stage 3: all-gather ``group``'s shards into its full buffer (``FlatGroup.open_for_gather``
        and ``gathering``) over its axis; with ``async_op`` (a prefetch) it goes on until
        ``group.wait_gathered()``. A group already gathered is left as it is (waited for, unless
        ``async_op``). A group with a valid hpZ copy gathers over that copy's ranks instead.
        ``what`` names the unit, for the hang detection's messages."""
        if group.gathered:
            if not async_op:
                group.wait_gathered()
            return
        secondary = group.secondary
        comm = secondary.comm if secondary is not None and secondary.valid else self.of(group)
        group.gathering(comm.all_gather(group.open_for_gather(), async_op=async_op, what=what))

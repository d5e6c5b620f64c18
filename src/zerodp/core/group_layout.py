"""Where a flat group's parameters lie in its padded buffer, and which part is this rank's.

A ``GroupLayout`` holds no tensors: it is the arithmetic of a flat group (``flat.py``), from
its parameters' shapes, dtype and the ranks of its shard axis. Parameters are laid out back to
back; the buffer is padded so that it splits into ``partitions`` equal shards whose size is a
multiple of ``ALIGN_BYTES``; rank ``r`` owns elements ``[r * S, (r + 1) * S)``. ``pieces`` say
where each parameter that overlaps this rank's shard lies in it, ``pieces_in`` the same for any
range (checkpoints describe every rank's shard with it), and ``index_entries`` what a
checkpoint's index records (group, offset, shape; world-size independent).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

ALIGN_BYTES = 16


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives inside its group's full buffer (its local tensor's elements, and
    under tensor parallelism ``tp``: which slice of the unsplit parameter that is)."""

    name: str
    offset: int
    numel: int
    shape: torch.Size
    tp: Optional[Any] = None  # parallel.tensor.TPSlice


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside this rank's shard.

    ``slot`` indexes ``FlatGroup.slots``; ``[shard_lo, shard_hi)`` are offsets within the
    shard and ``param_lo`` is the offset of the same elements within the flattened parameter.
    """

    slot: int
    shard_lo: int
    shard_hi: int
    param_lo: int


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class GroupLayout:
    """The layout of flat group ``index``: ``shapes`` (name, local shape, TP slice or None) in
    buffer order, in ``dtype``, split over the ``partitions`` ranks of shard axis ``axis``, of
    which this one is ``rank``."""

    def __init__(self, index: int, shapes: "list[tuple[str, torch.Size, Optional[Any]]]", dtype: torch.dtype,
                 *, partitions: int, rank: int, axis: str = "data") -> None:
        if not 0 <= rank < partitions:
            raise ValueError(f"flat group {index}: rank {rank} outside its {partitions} partitions")
        self.index = index
        self.dtype = dtype
        self.axis = axis  # the grid axis it shards and reduces over (``axes.py``): partitions are its ranks
        self.partitions, self.rank = partitions, rank
        self.slots: list[Slot] = []
        offset = 0
        for name, shape, tp in shapes:
            self.slots.append(Slot(name, offset, shape.numel(), shape, tp))
            offset += shape.numel()
        self.numel = offset
        align = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        self.shard_numel = _round_up(-(-self.numel // partitions), align)
        self.padded_numel = self.shard_numel * partitions
        self.shard_lo = rank * self.shard_numel
        self.shard_hi = self.shard_lo + self.shard_numel
        self.pieces: list[Piece] = self.pieces_in(self.shard_lo, self.shard_hi)

    def pieces_in(self, lo: int, hi: int) -> list[Piece]:
        """The parts of parameters inside elements [lo, hi) of the full buffer, with offsets
        relative to ``lo`` (this rank's shard, or any other range: checkpoints use this to
        describe every rank's shard)."""
        pieces = []
        for i, slot in enumerate(self.slots):
            a, b = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
            if a < b:
                pieces.append(Piece(i, a - lo, b - lo, a - slot.offset))
        return pieces

    def view(self, buffer: torch.Tensor, slot: int) -> torch.Tensor:
        """Parameter ``slot``'s elements in a full-size ``buffer``, shaped like the parameter."""
        s = self.slots[slot]
        return buffer[s.offset:s.offset + s.numel].view(s.shape)

    def shard_of(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full-size ``buffer`` (a view)."""
        return buffer[self.shard_lo:self.shard_hi]

    def index_entries(self) -> dict[str, dict]:
        """Parameter name -> where it lives: group, offset, numel, shape."""
        return {s.name: {"group": self.index, "offset": s.offset, "numel": s.numel,
                         "shape": tuple(s.shape), **({"tp": s.tp.as_dict()} if s.tp is not None else {})}
                for s in self.slots}

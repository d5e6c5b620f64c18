"""Where a rank sits in the process grid: an ordered set of named axes and the one rank formula.

A :class:`Layout` is the grid's shape, outermost axis first, for example
``Layout.of(pipe=2, replica=1, shard=4, tensor=2)``. A rank's coordinates are its index along
each axis, and its number is the mixed-radix number they make, the last axis varying fastest::

    rank = ((pipe * replica_size + replica) * shard_size + shard) * tensor_size + tensor

so the innermost axis is adjacent ranks (one node's fast links: tensor parallelism) and the
outermost spans nodes (pipeline stages). :meth:`Layout.rank_of` and :meth:`Layout.coords` are the
formula and its inverse; :meth:`Layout.groups` gives the rank lists of the groups along some axes
(the ranks that differ only there), which the grid makes process groups of; :meth:`Layout.together`
says how many ranks of such a group share a node, which the step-time estimate needs.

The axes zerodp knows, in their order (:data:`ORDER`): ``pipe`` (pipeline stages), ``replica`` and
``shard`` (the data-parallel ranks: with hybrid sharding ZeRO shards within a shard group and
replicates across the replicas; without it ``replica`` has size 1), ``sequence`` (sequence
parallelism's ranks, which split one sequence) and ``expert`` (expert parallelism's, which hold
different experts), and ``tensor`` (tensor parallelism's, which hold slices of one layer). An axis of
size 1 may be left out. A layout holds no process group and imports nothing distributed: the
checkpoint view, the estimator and the simulator use it as well as the grid.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Mapping

#: The axes a layout may have, outermost first.
ORDER = ("pipe", "replica", "shard", "sequence", "expert", "tensor")
#: The axes whose ranks are data-parallel to each other (they see different batches).
DATA = ("replica", "shard")


@dataclass(frozen=True)
class Layout:
    """An ordered set of named axes (``axes``: ``(name, size)`` pairs, outermost first)."""

    axes: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, **sizes: int) -> "Layout":
        """A layout of the named axes in :data:`ORDER`'s order (whatever order they are given in);
        axes of size 1 are kept (a rank's coordinate along them is 0)."""
        unknown = set(sizes) - set(ORDER)
        if unknown:
            raise ValueError(f"unknown grid axes {sorted(unknown)}; the axes are {', '.join(ORDER)}")
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"grid axis sizes must be positive integers, got {bad}")
        return cls(tuple((name, sizes[name]) for name in ORDER if name in sizes))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def world(self) -> int:
        """How many ranks the layout has."""
        n = 1
        for _, size in self.axes:
            n *= size
        return n

    def size(self, *names: str) -> int:
        """The product of the sizes of ``names`` (1 for an axis the layout does not have)."""
        sizes = dict(self.axes)
        n = 1
        for name in names:
            n *= sizes.get(name, 1)
        return n

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The rank at ``coords`` (an index along each axis; a missing axis is 0)."""
        rank = 0
        for name, size in self.axes:
            c = coords.get(name, 0)
            if not 0 <= c < size:
                raise ValueError(f"coordinate {name}={c} is outside the axis of size {size}")
            rank = rank * size + c
        return rank

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each axis (the inverse of :meth:`rank_of`)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a layout of {self.world} ranks")
        out = {}
        for name, size in reversed(self.axes):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in self.names}

    def groups(self, names: Iterable[str]) -> list[list[int]]:
        """The groups of ranks that differ only along ``names``: each group's ranks in order of their
        coordinates along ``names`` (the first of them outermost), the groups in order of their first
        rank. Every rank is in exactly one group."""
        along = [n for n in self.names if n in set(names)]
        across = [n for n in self.names if n not in along]
        sizes = dict(self.axes)
        out = []
        for fixed in itertools.product(*(range(sizes[n]) for n in across)):
            base = dict(zip(across, fixed))
            out.append([self.rank_of({**base, **dict(zip(along, moving))})
                        for moving in itertools.product(*(range(sizes[n]) for n in along))])
        return sorted(out, key=lambda g: g[0])

    def group_of(self, rank: int, names: Iterable[str]) -> list[int]:
        """The group along ``names`` that ``rank`` is in (as :meth:`groups` orders it)."""
        return next(g for g in self.groups(names) if rank in g)

    def together(self, names: Iterable[str], per_node: int) -> int:
        """How many ranks of a group along ``names`` share a node, with nodes made of ``per_node``
        consecutive ranks: the fewest over the groups that the first node holds part of (a group's
        collective is as fast as its part spread widest allows)."""
        if per_node < 1:
            raise ValueError(f"ranks per node must be positive, got {per_node}")
        counts = [sum(1 for r in g if r // per_node == 0) for g in self.groups(names)]
        return min(c for c in counts if c > 0)

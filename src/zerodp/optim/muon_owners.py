"""Which rank orthogonalizes each whole matrix, and how its pieces get there and back.

At stages 1-3 each rank holds one contiguous shard of every flat group (``core/group_layout.py``),
so a parameter's elements lie on one rank or on a run of neighbouring ranks. Muon needs each
parameter's blended momentum whole. For every flat group of Muon parameters, in group order on
every rank of the group's shard axis:

1. each parameter has one *owner* rank, chosen once: the parameters of all groups on one axis,
   largest Newton-Schulz cost first, each to the rank with the least work so far (ties: the
   rank holding most of it, then the lowest), so every rank orthogonalizes about 1/N of the
   FLOPs and no matrix is orthogonalized twice;
2. one all-to-all sends each rank's pieces to their owners (``muon_gather``);
3. each owner joins each of its parameters' pieces, orthogonalizes it, and writes the result over
   the pieces it came in (one whole matrix at a time besides the received buffer);
4. one all-to-all sends each piece of the result back to the rank holding it (``muon_scatter``),
   which writes it over its gradient shard.

Bytes per rank and step: what it holds of parameters other ranks own, out and back, about
``2 (N - 1) / N`` of its Muon shard. A group held whole on every rank (stage 0) needs none of
this: each rank orthogonalizes every matrix itself, as a data-parallel optimizer does.

Nothing here imports the engine: a group is anything with the layout's ``index``, ``slots``
(``offset``, ``numel``, ``shape``), ``shard_numel``, ``partitions`` and ``rank``, and a comm
anything with ``all_to_all_rows``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass
class GroupPlan:
    """One flat group's exchange, from this rank's side."""

    index: int
    comm: Any
    partitions: int
    owner: list[int]                       # per slot: the group rank that orthogonalizes it
    shapes: list[torch.Size]
    send: list[list[tuple[int, int]]]      # per destination rank: (lo, hi) ranges of this rank's shard
    recv: list[list[tuple[int, int, int]]]  # per source rank: (slot, param_lo, length) it sends here
    offsets: list[int]                     # per slot: its offset in the group's full buffer
    mine: list[int] = field(default_factory=list)  # the slots this rank owns
    arrived: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # owned slot: (at, param_lo, n)
    wire: Optional[torch.device] = None    # where the all-to-alls' buffers must be (NCCL: the GPU)

    @property
    def send_rows(self) -> list[int]:
        return [sum(hi - lo for lo, hi in ranges) for ranges in self.send]

    @property
    def recv_rows(self) -> list[int]:
        return [sum(n for _, _, n in parts) for parts in self.recv]


def _pieces(group, rank: int) -> list[tuple[int, int, int]]:
    """``(slot, param_lo, length)`` of each parameter's part in ``rank``'s shard of ``group``."""
    lo, hi = rank * group.shard_numel, (rank + 1) * group.shard_numel
    out = []
    for i, s in enumerate(group.slots):
        a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
        if a < b:
            out.append((i, a - s.offset, b - a))
    return out


def plan_owners(groups: list, comm_of: Callable[[Any], Any], cost: Callable[[Any, int], int],
                wire: Optional[torch.device] = None) -> list[GroupPlan]:
    """Each group's :class:`GroupPlan` (see module docstring): ``comm_of(group)`` is the comm of
    the group's shard axis, ``cost(group, slot)`` a parameter's Newton-Schulz FLOPs, ``wire`` the
    device NCCL's buffers live on (the engine's; host shards, with optimizer offload, are staged
    there). Groups on one axis share the balance; every rank computes the same plan from the same
    layout."""
    loads: dict[str, list[int]] = {}
    chosen: dict[int, list[int]] = {}
    order = sorted(((g, i) for g in groups for i in range(len(g.slots))),
                   key=lambda gi: (-cost(*gi), gi[0].index, gi[1]))
    for g, i in order:
        n = g.partitions
        load = loads.setdefault(getattr(g, "axis", "data"), [0] * n)
        if len(load) != n:
            raise ValueError(f"flat group {g.index} splits over {n} ranks, another group on the same axis "
                             f"over {len(load)}")
        s = g.slots[i]
        held = [max(0, min(s.offset + s.numel, (r + 1) * g.shard_numel) - max(s.offset, r * g.shard_numel))
                for r in range(n)]
        owner = min(range(n), key=lambda r: (load[r], -held[r], r))
        load[owner] += cost(g, i)
        chosen.setdefault(g.index, [0] * len(g.slots))[i] = owner
    plans = []
    for g in groups:
        n, me = g.partitions, g.rank
        owner = chosen.get(g.index, [])
        send: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for slot, plo, length in _pieces(g, me):
            lo = g.slots[slot].offset + plo - me * g.shard_numel
            send[owner[slot]].append((lo, lo + length))
        recv = [[p for p in _pieces(g, r) if owner[p[0]] == me] for r in range(n)]
        mine = [i for i in range(len(g.slots)) if owner[i] == me]
        arrived: dict[int, list[tuple[int, int, int]]] = {i: [] for i in mine}
        at = 0  # where each owned piece lands in the received buffer (rank order, then slot order)
        for parts in recv:
            for slot, plo, length in parts:
                arrived[slot].append((at, plo, length))
                at += length
        plans.append(GroupPlan(g.index, comm_of(g), n, owner, [s.shape for s in g.slots], send, recv,
                               [s.offset for s in g.slots], mine, arrived, wire))
    return plans


def exchange(plan: GroupPlan, shard: torch.Tensor, compute: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
    """Replace each parameter's part of ``shard`` (this rank's gradient shard of the group, the
    blended momentum in it) by its part of ``compute(slot, whole)``, which the owner runs on the
    parameter's whole flat values, one parameter at a time. The update goes back in the buffer its
    pieces came in, whose layout the return trip shares."""
    if plan.partitions == 1:  # the whole group is here (stage 0): each parameter in place
        for slot in plan.mine:
            lo, hi = plan.offsets[slot], plan.offsets[slot] + plan.shapes[slot].numel()
            shard[lo:hi] = compute(slot, shard[lo:hi].clone())
        return
    ranges = [r for dest in plan.send for r in dest]
    out = torch.cat([shard[lo:hi] for lo, hi in ranges]) if ranges else shard.new_empty(0)
    staged = plan.wire is not None and getattr(plan.comm, "backend", "") == "nccl" and out.device != plan.wire
    got = plan.comm.all_to_all_rows(out.to(plan.wire) if staged else out, plan.send_rows, plan.recv_rows,
                                    what="Muon's matrices to their owners", kind="muon_gather").to(shard.device)
    del out
    for slot in plan.mine:
        whole = shard.new_empty(plan.shapes[slot].numel())
        for at, plo, length in plan.arrived[slot]:
            whole[plo:plo + length] = got[at:at + length]
        result = compute(slot, whole)
        for at, plo, length in plan.arrived[slot]:
            got[at:at + length] = result[plo:plo + length]
    returned = plan.comm.all_to_all_rows(got.to(plan.wire) if staged else got, plan.recv_rows, plan.send_rows,
                                         what="Muon's updates to their shards", kind="muon_scatter").to(shard.device)
    at = 0
    for lo, hi in ranges:
        shard[lo:hi] = returned[at:at + hi - lo]
        at += hi - lo

"""Every collective zerodp issues goes through this module.

It knows the backend and picks the form of each collective that is fast there; every
reduce-scatter and all-gather is one collective (one work to wait for), at any group size:

* NCCL: ``reduce_scatter_single`` / ``all_gather_single`` (the tensor forms), run in place.
* gloo: chunks under ``GLOO_OWNER_MIN_BYTES`` (1 MiB) per rank: one ``all_to_all_single``. A
  reduce-scatter sends chunk ``i`` of the input to rank ``i`` and sums the ``N`` chunks it
  receives; an all-gather sends ``N`` copies of this rank's chunk, one to each rank. Each moves a
  ring's bytes and holds a transient buffer of the buffer's size. Larger chunks: one reduce or
  broadcast per owner, N operations waited for together, in place.
  Measured on 2 CPU cores (ms; reduce-scatter all-to-all / per owner / gloo's tensor form, then
  all-gather likewise): 256 KiB chunks at 4 ranks 2.2 / 14.3 / 8.9, 2.9 / 3.2 / 4.3; at 8 ranks
  7.1 / 71 / 27, 7.6 / 9.8 / 12.3; 4 MiB chunks at 4 ranks 21 / 31 / 46, 20 / 17 / 26; at 8 ranks
  67 / 120 / 225, 62 / 57 / 123. The all-to-all's reduce-scatter wins at every size only while its
  transient buffer is reused: freshly allocated for a 25 MiB bucket at 2 ranks, its page faults
  make it 27.7 ms against 21.1 per owner (12.8 in a reused buffer), and the all-gather 23.7
  against 8.3 (13.4). End to end at world size 2, one all-to-all per operation at every size cost
  stage 2 about 4% and stage 3 about 6% of the step (docs/benchmarks.md), so large chunks keep
  the per-owner form, and the number of collectives per step grows with N on gloo where chunks
  are 1 MiB or more. ``ZERODP_GLOO_COLLECTIVES`` picks one form for every size (``all_to_all``:
  one collective per operation at any N; ``per_owner``; ``tensor``) instead of ``auto``.
  (gloo's ``_coalescing_manager`` does not run broadcasts and reduces: it returns without
  having moved anything, so it cannot make per-owner operations one.)

Reductions always use SUM; callers divide locally (AVG has had silent bugs on gloo).

Byte counting (``CommCounter``): bytes *sent per rank* by the ring algorithm for the
logical collective, whatever algorithm the backend really runs, so that figures
compare across backends and with the ZeRO paper. For a buffer of ``B`` bytes split
over ``N`` ranks:

* all-reduce: ``2 * B * (N - 1) / N``
* reduce-scatter (``B`` = the full input): ``B * (N - 1) / N``
* all-gather (``B`` = the full output): ``B * (N - 1) / N``
* control (small all-reduces of norms and flags): counted the same as all-reduce but
  under their own kind, so bulk traffic stays exact.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "control")

# the tensor forms under their names in this torch (``*_single``; older releases only have ``*_tensor``)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: gloo's forms of reduce-scatter and all-gather (see above), chosen by ``ZERODP_GLOO_COLLECTIVES``.
GLOO_FORMS = ("auto", "all_to_all", "per_owner", "tensor")
GLOO_FORMS_ENV = "ZERODP_GLOO_COLLECTIVES"
#: gloo, ``auto``: a reduce-scatter or all-gather whose per-rank chunk is this large or larger runs as
#: one operation per owner, a smaller one as one all-to-all.
GLOO_OWNER_MIN_BYTES = 1 << 20


def gloo_form() -> str:
    """The form of gloo's reduce-scatters and all-gathers: ``ZERODP_GLOO_COLLECTIVES`` or ``auto``."""
    form = os.environ.get(GLOO_FORMS_ENV, "auto")
    if form not in GLOO_FORMS:
        raise ValueError(f"{GLOO_FORMS_ENV}={form!r}: allowed: {', '.join(GLOO_FORMS)}")
    return form


class CommCounter:
    """Bytes moved (and collectives issued) per process group and collective kind, for the step
    in progress and the last finished step. One counter serves all the groups of an engine (the
    data-parallel group, and with a process grid the tensor, replica and whole-grid groups), each
    ``Comm`` adding under its ``label``."""

    def __init__(self) -> None:
        self.kinds: tuple[str, ...] = COLLECTIVE_KINDS  # a pipeline engine adds "p2p"
        self.current: dict[tuple[str, str], int] = defaultdict(int)
        self.current_calls: dict[str, int] = defaultdict(int)
        self.last_by_group: dict[str, dict[str, int]] = {}
        self.last_calls: dict[str, int] = {}

    def add(self, kind: str, nbytes: float, group: str = "data", calls: int = 1) -> None:
        self.current[(group, kind)] += int(round(nbytes))
        self.current_calls[group] += calls

    def close_step(self) -> None:
        """Make the counts so far the last step's, and start counting afresh."""
        by_group: dict[str, dict[str, int]] = {}
        for (group, kind), n in self.current.items():
            by_group.setdefault(group, {k: 0 for k in self.kinds})[kind] += n
        self.last_by_group = by_group
        self.last_calls = dict(self.current_calls)
        self.current = defaultdict(int)
        self.current_calls = defaultdict(int)

    @property
    def last_step(self) -> dict[str, int]:
        """Bytes of the last step per collective kind, over all groups."""
        return {k: sum(g.get(k, 0) for g in self.last_by_group.values()) for k in self.kinds}


class Handle:
    """Outstanding collective work; ``wait()`` blocks until done and runs ``then`` once."""

    def __init__(self, works: list, then: Optional[Callable[[], None]] = None) -> None:
        self._works = [w for w in works if w is not None]
        self._then = then
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        for w in self._works:
            w.wait()
        self.done = True
        then, self._then, self._works = self._then, None, []
        if then is not None:  # dropped first: what it holds (a gradient bucket) may be freed
            then()


class Comm:
    """The collectives of one process group, with the backend's fast forms and byte counts.

    ``group`` is always explicit (``None`` means the default group) so that data-parallel
    groups narrower than the world (hybrid or tensor-parallel layouts) use the same code.

    Its facts: ``distributed`` (a process group is initialized), ``world_size`` and ``rank``
    within ``group``, ``backend`` (``"nccl"``, ``"gloo"``, or ``"none"`` without one),
    ``global_ranks`` (the global rank of each rank of ``group``, in group order), and
    ``counter`` (the bytes moved, ``CommCounter``, shared by the comms of one engine), to which
    it adds under ``label`` (the group's role: ``"data"``, ``"tensor"``, ``"replica"``, ...).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, label: str = "data",
                 counter: Optional[CommCounter] = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.label = label
        if self.distributed:
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            self.backend = str(dist.get_backend(group)).lower()
            self.global_ranks = [dist.get_global_rank(group, i) if group is not None else i
                                 for i in range(self.world_size)]
        else:
            self.world_size, self.rank, self.backend = 1, 0, "none"
            self.global_ranks = [0]
        self.counter = counter if counter is not None else CommCounter()
        self.gloo = gloo_form() if self.backend == "gloo" else "tensor"

    @classmethod
    def alone(cls, label: str = "data", counter: Optional[CommCounter] = None) -> "Comm":
        """The collectives of a group of one rank (this one): each is a no-op. For an axis of a
        process grid that has size one, which has no process group of its own."""
        comm = cls.__new__(cls)
        comm.distributed, comm.group, comm.label = False, None, label
        comm.world_size, comm.rank, comm.backend = 1, 0, "none"
        comm.global_ranks = [dist.get_rank() if dist.is_available() and dist.is_initialized() else 0]
        comm.counter = counter if counter is not None else CommCounter()
        comm.gloo = "tensor"
        return comm

    def form(self, chunk: torch.Tensor) -> str:
        """How a reduce-scatter or all-gather of ``chunk``-sized pieces runs: ``"tensor"`` on NCCL;
        on gloo its form, ``auto`` resolved by the chunk's size."""
        if self.gloo != "auto":
            return self.gloo
        return "per_owner" if chunk.numel() * chunk.element_size() >= GLOO_OWNER_MIN_BYTES else "all_to_all"

    # -- collectives -------------------------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False, kind: str = "all_reduce",
                       then: Optional[Callable[[], None]] = None) -> Handle:
        """Sum ``tensor`` in place over the group."""
        n = self.world_size
        if n == 1:
            return self._finish(Handle([], then), async_op)
        self.counter.add(kind, 2 * tensor.numel() * tensor.element_size() * (n - 1) / n, self.label)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return self._finish(Handle([work], then), async_op)

    def reduce_scatter_sum(self, full: torch.Tensor, async_op: bool = False,
                           then: Optional[Callable[[], None]] = None) -> Handle:
        """Sum ``full`` over the group into this rank's chunk of it, in place.

        ``full`` is 1-D with a length divisible by the group size; after the wait, chunk
        ``rank`` of ``full`` holds the sum. The other chunks are used as scratch and hold
        unspecified values.
        """
        n = self.world_size
        if n == 1:
            return self._finish(Handle([], then), async_op)
        self.counter.add("reduce_scatter", full.numel() * full.element_size() * (n - 1) / n, self.label)
        chunks = full.chunk(n)
        mine = chunks[self.rank]
        form = self.form(mine)
        if form == "all_to_all":  # every rank's chunk `rank` arrives here, and is summed
            received = torch.empty_like(full)
            works = [dist.all_to_all_single(received, full, group=self.group, async_op=True)]

            def add_up(after=then):
                torch.sum(received.view(n, -1), dim=0, out=mine)
                if after is not None:
                    after()
            then = add_up
        elif form == "per_owner":
            works = [dist.reduce(c, dst=self.global_ranks[i], op=dist.ReduceOp.SUM,
                                 group=self.group, async_op=True) for i, c in enumerate(chunks)]
        else:
            works = [_REDUCE_SCATTER(mine, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)]
        return self._finish(Handle(works, then), async_op)

    def all_gather(self, full: torch.Tensor, async_op: bool = False,
                   then: Optional[Callable[[], None]] = None) -> Handle:
        """Fill every chunk of ``full`` from the rank that owns it, in place.

        ``full`` is 1-D with a length divisible by the group size; chunk ``rank`` must
        hold this rank's data on entry.
        """
        n = self.world_size
        if n == 1:
            return self._finish(Handle([], then), async_op)
        self.counter.add("all_gather", full.numel() * full.element_size() * (n - 1) / n, self.label)
        chunks = full.chunk(n)
        form = self.form(chunks[0])
        if form == "all_to_all":  # this rank's chunk to every rank, theirs into their places
            copies = chunks[self.rank].repeat(n)
            works = [dist.all_to_all_single(full, copies, group=self.group, async_op=True)]

            def release(after=then, copies=copies):  # the copies live until the work is done
                if after is not None:
                    after()
            then = release
        elif form == "per_owner":
            works = [dist.broadcast(c, src=self.global_ranks[i], group=self.group, async_op=True)
                     for i, c in enumerate(chunks)]
        else:
            works = [_ALL_GATHER(full, chunks[self.rank], group=self.group, async_op=True)]
        return self._finish(Handle(works, then), async_op)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's short list of ints (same length on every rank), in rank order;
        counted as control traffic."""
        if self.world_size == 1:
            return [list(values)]
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.counter.add("control", mine.numel() * 8 * (self.world_size - 1), self.label)
        dist.all_gather(out, mine, group=self.group)
        return [t.tolist() for t in out]

    def all_gather_list(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on every rank), in rank order (saving and
        consolidating, not counted)."""
        if self.world_size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor.contiguous(), group=self.group)
        return out

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (checkpoint indexes, not counted)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_objects(self, obj: Any, dst_rank: int = 0) -> list[Any]:
        """Every rank's picklable ``obj`` in rank order on group rank ``dst_rank``; an empty
        list elsewhere (consolidating, not counted)."""
        if self.world_size == 1:
            return [obj]
        out: Optional[list[Any]] = [None] * self.world_size if self.rank == dst_rank else None
        dist.gather_object(obj, out, dst=self.global_ranks[dst_rank], group=self.group)
        return out or []

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0) -> None:
        """Broadcast ``tensor`` from group rank ``src_rank`` (used at start-up, not counted)."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=self.global_ranks[src_rank], group=self.group)

    @staticmethod
    def _finish(handle: Handle, async_op: bool) -> Handle:
        if not async_op:
            handle.wait()
        return handle


def all_gather_numbers(values: dict[str, float], group: Optional[dist.ProcessGroup] = None,
                       device: Optional[torch.device] = None) -> list[dict[str, float]]:
    """Every rank's ``values`` (same keys on every rank), in rank order.

    For reports (memory tables, benchmark rows): unlike ``all_gather_object`` it needs no
    pickling and no NumPy. Not counted in the byte statistics.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [dict(values)]
    keys = sorted(values)
    mine = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [dict(zip(keys, t.tolist())) for t in out]

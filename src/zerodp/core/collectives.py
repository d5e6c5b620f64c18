"""Every collective zerodp issues goes through this module.

It knows the backend and picks the form of each collective that is fast there; every
reduce-scatter and all-gather is one collective (one work to wait for), at any group size:

* NCCL: ``reduce_scatter_single`` / ``all_gather_single`` (the tensor forms), run in place.
* gloo: one ``all_to_all_single`` each. A reduce-scatter sends chunk ``i`` of the input to
  rank ``i`` and sums the ``N`` chunks it receives; an all-gather sends ``N`` copies of this
  rank's chunk, one to each rank. Each moves a ring's bytes and needs a transient buffer the
  size of the operation, which a pool (``ScratchPool``) keeps for the next one: allocated
  afresh, a large buffer faults its pages in on every use. In a group of two it is an exchange
  (split sizes that leave this rank's own part out): the all-gather runs in place with no
  buffer, the reduce-scatter receives one chunk (at 2 ranks, ms, all-gather / reduce-scatter:
  0.9 / 0.9, 2.4 / 2.5, 10.4 / 13.4 for the three sizes below). Measured on 2 CPU cores (ms, median
  of 7; per owner = one reduce or broadcast per owner, N operations in place; fresh = the
  all-to-all with a new buffer each time, pooled = with the pool's):

  ======================  ==========================  ==========================
  chunk, ranks            reduce-scatter              all-gather
                          per owner / fresh / pooled  per owner / fresh / pooled
  ======================  ==========================  ==========================
  1 MiB, 2                3.8 / 1.9 / 1.1             1.0 / 2.1 / 1.0
  4 MiB, 2                8.2 / 7.6 / 3.4             3.1 / 8.3 / 3.5
  16 MiB, 2               26.2 / 33.0 / 18.3          11.7 / 31.2 / 19.1
  1 MiB, 4                13.9 / 8.6 / 5.4            3.5 / 9.4 / 5.2
  4 MiB, 4                20.0 / 29.1 / 13.9          11.4 / 25.1 / 16.6
  16 MiB, 4               106.2 / 123.6 / 57.7        45.8 / 109.4 / 62.2
  ======================  ==========================  ==========================

  gloo's own tensor forms were slower than all of these (all-gather 2.9 / 11.0 / 41.5 ms at
  2 ranks), and its list ``all_to_all`` too (12.7 ms for 4 MiB at 2 ranks). End to end on the
  medium example GPT (``benchmarks/peers.py``, step time over DDP's, medians of 6 runs of the
  pooled all-to-all alternated with 3 of one operation per owner for chunks from 1 MiB): stage
  2 0.99 against 1.02 at world size 2 and 0.95 against 0.99 at 4; stage 3 1.13 against 1.09
  and 1.08 against 1.13 (docs/benchmarks.md); one collective per operation at any N (stage 3:
  28 per step against 46 and 82 at 2 and 4). The price is memory: the pool keeps up to one
  buffer per operation in flight (peak RSS per rank at stage 2 +21 / +42 MiB at world sizes 2 /
  4 with 25 MiB buckets), reported as ``memory_breakdown()["collective_buffers"]``. Stage 3's
  units and reductions borrow from a pool of their own with room for one buffer, the size of
  the largest unit (``ShardedParams.scratch``), and take turns with it: one unit-sized buffer per
  rank instead of up to four (-20 MiB per rank at world sizes 4 and 8 on the medium GPT).
  ``ZERODP_GLOO_COLLECTIVES`` picks another form for every size (``per_owner``: one operation per
  owner, in place, no transient buffer; ``tensor``) instead of ``auto`` (the all-to-all).
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

import copy
import math
import os
import threading
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import health

COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "control")

# the tensor forms under their names in this torch (``*_single``; older releases only have ``*_tensor``)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: gloo's forms of reduce-scatter and all-gather (see above), chosen by ``ZERODP_GLOO_COLLECTIVES``;
#: ``auto`` is the all-to-all.
GLOO_FORMS = ("auto", "all_to_all", "per_owner", "tensor")
GLOO_FORMS_ENV = "ZERODP_GLOO_COLLECTIVES"


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

    def declare(self, *kinds: str) -> None:
        """Count these kinds from now on (zero until used): a part of the engine that will send them
        says so at set-up, so that every step's figures, and a metrics file's columns, have them."""
        self.kinds = (*self.kinds, *(k for k in kinds if k not in self.kinds))

    def add(self, kind: str, nbytes: float, group: str = "data", calls: int = 1) -> None:
        if kind not in self.kinds:  # a kind nobody declared: counted from its first use
            self.kinds = (*self.kinds, kind)
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


class ScratchPool:
    """The transient buffers of gloo's all-to-all forms, kept for the next operation.

    An all-to-all reduce-scatter receives every rank's copy of the bucket, and an all-gather
    sends ``N`` copies of this rank's chunk: a buffer the size of the whole operation, for
    as long as it runs. Allocated afresh each time, a large one faults its pages in on every
    use (the table above: fresh against pooled). The pool lends byte buffers and takes them
    back when the operation is done; a request that no free buffer fits allocates a new one
    and drops the largest free buffer, too small for it, so the pool holds about as many
    buffers as operations ran at once, each the size of the largest it served.

    With a ``capacity``, it lends no more than that many buffers at once: a request beyond it
    first waits for the oldest operation holding one (``Comm`` tells the pool which ``Handle``
    holds a buffer), so operations that need a buffer run one after another and the pool
    holds ``capacity`` buffers, each the size of the largest operation. The collectives are
    issued in the same order on every rank, so waiting for an earlier one cannot deadlock.
    ``held_bytes`` is what it holds (lent or free), ``lent_buffers`` how many are lent now;
    ``release()`` frees the free ones."""

    def __init__(self, capacity: Optional[int] = None) -> None:
        self.capacity = capacity
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # by data pointer
        self._holders: dict[int, "Handle"] = {}  # by data pointer: the operation a lent buffer serves
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() for b in self._free) + sum(b.numel() for b in self._lent.values())

    @property
    def lent_buffers(self) -> int:
        """Buffers lent to operations not yet done."""
        return len(self._lent)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype`` on ``device``, contents unspecified."""
        nbytes = numel * dtype.itemsize
        while self.capacity is not None and len(self._lent) >= self.capacity:
            with self._lock:
                oldest = next(iter(self._holders.values()), None)
            if oldest is None:
                raise RuntimeError("scratch pool: every buffer is lent and no operation holds one")
            oldest.wait()  # gives its buffer back
        with self._lock:
            here = [i for i, b in enumerate(self._free) if b.device == device]
            fits = [i for i in here if self._free[i].numel() >= nbytes]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            else:
                if here:  # the largest free one is too small: replace it
                    self._free.pop(max(here, key=lambda i: self._free[i].numel()))
                buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            self._lent[buf.data_ptr()] = buf
        return buf[:nbytes].view(dtype)

    def held_by(self, view: torch.Tensor, handle: "Handle") -> None:
        """``view`` (from ``take``) serves the operation ``handle``: a request beyond the capacity
        waits for it."""
        with self._lock:
            if view.data_ptr() in self._lent:
                self._holders[view.data_ptr()] = handle

    def give_back(self, view: torch.Tensor) -> None:
        with self._lock:
            self._holders.pop(view.data_ptr(), None)
            self._free.append(self._lent.pop(view.data_ptr()))

    def release(self) -> None:
        """Free the buffers not lent right now."""
        with self._lock:
            self._free = []


#: The pool of every ``Comm`` of this process (one operation's buffer serves any group).
SCRATCH = ScratchPool()


def _chain(first: Callable[[], None], then: Optional[Callable[[], None]]) -> Callable[[], None]:
    """What a handle runs once its work is done: ``first``, then ``then`` (the caller's, if any)."""
    def run() -> None:
        first()
        if then is not None:
            then()
    return run


class Handle:
    """Outstanding collective work; ``wait()`` blocks until done and runs ``then`` once. With
    ``watched`` (the collective's kind and the group's global ranks, on gloo), the wait is the
    hang detection's (``health/watch.py``): in periods, judging the other ranks after each."""

    def __init__(self, works: list, then: Optional[Callable[[], None]] = None,
                 watched: Optional[tuple[str, list[int]]] = None) -> None:
        self._works = [w for w in works if w is not None]
        self._then = then
        self.done = False
        self._watched = watched if self._works else None
        if self._watched is not None:
            health.progress.current.seq += 1
            self._seq = health.progress.current.seq

    def wait(self) -> None:
        if self.done:
            return
        for w in self._works:
            if self._watched is None:
                w.wait()
            else:
                health.wait(w, self._watched[0], self._watched[1], self._seq)
        self.done = True
        then, self._then, self._works = self._then, None, []
        if then is not None:  # dropped first: what it holds (a gradient bucket) may be freed
            then()


class PendingInts:
    """``Comm.all_gather_ints`` in flight: ``result()`` waits for it and gives every rank's
    ints. On a GPU the values are copied to the host on a side stream once the collective is
    done, so neither the compute stream nor the host waits for them before ``result()``."""

    def __init__(self, work, out: Optional[torch.Tensor], keep: Optional[torch.Tensor] = None,
                 values: Optional[list[list[int]]] = None, watched: Optional[tuple[str, list[int]]] = None) -> None:
        self._work, self._out, self._event = work, out, None
        self._watched = watched  # as Handle's
        self._keep = keep  # the input stays alive until the collective is done
        self._values = values  # known already (a group of one)
        if out is not None and out.is_cuda:
            stream = _side_stream(out.device)
            with torch.cuda.stream(stream):
                work.wait()  # the side stream waits for the collective, nothing else does
                self._host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                self._host.copy_(out, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(stream)

    def result(self) -> list[list[int]]:
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
                self._values = self._host.tolist()
            elif self._watched is not None:
                health.wait(self._work, *self._watched)
                self._values = self._out.tolist()
            else:
                self._work.wait()
                self._values = self._out.tolist()
            self._work = self._out = self._keep = self._event = None
        return self._values


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    """One side stream per GPU for reading small collectives' results back to the host."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


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
        self.watched = False  # waits watched for hangs (health/): set by the engine, on gloo only
        self.scratch = SCRATCH  # where gloo's all-to-all forms borrow their transient buffers

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
        comm.watched = False
        comm.scratch = SCRATCH
        return comm

    def using(self, scratch: ScratchPool) -> "Comm":
        """The same group's collectives, borrowing their transient buffers from ``scratch``."""
        comm = copy.copy(self)
        comm.scratch = scratch
        return comm

    def form(self) -> str:
        """How a reduce-scatter or all-gather runs: ``"tensor"`` on NCCL; on gloo its form
        (``auto``: the all-to-all)."""
        return "all_to_all" if self.gloo == "auto" else self.gloo

    def _pair(self, chunk: int) -> tuple[int, list[int]]:
        """A group of two: the peer's group rank, and split sizes that send ``chunk`` elements to
        it and receive as many from it alone (an all-to-all without this rank's own part: no
        copy of it, no buffer for it)."""
        peer = 1 - self.rank
        return peer, [chunk if i == peer else 0 for i in range(2)]

    # -- collectives -------------------------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False, kind: str = "all_reduce",
                       then: Optional[Callable[[], None]] = None) -> Handle:
        """Sum ``tensor`` in place over the group."""
        n = self.world_size
        if n == 1:
            return self._finish(self._handle([], then), async_op)
        self.counter.add(kind, 2 * tensor.numel() * tensor.element_size() * (n - 1) / n, self.label)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return self._finish(self._handle([work], then, "all_reduce"), async_op)

    def reduce_scatter_sum(self, full: torch.Tensor, async_op: bool = False,
                           then: Optional[Callable[[], None]] = None,
                           out: Optional[torch.Tensor] = None) -> Handle:
        """Sum ``full`` over the group into this rank's chunk of it, in place, or into ``out``.

        ``full`` is 1-D with a length divisible by the group size; after the wait, chunk
        ``rank`` of ``full`` holds the sum. The other chunks are used as scratch and hold
        unspecified values. With ``out`` (a tensor of one chunk's size and ``full``'s dtype)
        the sum lands there instead, with no copy where the form allows (the exchange and the
        all-to-all write it there directly), and chunk ``rank`` of ``full`` is scratch too.
        """
        n = self.world_size
        if n == 1:
            if out is not None:
                out.copy_(full)
            return self._finish(self._handle([], then), async_op)
        self.counter.add("reduce_scatter", full.numel() * full.element_size() * (n - 1) / n, self.label)
        chunks = full.chunk(n)
        mine = chunks[self.rank]
        form = self.form()
        borrowed = None
        if form == "all_to_all" and n == 2:  # an exchange: the peer's chunk there, its copy of mine here
            peer, splits = self._pair(mine.numel())
            received = self.scratch.take(mine.numel(), full.dtype, full.device) if out is None else out
            borrowed = received if out is None else None
            works = [dist.all_to_all_single(received, chunks[peer], output_split_sizes=splits,
                                            input_split_sizes=splits, group=self.group, async_op=True)]

            def add_up():
                if out is None:
                    mine.add_(received)
                    self.scratch.give_back(received)
                else:
                    out.add_(mine)
            then = _chain(add_up, then)
        elif form == "all_to_all":  # every rank's chunk `rank` arrives here, and is summed
            received = borrowed = self.scratch.take(full.numel(), full.dtype, full.device)
            works = [dist.all_to_all_single(received, full, group=self.group, async_op=True)]

            def add_up():
                torch.sum(received.view(n, -1), dim=0, out=mine if out is None else out)
                self.scratch.give_back(received)
            then = _chain(add_up, then)
        elif form == "per_owner":
            works = [dist.reduce(c, dst=self.global_ranks[i], op=dist.ReduceOp.SUM,
                                 group=self.group, async_op=True) for i, c in enumerate(chunks)]
            if out is not None:
                then = _chain(lambda: out.copy_(mine), then)
        else:
            works = [_REDUCE_SCATTER(mine if out is None else out, full, op=dist.ReduceOp.SUM,
                                     group=self.group, async_op=True)]
        return self._finish(self._lending(borrowed, self._handle(works, then, "reduce_scatter")), async_op)

    def all_gather(self, full: torch.Tensor, async_op: bool = False,
                   then: Optional[Callable[[], None]] = None, what: str = "") -> Handle:
        """Fill every chunk of ``full`` from the rank that owns it, in place.

        ``full`` is 1-D with a length divisible by the group size; chunk ``rank`` must
        hold this rank's data on entry.
        """
        n = self.world_size
        if n == 1:
            return self._finish(self._handle([], then), async_op)
        self.counter.add("all_gather", full.numel() * full.element_size() * (n - 1) / n, self.label)
        chunks = full.chunk(n)
        form = self.form()
        copies = None
        if form == "all_to_all" and n == 2:  # an exchange, in place: mine there, the peer's here
            peer, splits = self._pair(chunks[0].numel())
            works = [dist.all_to_all_single(chunks[peer], chunks[self.rank], output_split_sizes=splits,
                                            input_split_sizes=splits, group=self.group, async_op=True)]
        elif form == "all_to_all":  # this rank's chunk to every rank, theirs into their places
            copies = self.scratch.take(full.numel(), full.dtype, full.device)
            copies.view(n, -1).copy_(chunks[self.rank].expand(n, -1))
            works = [dist.all_to_all_single(full, copies, group=self.group, async_op=True)]
            then = _chain(lambda: self.scratch.give_back(copies), then)  # the copies live until the work is done
        elif form == "per_owner":
            works = [dist.broadcast(c, src=self.global_ranks[i], group=self.group, async_op=True)
                     for i, c in enumerate(chunks)]
        else:
            works = [_ALL_GATHER(full, chunks[self.rank], group=self.group, async_op=True)]
        handle = self._handle(works, then, f"all_gather of {what}" if what else "all_gather")
        return self._finish(self._lending(copies, handle), async_op)

    def all_gather_ints(self, values: list[int], async_op: bool = False, what: str = ""):
        """Every rank's short list of ints (same length on every rank), in rank order;
        counted as control traffic. The ranks' values land in one tensor, read back to the host
        at once (on NCCL one device-to-host copy, not one per rank). With ``async_op`` the
        all-gather stays in flight and a ``PendingInts`` is returned: its ``result()`` waits.
        ``what`` names the wait for the hang detection (default: the group's all-gather of ints)."""
        if self.world_size == 1:
            pending = PendingInts(None, None, values=[list(values)])
        else:
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
            mine = torch.tensor(values, dtype=torch.int64, device=device)
            # rows start as this rank's values: what a fake process group (zerodp simulate) leaves there,
            # as if every rank had this one's
            out = mine.expand(self.world_size, -1).clone()
            self.counter.add("control", mine.numel() * 8 * (self.world_size - 1), self.label)
            work = dist.all_gather(list(out.unbind(0)), mine, group=self.group, async_op=True)
            kind = what or f"an all_gather of ints on the {self.label} group"
            pending = PendingInts(work, out, mine,
                                  watched=(kind, self.global_ranks) if self.watched else None)
        return pending if async_op else pending.result()

    def all_gather_list(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on every rank), in rank order (saving and
        consolidating, not counted)."""
        if self.world_size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor.contiguous(), group=self.group)
        return out

    def all_to_all(self, x: torch.Tensor, scatter_dim: int, gather_dim: int, what: str = "") -> torch.Tensor:
        """Cut ``x`` into as many equal chunks along ``scatter_dim`` as the group has ranks, send
        chunk ``i`` to rank ``i``, and join what every rank sent here along ``gather_dim``, in rank
        order (Ulysses sequence parallelism: sequence shards to head shards and back). Counted as
        ``all_to_all``: what this rank sends to the others."""
        n = self.world_size
        if n == 1:
            return x
        if x.shape[scatter_dim] % n:
            raise ValueError(f"all_to_all{' of ' + what if what else ''}: dimension {scatter_dim} of size "
                             f"{x.shape[scatter_dim]} does not split over the {n} ranks of the {self.label} group")
        parts = x.chunk(n, dim=scatter_dim)
        send = torch.cat([c.reshape(-1) for c in parts])
        received = torch.empty_like(send)
        self.counter.add("all_to_all", send.numel() * send.element_size() * (n - 1) / n, self.label)
        work = dist.all_to_all_single(received, send, group=self.group, async_op=True)
        self._finish(self._handle([work], None, f"all_to_all of {what}" if what else "all_to_all"), False)
        return torch.cat([r.view(parts[0].shape) for r in received.chunk(n)], dim=gather_dim)

    def all_to_all_rows(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int],
                        what: str = "", kind: str = "all_to_all") -> torch.Tensor:
        """Send ``send_rows[i]`` consecutive rows of ``x`` (its first dimension, in order) to rank ``i``
        and receive ``recv_rows[i]`` rows from rank ``i``, joined in rank order (expert parallelism:
        tokens to the ranks of their experts and back; Muon: matrices to their owners and back).
        Counted as ``kind``: the rows sent to the other ranks."""
        if self.world_size == 1:
            return x
        if sum(send_rows) != x.shape[0]:
            raise ValueError(f"all_to_all_rows{' of ' + what if what else ''}: {sum(send_rows)} rows to send, "
                             f"{x.shape[0]} given")
        x = x.contiguous()
        out = x.new_empty((sum(recv_rows), *x.shape[1:]))
        row = math.prod(x.shape[1:]) * x.element_size()
        self.counter.add(kind, row * (sum(send_rows) - send_rows[self.rank]), self.label)
        if self.backend == "fake":  # zerodp simulate: nothing moves (its checks would refuse sizes that differ)
            return out
        work = dist.all_to_all_single(out, x, output_split_sizes=list(recv_rows), input_split_sizes=list(send_rows),
                                      group=self.group, async_op=True)
        self._finish(self._handle([work], None, f"all_to_all of {what}" if what else "all_to_all"), False)
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

    def _lending(self, borrowed: Optional[torch.Tensor], handle: Handle) -> Handle:
        """``handle``, recorded as the operation holding ``borrowed`` (a scratch buffer, if any)."""
        if borrowed is not None:
            self.scratch.held_by(borrowed, handle)
        return handle

    def _handle(self, works: list, then: Optional[Callable[[], None]] = None, kind: str = "") -> Handle:
        """A handle on ``works``; where ``watched`` its wait is the hang detection's (``health``),
        labelled with ``kind`` and this group's name."""
        watched = (f"{kind} on the {self.label} group", self.global_ranks) if self.watched else None
        return Handle(works, then, watched)

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

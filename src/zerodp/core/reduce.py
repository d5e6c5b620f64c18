"""Gradient reduction: from a parameter's ready gradient to this rank's reduced gradient.

A ``GradReducer`` owns everything one backward needs to reduce gradients: which parameters
have handed in their gradient, which flat groups are complete, the collectives in flight and
the stage 2-3 buckets they reduce. A backward pass (``backward.py``, the engine's and a plain
loop's alike), the step (``engine.py``) and the ledger (``memory.py``) talk to it through its
public methods:

* ``begin(reducing)`` starts a backward, which reduces or only accumulates locally;
* ``on_grad(t, i, param)`` takes a parameter's gradient when autograd has accumulated it;
* ``on_unit_done(unit_index)`` (stage 3) launches a unit's groups once backward left the unit;
* ``finish()`` launches the groups that never completed and waits for every reduction.

What it does per stage comes from the ``StagePolicy`` (``stages.py``):

* stages 0-1 (``full_gradient_buffer``): gradients accumulate in each group's full gradient
  buffer (``p.grad`` is a view of it), which is all-reduced (stage 0) or reduce-scattered
  (stage 1) in place; in a backward that does not reduce they only accumulate;
* stages 2-3: each group's gradients are written into a temporary full-size bucket, which is
  reduce-scattered: the step's first reduction of a group writes its sum straight into the
  group's gradient shard (allocated then, freed after the update); a later one's part is
  added into it when it is waited for. Then the bucket is freed. At most
  ``MAX_BUCKETS_IN_FLIGHT`` reductions are in flight at once;
* stages 0-2 launch a group once all its parameters have a gradient; stage 3
  (``reduces_per_unit``) launches a unit's groups when backward has gone through the unit,
  so ranks whose unit got no gradient for some parameter still issue the same collectives.

Groups are launched in group order, the same on every rank, asynchronously when
``overlap_comm`` is on. Each group is reduced over its own shard axis (``FlatGroup.axis``,
looked up in the ``ShardAxes`` the reducer is given, ``axes.py``), so groups sharded over
different ranks use the same code. With hybrid sharding it is also given the replica group of
the data axis: the shard group's reduced gradients are summed across the
replicas once per optimizer step (``sum_over_replicas``), not in every micro-batch.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .axes import DATA, ShardAxes
from .collectives import Comm, Handle
from .flat import FlatGroup, grad_like, grad_local, local_tensor
from .precision import PrecisionPolicy
from .stages import StagePolicy

#: Stages 2-3 keep at most this many full-size gradient buckets in flight during backward (plus
#: the ones still filling).
MAX_BUCKETS_IN_FLIGHT = 2


class GradReducer:
    """The gradient reduction of one engine's trainable flat groups, each over its shard axis.

    ``groups`` are the trainable flat groups, indexed by ``t`` in ``on_grad``; ``reduce_scatter``
    is ``zero_optimization.reduce_scatter`` (False: all-reduce at every stage) and
    ``overlap_comm`` whether collectives run asynchronously while backward goes on.
    """

    def __init__(self, axes: ShardAxes, groups: Sequence[FlatGroup], policy: StagePolicy,
                 precision: PrecisionPolicy, *, reduce_scatter: bool, overlap_comm: bool,
                 replicas: Optional[Comm] = None) -> None:
        self.axes = axes
        self.replicas = replicas
        self.groups = list(groups)
        self.policy = policy
        self.precision = precision
        self.overlap_comm = overlap_comm
        self._scatters = policy.reduction != "all_reduce" and reduce_scatter  # False: all-reduce
        self._groups_of_unit: dict[int, list[int]] = {}  # stage-3 unit -> its groups' indices
        for t, g in enumerate(self.groups):
            self._groups_of_unit.setdefault(g.unit, []).append(t)
        self.peak_bucket_bytes = 0
        """The most bytes of stage 2-3 gradient buckets alive at once so far."""
        self._reducing = False
        self._used = [[False] * len(g.params) for g in self.groups]
        self._reset()

    # -- a backward ---------------------------------------------------------------------

    def begin(self, reducing: bool) -> None:
        """Start a backward: forget the last one's state; ``reducing`` says whether this one
        reduces (False: gradients only accumulate locally, in no_sync or between boundaries)."""
        self._reset()
        self._reducing = reducing

    @property
    def reducing(self) -> bool:
        """Whether the backward in progress reduces its gradients."""
        return self._reducing

    def on_grad(self, t: int, i: int, param: nn.Parameter) -> None:
        """Parameter ``i`` of group ``t`` has its gradient (its post-accumulate-grad hook):
        record that it was used, and take the gradient into its group's reduction."""
        g = self.groups[t]
        self._used[t][i] = True
        if not self._reducing:
            if self.policy.full_gradient_buffer:
                _fold_grad_into_full(g, i)
            return
        if self._seen[t][i]:
            raise RuntimeError(
                f"parameter {g.slots[i].name} received a second gradient in one backward after its "
                "group was reduced (reentrant activation checkpointing or two backward passes "
                "through one graph); use non-reentrant checkpointing or one engine.backward per loss")
        if self._ready[t]:
            raise RuntimeError(
                f"parameter {g.slots[i].name} received its gradient after its stage-3 unit finished "
                "backward: it is used outside its unit before the unit runs. Declare the use with "
                "zerodp.register_external_parameter(module, parameter), or make a module that "
                "encloses every use its unit (initialize(unit_classes=...))")
        self._seen[t][i] = True
        self._take_grad(t, i)
        if all(self._seen[t]) and not self.policy.reduces_per_unit:
            self._mark_ready(t)  # stage 3 launches per unit, in on_unit_done

    def on_unit_done(self, unit_index: int) -> None:
        """Stage 3: backward has gone through unit ``unit_index``; launch its groups' reductions.

        Launching per unit (not per parameter) keeps the order of all-gathers and
        reduce-scatters the same on every rank even when a parameter inside a unit gets no
        gradient on some ranks."""
        if not self._reducing:
            return
        for t in self._groups_of_unit.get(unit_index, ()):
            if not self._ready[t]:
                self._complete_group(t)

    def finish(self) -> None:
        """End a reducing backward: launch the groups autograd never completed (unused
        parameters), then wait for every reduction. Does nothing in a backward that does not
        reduce; afterwards ``reducing`` is False."""
        if not self._reducing:
            return
        try:
            for t in range(len(self.groups)):
                if not self._ready[t]:
                    self._complete_group(t)
            for h in self._handles:
                h.wait()
            self._handles = []
        finally:
            self._reducing = False

    def sum_over_replicas(self) -> None:
        """Hybrid sharding: add up the reduced gradient shards of the replicas (the same shard of
        every replica group), once per optimizer step. Nothing without replicas."""
        if self.replicas is None or self.replicas.world_size == 1:
            return
        handles = [self.replicas.all_reduce_sum(g.grads.shard, async_op=True)
                   for g in self.groups if g.grads.shard is not None and g.axis == DATA]
        for h in handles:
            h.wait()

    # -- what the step and the ledger read ----------------------------------------------

    def usage(self) -> list[list[bool]]:
        """Per group, per parameter: whether it got a gradient on this rank since ``clear_usage``."""
        return [list(u) for u in self._used]

    def clear_usage(self) -> None:
        """Forget which parameters got a gradient (after an update)."""
        self._used = [[False] * len(g.params) for g in self.groups]

    def bucket_bytes(self) -> int:
        """Bytes of stage 2-3 gradient buckets alive right now (zero between backwards)."""
        return sum(b.numel() * b.element_size() for b in self._buckets.values())

    # -- inside ---------------------------------------------------------------------------

    def _reset(self) -> None:
        self._seen = [[False] * len(g.params) for g in self.groups]
        self._ready = [False] * len(self.groups)
        self._next_launch = 0
        self._handles: list[Handle] = []
        self._buckets: dict[int, torch.Tensor] = {}

    def _grad_buffer(self, t: int) -> torch.Tensor:
        """Where group ``t``'s gradients are gathered before reduction."""
        g = self.groups[t]
        if self.policy.full_gradient_buffer:
            return g.grads.full
        if t not in self._buckets:
            self._buckets[t] = _new_bucket(g, self.precision.comm_dtype(g.grads.dtype))
            self.peak_bucket_bytes = max(self.peak_bucket_bytes, self.bucket_bytes())
        return self._buckets[t]

    def _complete_group(self, t: int) -> None:
        """Take gradients whose hooks did not fire (accumulated in no_sync, or none) and mark
        group ``t`` ready."""
        for i in range(len(self.groups[t].params)):
            if not self._seen[t][i]:
                self._take_grad(t, i)
        self._mark_ready(t)

    def _take_grad(self, t: int, i: int) -> None:
        """Move parameter ``i``'s gradient into group ``t``'s reduction buffer: added into
        the full gradient buffer (stages 0-1), written into the bucket (stages 2-3)."""
        g = self.groups[t]
        if self.policy.full_gradient_buffer:
            _fold_grad_into_full(g, i)
        else:
            _move_grad_into_bucket(g, self._grad_buffer(t), i)

    def _mark_ready(self, t: int) -> None:
        """Group ``t`` is complete: launch it and every complete group after it, in order."""
        self._ready[t] = True
        while self._next_launch < len(self.groups) and self._ready[self._next_launch]:
            self._launch_reduction(self._next_launch)
            self._next_launch += 1

    def _launch_reduction(self, t: int) -> None:
        g = self.groups[t]
        buf = self._grad_buffer(t)
        comm = self.axes.of(g)
        collective = comm.reduce_scatter_sum if self._scatters else comm.all_reduce_sum
        if self.policy.full_gradient_buffer:  # stages 0-1: the full buffer stays, reduced in place
            comm_dtype = self.precision.comm_dtype(buf.dtype)
            if comm_dtype == buf.dtype:
                self._handles.append(collective(buf, async_op=self.overlap_comm))
            else:  # reduced in another dtype: through a temporary copy
                tmp = buf.to(comm_dtype)
                self._handles.append(collective(tmp, async_op=self.overlap_comm,
                                                then=lambda g=g, tmp=tmp: g.grads.shard.copy_(g.shard_of(tmp))))
            return

        # stages 2-3: the step's first reduction of a group lands in its gradient shard; a later
        # one (accumulation) is added into it from this rank's part of the bucket; then the bucket is freed
        out = g.grads.claim_shard(buf.dtype) if self._scatters else None

        def then(g=g, buf=buf, t=t, out=out):
            if out is None:
                g.grads.add_to_shard(g.shard_of(buf))
            self._buckets.pop(t, None)
        extra = {} if out is None else {"out": out}
        # bound the reductions in flight (and the scratch buffers they hold): wait for the oldest first
        self._handles = [h for h in self._handles if not h.done]
        while len(self._handles) >= MAX_BUCKETS_IN_FLIGHT:
            self._handles.pop(0).wait()
        self._handles.append(collective(buf, async_op=self.overlap_comm, then=then, **extra))


def _fold_grad_into_full(g: FlatGroup, slot: int) -> None:
    """Move ``g.params[slot].grad`` into the group's full gradient buffer (stages 0-1). Where
    ``.grad`` already is its view of the buffer nothing moves; otherwise it is added in (cast to
    the buffer's dtype) and ``.grad`` becomes that view again (same dtype) or is dropped."""
    p = g.params[slot]
    target = g.view(g.grads.full, slot)
    if p.grad is None or local_tensor(p.grad).data_ptr() == target.data_ptr():
        return
    target.add_(grad_local(p))
    p.grad = grad_like(p, target) if target.dtype == p.dtype else None


def _new_bucket(g: FlatGroup, dtype: torch.dtype) -> torch.Tensor:
    """A full-size gradient bucket for one reduction of group ``g`` (stages 2-3), left unwritten
    except for its padding: each parameter's part is written once by ``_move_grad_into_bucket``, so
    its memory is committed as gradients arrive (and no zero fill is spent)."""
    bucket = torch.empty(g.padded_numel, dtype=dtype, device=g.device)
    bucket[g.numel:].zero_()
    return bucket


def _move_grad_into_bucket(g: FlatGroup, bucket: torch.Tensor, slot: int) -> None:
    """Write ``g.params[slot].grad`` (zeros if it has none) into its part of ``bucket`` and drop it;
    called exactly once per parameter and bucket."""
    p, target = g.params[slot], g.view(bucket, slot)
    if p.grad is None:
        target.zero_()
    else:
        target.copy_(grad_local(p))
        p.grad = None

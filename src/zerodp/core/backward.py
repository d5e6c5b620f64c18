"""A backward pass through an engine's model, one object whoever starts it.

``engine.backward(loss)`` runs one inside :meth:`Backward.run`; a plain ``loss.backward()``
(``plain_loop.py``) is noticed by the first gradient (or stage-3 unit) it delivers, and its end is
queued with autograd. Either way the same methods decide whether the pass reduces
(:meth:`Backward.reduces`), hand each gradient and each finished stage-3 unit to the reducer, and
finish it (:meth:`Backward.finish`: wait for the reductions, release the units).

What it is given: the engine's ``GradReducer`` (``reduce.py``), its ``ShardedParams`` at stage 3
(``sharded.py``; None below), its ``StagePolicy``, a callable that says whether the engine is
inside ``no_sync()``, and the plain loop's bookkeeping (``PlainLoop.began`` / ``ended``).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Protocol

from torch import nn
from torch.autograd import Variable

if TYPE_CHECKING:
    from .gather import Unit
    from .reduce import GradReducer
    from .sharded import ShardedParams
    from .stages import StagePolicy


class PlainBookkeeping(Protocol):
    """What a plain backward tells the plain loop (``plain_loop.PlainLoop``)."""

    def began(self) -> None: ...
    def ended(self, kept_local: bool) -> None: ...


class Backward:
    """One engine's backward passes (see the module docstring)."""

    def __init__(self, reducer: "GradReducer", sharded: "Optional[ShardedParams]", policy: "StagePolicy",
                 in_no_sync: Callable[[], bool], plain: PlainBookkeeping) -> None:
        self.reducer, self.sharded, self.policy = reducer, sharded, policy
        self._in_no_sync = in_no_sync
        self._plain = plain
        self.running = False  # a backward pass is under way (the engine's or a plain one)

    def reduces(self, boundary: bool) -> bool:
        """Whether a backward starting now reduces its gradients: never inside ``no_sync()``; at
        stages 2-3 always; at stages 0-1 only at a gradient-accumulation ``boundary`` (a plain
        backward has none: ``optimizer.step()`` reduces what accumulated)."""
        return not self._in_no_sync() and (self.policy.reduce_every_micro_batch or boundary)

    @contextlib.contextmanager
    def run(self, boundary: bool) -> Iterator[bool]:
        """The engine's backward: autograd runs inside the context, which yields whether the pass
        reduces, and finishes it on leaving (unless autograd raised)."""
        reducing = self.reduces(boundary)
        self.reducer.begin(reducing)
        self.running = True
        try:
            yield reducing
        finally:
            self.running = False
        self.finish()

    def on_grad(self, t: int, i: int, param: nn.Parameter) -> None:
        """Parameter ``i`` of trainable group ``t`` has its gradient (its post-accumulate-grad hook)."""
        if not self.running:
            self._begin_plain()
        self.reducer.on_grad(t, i, param)

    def on_unit_done(self, unit: "Unit") -> None:
        """Stage 3: backward has gone through ``unit`` (``ShardedParams`` released it): reduce its
        gradients."""
        if not self.running:
            self._begin_plain()
        self.reducer.on_unit_done(unit.index)

    def finish(self) -> bool:
        """End a backward: wait for its reductions and release every stage-3 unit. Returns whether
        its gradients stayed local (a pass that did not reduce)."""
        kept_local = not self.reducer.reducing
        self.reducer.finish()
        if self.sharded is not None:
            self.sharded.backward_ended()
        return kept_local

    def _begin_plain(self) -> None:
        """A backward the engine did not start delivered its first gradient: begin it, and have
        autograd end it when it is done."""
        self.running = True
        self.reducer.begin(self.reduces(boundary=False))
        self._plain.began()
        Variable._execution_engine.queue_callback(self._end_plain)

    def _end_plain(self) -> None:
        kept_local = False
        try:
            kept_local = self.finish()
        finally:
            self.running = False
            self._plain.ended(kept_local)

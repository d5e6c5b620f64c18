"""The loop people already have: ``loss.backward(); optimizer.step(); optimizer.zero_grad()``.

``zerodp.initialize`` returns the engine and its optimizer; besides DeepSpeed's
``engine.backward(loss); engine.step()``, they work the way DDP and torch's
``ZeroRedundancyOptimizer`` are used, with PyTorch's semantics:

* the user scales the loss for accumulation (``(loss / k).backward()`` k times), and the
  config's ``gradient_accumulation_steps`` plays no part: every ``optimizer.step()`` updates;
* gradients are averaged over the ranks, as DDP does;
* communication: at stages 2-3 every ``backward()`` (outside ``engine.no_sync()``)
  reduce-scatters its gradients in buckets while it runs, as ``engine.backward`` does; at
  stages 0-1 gradients accumulate locally and ``optimizer.step()`` reduces them, then updates;
* ``gradient_clipping`` from the config is applied at ``optimizer.step()`` to the global norm
  (torch's ``clip_grad_norm_`` on the model's parameters cannot see gradient shards);
* fp16 needs its loss scaled: ``engine.scale(loss).backward()``; ``optimizer.step()`` refuses
  fp16 gradients from a backward whose loss was not scaled.

The engine's ``Backward`` (``backward.py``) notices a plain backward from its gradient hooks (a
backward it did not start), runs it as it runs ``engine.backward``'s, and tells this object when
it began and ended. ``optimizer.step`` and
``zero_grad`` of the returned optimizer are the engine's, bound to that optimizer object alone
(nothing of torch is patched): a learning-rate scheduler built on it works as usual.
"""
from __future__ import annotations

import types
import weakref
from typing import TYPE_CHECKING, Callable, Optional, Protocol

import torch

if TYPE_CHECKING:
    from .precision import LossScaler
    from .reduce import GradReducer


class LoopEngine(Protocol):
    """What the plain loop uses of its engine (a ``ZeroEngine``, not imported here: the engine
    imports this module)."""

    optimizer: torch.optim.Optimizer
    loss_scaler: "Optional[LossScaler]"
    reducer: "GradReducer"              # the backward's gradient reduction

    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def update_parameters(self, count_micro_step: bool) -> None: ...


class PlainLoop:
    """One engine's support for the plain loop (see module docstring)."""

    def __init__(self, engine: LoopEngine) -> None:
        self._engine = weakref.ref(engine)
        self.local_grads = False        # stages 0-1: gradients accumulated, not yet reduced
        self.backward_seen = False      # a plain backward ran since the last update
        self.scaled = False             # engine.scale(loss) was called since the last update
        opt = engine.optimizer
        if opt is None:  # an engine for evaluation only
            return
        ref = self._engine
        plain = weakref.ref(self)

        def step(optimizer, closure: Optional[Callable] = None):
            live = plain()
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if live is not None:
                live.update()
            return loss

        def zero_grad(optimizer, set_to_none: bool = True) -> None:
            live = ref()
            if live is not None:
                live.zero_grad(set_to_none)

        # bound methods of this optimizer object, so torch's LRScheduler can wrap them as usual
        opt.step = types.MethodType(step, opt)
        opt.zero_grad = types.MethodType(zero_grad, opt)

    def began(self) -> None:
        """A plain backward began (``Backward``)."""
        self.backward_seen = True

    def ended(self, kept_local: bool) -> None:
        """That backward ended; ``kept_local``: it did not reduce (stages 0-1 between updates)."""
        if kept_local:
            self.local_grads = True

    def forget_local(self) -> None:
        """The engine reduced what backward passes accumulated (``reduce_accumulated``)."""
        self.local_grads = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale, in fp32 (unchanged without fp16)."""
        engine = self._engine()
        self.scaled = True
        if engine.loss_scaler is None:
            return loss
        return loss.float() * engine.loss_scaler.scale

    def update(self) -> None:
        """``optimizer.step()``: reduce what is still local, then the engine's update."""
        engine = self._engine()
        if engine is None:
            return
        if engine.loss_scaler is not None and self.backward_seen and not self.scaled:
            raise RuntimeError(
                "fp16 training in a plain loop: the loss was not scaled, so small gradients flush to "
                "zero and overflows go unseen. Call engine.scale(loss).backward() instead of "
                "loss.backward() (or use engine.backward(loss) and engine.step())")
        if self.local_grads:  # one reduction of what the backward passes accumulated
            engine.reducer.begin(True)
            engine.reducer.finish()
        self.local_grads = self.backward_seen = self.scaled = False
        engine.update_parameters(count_micro_step=False)

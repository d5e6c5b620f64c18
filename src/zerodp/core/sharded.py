"""Stage 3 as one object: :class:`ShardedParams` owns the units, their prefetcher and agreement,
a unit's life in a step (its pre/post forward and backward, as methods), and every reset of
their state.

The engine holds one at stage 3 (``engine.sharded``; None below) and talks to it through the
methods below, as it talks to the gradient reducer (``reduce.py``) through its own:

* set-up: ``ShardedParams(...)`` makes the units of a plan and registers its methods as hooks on
  the model (the root unit), on every unit's module and on modules that use a unit's parameters
  externally, installs the watch on parameters read outside their unit (``access.py``), and
  ``initialize_meta`` gives a model built on the meta device its values;
* during a step: before a unit's forward the unit is gathered (``Prefetcher.before_forward``,
  which also prefetches the next units) and enters its forward; after it, it is released unless
  used again soon; backward reaching its outputs gathers it again and puts it in backward; once
  backward has gone through every call of the unit, :meth:`unit_done` releases it and the
  engine's callback hands its gradients to the reducer. Each unit's state (``gather.UnitState``)
  and the prefetch plan's (``gather.Plan``) change only through their own methods;
* the resets: :meth:`backward_ended` (autograd finished a backward: release every unit),
  :meth:`release_all` (``empty_partition_cache``; a checkpoint load), :meth:`held` (every unit
  gathered for a whole pipeline step);
* what others read: ``units`` (for tests and tools), ``axes`` (the collectives of its units'
  shard axes, for the stage-3 reductions), ``comm`` (the data axis' of them) and its ``scratch``,
  ``agreement``, ``peak_gathered_bytes``, ``gather_wait_s``, :meth:`unit_sizes`,
  :meth:`invalidate` and ``recorded`` (DeepSpeed's ``param_coordinator`` that TRL resets after
  generation).
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from .access import ReadWatch
from .collectives import ScratchPool
from .gather import (
    AfterUnitBackward,
    Prefetcher,
    Unit,
    initialize_meta_units,
    inside_backward,
    map_tensors,
    tensors_in,
)
from .leaves import mark_leaf_parameters
from .param_api import external_users
from .secondary import SecondaryCopy

if TYPE_CHECKING:
    from ..config import ZeroConfig
    from .axes import ShardAxes
    from .collectives import Comm
    from .flat import FlatGroup

__all__ = ["ShardedParams", "outside_compile"]


def outside_compile(hook: Callable) -> Callable:
    """``hook`` as it runs under ``torch.compile``: never traced. Dynamo ends the graph where the hook is
    called, runs it as Python, and resumes in a new graph, so each unit's gather, release and
    prefetch stay around the compiled code of its forward (as FSDP2 keeps its hooks around compiled
    blocks); a compiled region spans one unit's forward at most."""
    return torch.compiler.disable(hook, recursive=True)


class ShardedParams:
    """The units of a stage-3 model (``unit_plan``: ``[(name, module)]``, the root first) over
    ``groups`` (flat groups already sharded), each gathered over its axis of ``axes``; ``on_unit_done(unit)`` is
    called once backward has gone through a unit (after :meth:`unit_done`).

    ``secondary``: with hpZ, the collectives of the few ranks that share each group's secondary copy
    (``secondary.py``).

    ``axes`` are the shard axes' collectives borrowing from the object's own ``scratch``: one buffer,
    sized to the largest unit, for gloo's all-to-all forms (an all-gather's copies of this
    rank's shard, a reduce-scatter's received chunks). The units' all-gathers and, given these
    ``axes``, the engine's stage-3 reductions take turns with it, so a rank holds one such
    buffer, not one per operation in flight (each one overlaps a unit's computation still)."""

    def __init__(self, model: nn.Module, unit_plan: list, groups: "list[FlatGroup]", axes: "ShardAxes",
                 zero_config: "ZeroConfig", on_unit_done: Callable[[Unit], None],
                 secondary: Optional["Comm"] = None) -> None:
        self.scratch = ScratchPool(capacity=1)
        self.axes = axes.using(self.scratch)
        self.comm = self.axes.comm()  # the data axis: the ranks' agreement on the units they run
        if secondary is not None:  # hpZ: each group's secondary copy, gathered within these ranks
            within = secondary.using(self.scratch)
            for g in groups:
                g.attach_secondary(SecondaryCopy(within, g.padded_numel, pin=True))
        self.units = [Unit(u, name, mod, [g for g in groups if g.unit == u], self.axes)
                      for u, (name, mod) in enumerate(unit_plan)]
        mark_leaf_parameters(model)
        zc = zero_config
        self.prefetcher = Prefetcher(self.units, zc.stage3_prefetch_bucket_size,
                                     zc.stage3_max_live_parameters, zc.stage3_max_reuse_distance)
        self._on_unit_done = on_unit_done
        self._depth = 0  # calls of the model in progress (nested calls in its own forward are one)
        self._pre_backward = outside_compile(self._unit_pre_backward)  # wrapped once, bound to outputs each forward
        self._hooks = [model.register_forward_pre_hook(outside_compile(self._root_pre_forward)),
                       model.register_forward_hook(outside_compile(self._root_post_forward), always_call=True)]
        for unit in self.units[1:]:
            self._hooks += [
                unit.module.register_forward_pre_hook(
                    outside_compile(functools.partial(self._unit_pre_forward, unit)), with_kwargs=True),
                unit.module.register_forward_hook(outside_compile(functools.partial(self._unit_post_forward, unit)))]
        unit_of_param = {id(p): self.units[g.unit] for g in groups for p in g.params}
        for module, params in external_users(model):
            owners = {id(u): u for p in params if (u := unit_of_param.get(id(p))) is not None
                      and not u.is_root}
            if owners:
                self._hooks += self.install_external(module, list(owners.values()))
        # reads of a parameter outside its unit's forward: gathered then, external from then on
        self.watch = ReadWatch(model, self.units, self.prefetcher, self.install_external)

    # -- set-up ------------------------------------------------------------------------------

    def initialize_meta(self, seed: int, device: "torch.device", param_init_fn: Optional[Callable],
                        after_group: Optional[Callable] = None, loaded: Optional[dict] = None,
                        after_unit: Optional[Callable] = None) -> None:
        """Give parameters built on the meta device their values, one unit at a time
        (``gather.initialize_meta_units``)."""
        initialize_meta_units(self.units, seed, device, param_init_fn, self.prefetcher,
                              after_group=after_group, loaded=loaded, after_unit=after_unit)

    def eager_while_recording(self):
        """A context for a call of the model: while that forward records the order of units (the
        first one, and the first after the calls changed), compiled code runs as Python
        (``torch.compiler.set_stance("force_eager")``), so that its reads of another unit's
        parameters are noticed and registered as external (``access.py``); later, compiled, forwards
        find those units gathered by the reading module's hooks, as nothing is gathered on a read
        inside a compiled graph. Compilation starts with the next forward."""
        if self.prefetcher.recorded or not hasattr(torch.compiler, "set_stance"):
            return contextlib.nullcontext()
        return torch.compiler.set_stance("force_eager")

    # -- a unit's life in a step: the hooks' bodies ---------------------------------------------

    def _root_pre_forward(self, module: nn.Module, args) -> None:
        """Before a call of the model (through the engine, or directly: ``trainer.evaluate()``,
        ``model.generate(...)``): gather the root unit and start the forward's prefetch plan."""
        root = self.units[0]
        if inside_backward():  # recomputed during backward: gathered until that ends
            root.gather()
            return
        self._depth += 1
        if self._depth == 1:  # the root unit on its way, then the first units' prefetch, then wait for the root
            self.watch.forward_begins()
            root.gather(async_op=True)
            self.prefetcher.start_forward()
            root.gather()
            self.prefetcher.note_peak()

    def _root_post_forward(self, module: nn.Module, args, output) -> None:
        """After a call of the model: end the plan; when no backward follows (no grad: evaluation,
        ``generate``) release every unit. The root unit otherwise stays gathered until backward ends."""
        if inside_backward() or self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            # torch calls this hook (always_call) from its handler when the forward raised: the
            # ranks no longer run the same calls, so the end of the forward cannot be agreed on
            raised = output is None and sys.exc_info()[0] is not None
            self.prefetcher.end_forward(raised=raised)
            if not torch.is_grad_enabled():
                for unit in self.units:
                    unit.release()

    def _unit_pre_forward(self, unit: Unit, module: nn.Module, args, kwargs):
        """Gather a (non-root) unit before its forward; when its inputs require grad, wrap them so
        that :meth:`_unit_post_backward` runs once backward has gone through the unit."""
        if inside_backward():  # a checkpointed forward recomputed during backward
            unit.gather()
            return None
        self.prefetcher.before_forward(unit)
        if not torch.is_grad_enabled():
            return None
        needs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if not needs:  # no backward through the unit: it is finished when backward ends
            return None
        unit.expect_backward()
        outs = iter(AfterUnitBackward.apply(functools.partial(self._unit_post_backward, unit), *needs))
        ids = {id(t) for t in needs}
        swap = lambda t: next(outs) if id(t) in ids else t  # noqa: E731
        return map_tensors(args, swap), map_tensors(kwargs, swap)

    def _unit_post_forward(self, unit: Unit, module: nn.Module, args, output):
        """Release a unit after its forward (unless it is used next, or externally in progress), and
        have backward gather it again when it reaches the unit's outputs."""
        if inside_backward() or unit.in_backward:
            return output  # recomputed for backward: the unit stays gathered until that ends
        self._regather_in_backward(output, (unit,))
        unit.leave_forward()
        if unit.pins == 0 and not self.prefetcher.keep_after_forward(unit):
            unit.release()
        return output

    def _regather_in_backward(self, output, units: "tuple[Unit, ...]") -> None:
        """Have backward gather ``units`` again when it reaches ``output`` (with grad enabled)."""
        if torch.is_grad_enabled():
            regather = functools.partial(self._pre_backward, units)
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(regather)

    def _unit_pre_backward(self, units: "tuple[Unit, ...]", grad):
        """Backward reached outputs of ``units``: gather them for their backward."""
        for unit in units:
            self.prefetcher.before_backward(unit)
        return grad

    def _unit_post_backward(self, unit: Unit) -> None:
        """One backward went through ``unit``; after the last one expected, :meth:`unit_done` and
        the engine's callback (its ``Backward`` hands the unit's gradients to the reducer)."""
        if unit.backward_came():
            self.unit_done(unit)  # the next units' all-gathers go first: backward waits for them
            self._on_unit_done(unit)

    def install_external(self, module: nn.Module, units: "list[Unit]") -> list:
        """Keep ``units`` gathered around ``module``'s forward (it uses their parameters), and gather
        them again when backward reaches its outputs; returns the hooks."""
        pre = outside_compile(functools.partial(self._external_pre_forward, units))
        post = outside_compile(functools.partial(self._external_post_forward, units))
        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _external_pre_forward(self, units: "list[Unit]", module: nn.Module, args) -> None:
        for u in units:
            u.pin()
            self.prefetcher.gather_now(u)

    def _external_post_forward(self, units: "list[Unit]", module: nn.Module, args, output):
        for u in units:
            u.unpin()
        if inside_backward():
            return output
        self._regather_in_backward(output, tuple(units))
        for u in units:
            if u.pins == 0 and not u.in_backward:
                u.release()
        return output

    def unit_done(self, unit: Unit) -> None:
        """Backward has gone through ``unit``: release it, and start the next units' all-gathers
        before its gradients are reduced (backward waits for those gathers, not for the reduction)."""
        unit.release()
        self.prefetcher.after_backward(unit)

    # -- the resets ----------------------------------------------------------------------------

    def backward_ended(self) -> None:
        """Autograd finished a backward: every unit is released (the root unit, and any unit whose
        backward never came because none of its inputs required grad) and expects no backward."""
        for unit in self.units:
            unit.end_backward()

    def release_all(self, forget_uses: bool = False) -> None:
        """Release every unit not held for a pipeline step; ``forget_uses``: also forget forwards
        whose backward never came and external uses in progress (between steps only)."""
        for unit in self.units:
            if forget_uses:
                unit.forget_uses()
            unit.release()

    @contextlib.contextmanager
    def held(self):
        """Every unit gathered for the duration and released after; the hooks' gathering,
        prefetching and checks stand by meanwhile."""
        for unit in self.units:
            unit.hold()
        self.prefetcher.note_peak()
        self.prefetcher.suspend()
        try:
            yield
        finally:
            self.prefetcher.resume()
            for unit in self.units:
                unit.unhold()
            self.backward_ended()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.watch.remove()
        self.scratch.release()

    # -- what others read ----------------------------------------------------------------------

    @property
    def agreement(self) -> Any:
        """The check that every rank runs the same units (``agree.py``)."""
        return self.prefetcher.agreement

    @property
    def peak_gathered_bytes(self) -> int:
        return self.prefetcher.peak_gathered_bytes

    @property
    def peak_secondary_bytes(self) -> int:
        """hpZ: the most bytes of secondary copies held at once so far."""
        return self.prefetcher.peak_secondary_bytes

    @property
    def gather_wait_s(self) -> float:
        """Time spent waiting for units to arrive (exposed all-gathers)."""
        return self.prefetcher.gather_wait_s

    @property
    def recorded(self) -> bool:
        """Whether a forward order is recorded and in force (prefetching follows it)."""
        return self.prefetcher.recorded

    def invalidate(self) -> None:
        """Record the order of units afresh in the next forward."""
        self.prefetcher.invalidate()

    def unit_sizes(self) -> list[int]:
        """Parameter elements of each unit, the root first (without padding)."""
        return [sum(g.numel for g in u.groups) for u in self.units]

"""Stage 3 as one object: :class:`ShardedParams` owns the units, their prefetcher and agreement,
the hooks that gather and release them, and every reset of their state.

The engine holds one at stage 3 (``engine.sharded``; None below) and talks to it through the
methods below, as it talks to the gradient reducer (``reduce.py``) through its own:

* set-up: ``ShardedParams(...)`` makes the units of a plan, installs the root, unit and external
  hooks (``gather.py``) and the watch on parameters read outside their unit (``access.py``), and
  ``initialize_meta`` gives a model built on the meta device its values;
* during a step: the hooks call ``Prefetcher.before_forward`` / ``before_backward`` and, once
  backward has gone through a unit, the engine's callback, which calls :meth:`unit_done` before
  handing the unit's gradients to the reducer;
* the resets: :meth:`backward_ended` (autograd finished a backward: release every unit),
  :meth:`release_all` (``empty_partition_cache``; a checkpoint load), :meth:`held` (every unit
  gathered for a whole pipeline step);
* what others read: ``units`` (for tests and tools), ``axes`` (the collectives of its units'
  shard axes, for the stage-3 reductions), ``comm`` (the data axis' of them) and its ``scratch``,
  ``agreement``, ``peak_gathered_bytes``,
  ``gather_wait_s``, :meth:`unit_sizes`, :meth:`invalidate` and ``recorded`` (DeepSpeed's
  ``param_coordinator`` that TRL resets after generation).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import nn

from .access import ReadWatch
from .collectives import ScratchPool
from .gather import (
    Prefetcher,
    Unit,
    initialize_meta_units,
    install_external_hooks,
    install_root_hooks,
    install_unit_hooks,
)
from .leaves import mark_leaf_parameters
from .param_api import external_users
from .secondary import SecondaryCopy

if TYPE_CHECKING:
    import torch

    from ..config import ZeroConfig
    from .axes import ShardAxes
    from .collectives import Comm
    from .flat import FlatGroup

__all__ = ["ShardedParams"]


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
                g.secondary = SecondaryCopy(within, g.padded_numel, pin=True)
        self.units = [Unit(u, name, mod, [g for g in groups if g.unit == u], self.axes)
                      for u, (name, mod) in enumerate(unit_plan)]
        mark_leaf_parameters(model)
        zc = zero_config
        self.prefetcher = Prefetcher(self.units, zc.stage3_prefetch_bucket_size,
                                     zc.stage3_max_live_parameters, zc.stage3_max_reuse_distance)
        self._hooks = install_root_hooks(model, self.units, self.prefetcher)
        for unit in self.units[1:]:
            self._hooks += install_unit_hooks(unit, self.prefetcher, on_unit_done)
        unit_of_param = {id(p): self.units[g.unit] for g in groups for p in g.params}
        for module, params in external_users(model):
            owners = {id(u): u for p in params if (u := unit_of_param.get(id(p))) is not None
                      and not u.is_root}
            if owners:
                self._hooks += install_external_hooks(module, list(owners.values()), self.prefetcher)
        # reads of a parameter outside its unit's forward: gathered then, external from then on
        self.watch = ReadWatch(model, self.units, self.prefetcher)

    # -- set-up ------------------------------------------------------------------------------

    def initialize_meta(self, seed: int, device: "torch.device", param_init_fn: Optional[Callable],
                        after_group: Optional[Callable] = None, loaded: Optional[dict] = None,
                        after_unit: Optional[Callable] = None) -> None:
        """Give parameters built on the meta device their values, one unit at a time
        (``gather.initialize_meta_units``)."""
        initialize_meta_units(self.units, seed, device, param_init_fn, self.prefetcher,
                              after_group=after_group, loaded=loaded, after_unit=after_unit)

    # -- during a step -----------------------------------------------------------------------

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
            unit.release()
            unit.pending_backward = 0

    def release_all(self, forget_uses: bool = False) -> None:
        """Release every unit not held for a pipeline step; ``forget_uses``: also forget forwards
        whose backward never came and external uses in progress (between steps only)."""
        for unit in self.units:
            if forget_uses and not unit.held:
                unit.pins = 0
                unit.pending_backward = 0
            unit.release()

    @contextlib.contextmanager
    def held(self):
        """Every unit gathered for the duration and released after; the hooks' gathering,
        prefetching and checks stand by meanwhile."""
        for unit in self.units:
            unit.gather()
            unit.held = True
        self.prefetcher.note_peak()
        self.prefetcher.suspended = True
        try:
            yield
        finally:
            self.prefetcher.suspended = False
            for unit in self.units:
                unit.held = False
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

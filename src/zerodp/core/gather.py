"""Stage 3: parameters persist as shards and are gathered around the module units that use them.

A *unit* is a module whose parameters form their own flat groups. Before the unit's forward
its groups are all-gathered (``gather``); right after, they are released (their full
storage is freed; parameters and any views autograd saved keep their identity). Hooks on the
unit's outputs gather them again when backward reaches the unit; once every parameter of the
unit has its gradient, the engine reduce-scatters the gradients and releases the unit.

The *root* unit holds what no other unit claims, including every parameter that is
registered in more than one module (tied weights: an embedding reused by the output layer);
it stays gathered from the start of forward to the end of backward.

This module holds the unit (``Unit``, its state ``UnitState``), the prefetcher and its plan
(``Prefetcher``, ``Plan``), the choice of units (``plan_units``) and the unit-by-unit
initialization of a meta-device model; the hooks that drive a unit through a step are methods of
``ShardedParams`` (``sharded.py``). Only module hooks and tensor hooks are used; nothing of torch
or of the user's classes is patched.

What user code calls (``GatheredParameters``, ``register_external_parameter``) is in
``param_api.py``; its names can be imported from here too.
"""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import nn

from .agree import END_OF_FORWARD, UnitAgreement
from .flat import FlatGroup
from .init_shards import adopted, full_shape, full_values, init_shard
from .leaves import enclosing_leaf_candidate, is_leaf
from .param_api import GatheredParameters, external_users, register_external_parameter, register_params  # noqa: F401

if TYPE_CHECKING:
    from .axes import ShardAxes


class UnitState(enum.Enum):
    """Where a stage-3 unit is in a step (FSDP2's training state of a parameter group). Whether it
    is gathered is its flat groups' to say: an idle unit may be gathered ahead of its use."""

    IDLE = "idle"          # no pass runs in it: sharded, or gathered ahead (prefetched, kept)
    FORWARD = "forward"    # gathered for its forward
    BACKWARD = "backward"  # gathered for its backward, until released after it
    HELD = "held"          # gathered for a whole step (a pipeline's micro-batches): never released


class Unit:
    """One module's flat groups, gathered and released together, and where the unit is in a step.

    Its state changes only through the methods below, which ``ShardedParams`` (``sharded.py``)
    and the prefetcher call: :meth:`enter_forward`, :meth:`leave_forward`, :meth:`enter_backward`,
    :meth:`release` (back to idle), :meth:`hold` / :meth:`unhold`. Two counts go with it:
    ``pins``, forwards of modules that use its parameters externally in progress (it stays
    gathered meanwhile), and ``pending_backward``, forwards whose backward has not gone through
    the unit yet."""

    def __init__(self, index: int, name: str, module: nn.Module, groups: list[FlatGroup],
                 axes: "ShardAxes") -> None:
        self.index, self.name, self.module, self.groups, self.axes = index, name, module, groups, axes
        self.state = UnitState.IDLE
        self.pins = 0
        self.pending_backward = 0

    @property
    def is_root(self) -> bool:
        return self.index == 0

    @property
    def numel(self) -> int:
        return sum(g.padded_numel for g in self.groups)

    @property
    def gathered(self) -> bool:
        return all(g.gathered for g in self.groups)

    @property
    def held(self) -> bool:
        return self.state is UnitState.HELD

    @property
    def in_backward(self) -> bool:
        return self.state is UnitState.BACKWARD

    def gather(self, async_op: bool = False) -> None:
        """All-gather the unit's flat groups over their axes (``ShardAxes.gather``)."""
        for g in self.groups:
            self.axes.gather(g, async_op=async_op, what=f"unit '{self.name or '(root)'}'")

    # -- the state's transitions -------------------------------------------------------------

    def enter_forward(self) -> None:
        """Its forward begins (it is gathered); a unit held, or gathered for backward (a forward
        recomputed there), stays as it is."""
        if self.state is UnitState.IDLE:
            self.state = UnitState.FORWARD

    def leave_forward(self) -> None:
        """Its forward is over; gathered still until released (kept for a use soon after)."""
        if self.state is UnitState.FORWARD:
            self.state = UnitState.IDLE

    def enter_backward(self) -> None:
        """Backward reached the unit (it is gathered): it stays gathered until released after it."""
        if self.state is not UnitState.HELD:
            self.state = UnitState.BACKWARD

    def release(self) -> None:
        """Free the gathered parameters and go idle; a held unit stays gathered."""
        if self.state is UnitState.HELD:
            return
        for g in self.groups:
            g.release()
        self.state = UnitState.IDLE

    def hold(self) -> None:
        """Gather the unit and keep it gathered until :meth:`unhold` (a pipeline step)."""
        self.gather()
        self.state = UnitState.HELD

    def unhold(self) -> None:
        self.state = UnitState.IDLE

    # -- the counts ------------------------------------------------------------------------------

    def pin(self) -> None:
        """Keep the unit gathered until a matching :meth:`unpin`: a module using its parameters
        externally is in its forward (its hooks unpin at the end)."""
        self.pins += 1

    def unpin(self) -> None:
        self.pins -= 1

    def expect_backward(self) -> None:
        """A forward of the unit whose inputs require grad: one more backward to come through it."""
        self.pending_backward += 1

    def backward_came(self) -> bool:
        """One expected backward went through the unit; True when it was the last one."""
        self.pending_backward -= 1
        return self.pending_backward == 0

    def end_backward(self) -> None:
        """Autograd finished a backward: released (unless held); no backward is expected any more."""
        self.release()
        self.pending_backward = 0

    def forget_uses(self) -> None:
        """Forget forwards whose backward never came and external uses in progress (a held unit's
        are kept)."""
        if self.state is not UnitState.HELD:
            self.pins = 0
            self.pending_backward = 0


def inside_backward() -> bool:
    """True while autograd runs a backward pass (e.g. activation checkpointing recomputes a
    forward inside it)."""
    return torch._C._current_graph_task_id() != -1


class Plan(enum.Enum):
    """The prefetch plan's state (``Prefetcher.plan``)."""

    RECORDING = "recording"  # no order recorded: this forward records the units it runs; no prefetching
    FOLLOWING = "following"  # the pass keeps to the recorded order so far: the next units are prefetched
    DEPARTED = "departed"    # the pass left the order, or it was invalidated: nothing is prefetched,
    #                          and the next forward records the order again
    SUSPENDED = "suspended"  # every unit is held gathered (a pipeline step): the plan stands by


class Prefetcher:
    """Gathers the units expected next while the current one computes.

    The forward order of units is recorded in the first forward; later forwards check each
    unit against it and, while it holds, start the all-gathers of the next units (forward
    order; reverse order in backward) as asynchronous collectives, while the units gathered
    ahead of the current one (those prefetched earlier included) hold at most
    ``bucket_numel`` elements, and never beyond ``max_live_numel`` gathered elements. The
    first units are prefetched when the forward begins, while the root unit is gathered. The
    last unit of forward is the first of backward: it stays gathered between them (used again
    before any other unit is gathered; DeepSpeed's prefetcher keeps it too). The first unit of
    backward runs at the step's memory peak (every activation is still alive), so the units
    after it are prefetched when its backward is done rather than while it computes: at most
    one exposed gather per step, for one unit less at the peak.
    When a forward departs from the recorded order, prefetching stops for that pass and
    the order is recorded again in the next one (prefetching resumes in the one after); the
    plan's state (``plan``, a :class:`Plan`) says which of these holds.
    Every rank takes the same decisions, so the collectives stay in the same order on every
    rank; ``UnitAgreement`` checks that the ranks run the same units (``agree.py``).
    """

    def __init__(self, units: list[Unit], bucket_numel: int, max_live_numel: int,
                 max_reuse_numel: int = 0) -> None:
        self.units, self.bucket_numel, self.max_live_numel = units, bucket_numel, max_live_numel
        self.max_reuse_numel = max_reuse_numel
        self.order: Optional[list[int]] = None
        self.plan = Plan.RECORDING
        self._before_suspended = Plan.RECORDING  # the state to go back to after a held step
        self._recording: list[int] = []
        self._pos = self._bpos = 0
        self._last_backward = -1
        self._deferred: Optional[int] = None  # the first unit of backward: prefetch after it
        self.rerecords = 0
        self.peak_gathered_bytes = 0
        self.peak_secondary_bytes = 0  # hpZ's secondary copies (core/secondary.py), the most held at once
        self.gather_wait_s = 0.0  # time spent waiting for units to arrive (exposed gathers)
        self.agreement = UnitAgreement(units[0].axes.comm(), self._label, self._leaf_hint) if units else None
        self._prefetched_at: dict[int, int] = {}  # unit index -> announcements made when its prefetch began

    def _label(self, index: int) -> str:
        """A unit in the agreement's errors: its module's name and class."""
        unit = self.units[index]
        return f"{unit.name or 'root'}, a {type(unit.module).__name__}"

    def _leaf_hint(self, seen: list[int]) -> str:
        """For ranks that ran different units: the module around them that would be a leaf."""
        names = [self.units[i].name for i in set(seen) if i >= 0]
        found = enclosing_leaf_candidate(self.units[0].module, names)
        if found is None:
            return ""
        name, cls = found
        return (f" If {name} (a {cls}) chooses which of its modules run, as a mixture-of-experts block routes "
                f"tokens to experts, make it a leaf, gathered and reduced whole on every rank: "
                f"zerodp.utils.set_z3_leaf_modules(model, [{cls}]) before initialize, or "
                f'"leaf_module": {{"classes": ["{cls}"]}} in zero_optimization.')

    @property
    def recorded(self) -> bool:
        """Whether a forward order is recorded and still in force."""
        return self.order is not None and self.plan is not Plan.DEPARTED

    @property
    def suspended(self) -> bool:
        return self.plan is Plan.SUSPENDED

    @property
    def following(self) -> bool:
        """Whether the pass under way keeps to the recorded order (the next units are prefetched)."""
        return self.plan is Plan.FOLLOWING

    def invalidate(self) -> None:
        """Forget the recorded order: the next forward records it afresh (DeepSpeed's
        ``_invalidate_trace``, called after generation changed the calls)."""
        if self.plan is Plan.SUSPENDED:
            self._before_suspended = Plan.DEPARTED
        else:
            self.plan = Plan.DEPARTED

    def suspend(self) -> None:
        """Every unit is held gathered: stand by (no gathers, prefetches, checks or recording)."""
        if self.plan is not Plan.SUSPENDED:
            self._before_suspended, self.plan = self.plan, Plan.SUSPENDED

    def resume(self) -> None:
        if self.plan is Plan.SUSPENDED:
            self.plan = self._before_suspended

    def start_forward(self) -> None:
        self._recording, self._pos, self._bpos, self._last_backward = [], 0, 0, -1
        self._deferred = None
        if self.plan is Plan.SUSPENDED:
            return
        if self.plan is Plan.DEPARTED:
            self.order = None
        self.plan = Plan.RECORDING if self.order is None else Plan.FOLLOWING
        if self.plan is Plan.FOLLOWING:  # the first units, while the root unit is gathered
            self._prefetch(self.order)

    def end_forward(self, raised: bool = False) -> None:
        """The forward is over; ``raised``: it ended with an error on this rank, whose
        announcements are then dropped unsettled (and nothing is recorded)."""
        if raised:
            self.agreement.abandon()
            return
        self.agreement.announce(END_OF_FORWARD)
        self.agreement.settle()
        if self.plan is Plan.RECORDING:  # (held units: nothing was recorded)
            self.order = self._recording

    def gather_now(self, unit: Unit) -> None:
        if not unit.gathered:  # a collective of its own, not from the plan: every rank agrees first
            self.agreement.settle()
        elif any(g.gather_in_flight for g in unit.groups):  # prefetched: the ranks agreed up to there
            self.agreement.settle(self._prefetched_at.get(unit.index))
        t0 = time.perf_counter()
        unit.gather()
        self.gather_wait_s += time.perf_counter() - t0

    def before_forward(self, unit: Unit) -> None:
        if self.suspended:
            return
        self.agreement.announce(unit.index)
        on_plan = self.following and self._pos < len(self.order) and self.order[self._pos] == unit.index
        if not on_plan:  # what comes next is not in the plan: the ranks agree before any collective
            self.agreement.settle()
        self.gather_now(unit)
        unit.enter_forward()
        if self.plan is Plan.RECORDING:
            self._recording.append(unit.index)
        elif on_plan:
            self._pos += 1
            self._prefetch(self.order[self._pos:])
        elif self.following:  # the model ran a different sequence of units: record it in the next pass
            self.plan = Plan.DEPARTED
            self.rerecords += 1
        self.note_peak()

    def before_backward(self, unit: Unit) -> None:
        if self.suspended:
            return
        self.gather_now(unit)
        unit.enter_backward()
        if unit.index != self._last_backward and self.following:
            first = self._last_backward == -1
            self._last_backward = unit.index
            reverse = self.order[::-1]
            while self._bpos < len(reverse) and reverse[self._bpos] != unit.index:
                self._bpos += 1
            self._bpos += 1
            if first:  # the step's memory peak: every activation is alive; prefetch once it is done
                self._deferred = unit.index
            else:
                self._prefetch(reverse[self._bpos:])
        self.note_peak()

    def after_backward(self, unit: Unit) -> None:
        """Backward has gone through ``unit`` (and its gradients' reduction was launched)."""
        if self.suspended:
            return
        if self._deferred == unit.index:
            self._deferred = None
            if self.following:
                self._prefetch(self.order[::-1][self._bpos:])

    def keep_after_forward(self, unit: Unit) -> bool:
        """Whether ``unit`` should stay gathered after its forward: with prefetching on, when
        the recorded order uses it next (the last unit of forward, first of backward);
        otherwise when it is used again (later in forward, or in backward) before more than
        ``stage3_max_reuse_distance`` elements of other units are gathered, and keeping it
        stays within ``stage3_max_live_parameters``."""
        if not self.following or not self.order:
            return False
        following = self.order[self._pos] if self._pos < len(self.order) else self.order[-1]
        if self.bucket_numel > 0 and following == unit.index:
            # used again before any other unit (the last unit of forward is the first of
            # backward): what the prefetcher would gather next is already here
            return True
        if self.max_reuse_numel <= 0:
            return False
        distance, seen = 0, set()
        for index in self.order[self._pos:] + self.order[::-1]:
            if index == unit.index:
                break
            if index not in seen:
                seen.add(index)
                distance += self.units[index].numel
            if distance > self.max_reuse_numel:
                return False
        else:
            return False
        live = sum(g.padded_numel for u in self.units for g in u.groups if g.gathered)
        return live <= self.max_live_numel

    def _prefetch(self, upcoming: list[int]) -> None:
        if self.bucket_numel <= 0:
            return
        live = sum(g.padded_numel for u in self.units for g in u.groups if g.gathered)
        budget, seen = self.bucket_numel, set()
        for index in upcoming:
            unit = self.units[index]
            if index in seen:
                continue
            seen.add(index)
            if unit.gathered:  # already ahead (prefetched earlier, or kept): it uses the budget too
                budget -= unit.numel
                if budget <= 0:
                    break
                continue
            if live + unit.numel > self.max_live_numel or (budget < self.bucket_numel and unit.numel > budget):
                break
            unit.gather(async_op=True)
            self._prefetched_at[index] = self.agreement.announced
            live += unit.numel
            budget -= unit.numel
            if budget <= 0:
                break

    def note_peak(self) -> None:
        live = sum(g.full.untyped_storage().nbytes() for u in self.units for g in u.groups)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)
        copies = sum(g.secondary.nbytes for u in self.units for g in u.groups if g.secondary is not None)
        self.peak_secondary_bytes = max(self.peak_secondary_bytes, copies)  # hpZ


#: Containers that are never called, so their forward hooks never run: never units.
_NOT_CALLED = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def plan_units(model: nn.Module, min_unit_params: int, unit_classes: tuple[type, ...] = ()
               ) -> tuple[list[tuple[str, nn.Module]], dict[int, int]]:
    """Choose the units: returns ``[(name, module)]`` with the root first, and a map from
    parameter id to unit index.

    With ``unit_classes``, every module of those classes is a unit (like FSDP's wrap
    policy), whatever its size. A module marked a leaf (``zerodp.utils.set_z3_leaf_modules``),
    and a module compiled on its own (``block.compile()``, or ``torch.compile(block)`` put in
    the model's place: its compiled region, see :func:`compiled_regions`), is a unit with its whole
    subtree, and nothing inside it is. Otherwise, walking children
    before parents, a module becomes a unit when the parameters of its subtree not yet claimed
    by a unit below it number at least ``min_unit_params`` elements. Containers that are never
    called (``ModuleList``, ``ModuleDict``) are never units. Parameters registered in more
    than one module stay with the root.
    """
    holders: dict[int, int] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    shared = {pid for pid, n in holders.items() if n > 1}
    regions = compiled_regions(model)
    whole = [m for m in model.modules() if is_leaf(m) or id(m) in regions]
    inside_leaf = {id(m) for leaf in whole for m in leaf.modules() if m is not leaf}
    owner: dict[int, int] = {}
    units: list[tuple[str, nn.Module]] = [("", model)]
    for name, mod in reversed(list(model.named_modules())):
        if mod is model or isinstance(mod, _NOT_CALLED) or id(mod) in inside_leaf:
            continue
        mine = [p for p in mod.parameters() if id(p) not in owner and id(p) not in shared]
        wanted = is_leaf(mod) or id(mod) in regions or (isinstance(mod, unit_classes) if unit_classes else
                                  sum(full_shape(p).numel() for p in mine) >= min_unit_params)
        if mine and wanted:
            units.append((name, mod))
            for p in mine:
                owner[id(p)] = len(units) - 1
    for p in model.parameters():
        owner.setdefault(id(p), 0)
    # number units in registration (pre-)order, root first
    position = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    order = sorted(range(len(units)), key=lambda u: position[id(units[u][1])])
    renumber = {old: new for new, old in enumerate(order)}
    return [units[u] for u in order], {pid: renumber[u] for pid, u in owner.items()}


def compiled_regions(model: nn.Module) -> set[int]:
    """Ids of the modules under ``model`` (not ``model`` itself) that run compiled on their own: one
    compiled in place (``module.compile()``: its call, hooks included, runs compiled) and the
    module inside a ``torch.compile`` wrapper (the wrapper's own hooks never run; the module's run
    inside the compiled call). Each is planned as one unit, so that its gather and release come at
    the compiled region's edges and no graph breaks inside it."""
    out: set[int] = set()
    for mod in model.modules():
        inner = getattr(mod, "_orig_mod", None)
        if isinstance(inner, nn.Module) and type(mod).__name__ == "OptimizedModule":
            out.add(id(inner))
        elif getattr(mod, "_compiled_call_impl", None) is not None:
            out.add(id(mod))
    out.discard(id(model))
    return out


def runs_compiled(model: nn.Module) -> bool:
    """Whether any of ``model`` runs compiled: a ``torch.compile`` wrapper, compiled in place, or a
    module under it compiled on its own (:func:`compiled_regions`)."""
    return (hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None
            or bool(compiled_regions(model)))


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)
    elif hasattr(obj, "__dataclass_fields__"):
        for f in obj.__dataclass_fields__:
            yield from tensors_in(getattr(obj, f, None))


class AfterUnitBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs when backward has gone through the
    unit, i.e. once every gradient of the unit's parameters exists (accumulating parameter
    gradients run first: autograd gives them priority)."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(map_tensors(x, fn) for x in obj)
    if isinstance(obj, list):
        return [map_tensors(x, fn) for x in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def initialize_meta_units(units: list[Unit], seed: int, device: torch.device,
                          param_init_fn: Optional[Callable[[nn.Module], None]],
                          prefetcher: Optional["Prefetcher"] = None,
                          after_group: Optional[Callable[[Any], None]] = None,
                          loaded: Optional[dict[int, nn.Parameter]] = None,
                          after_unit: Optional[Callable[[nn.Module, set], None]] = None) -> None:
    """Give a model built on the meta device its values, one unit at a time, so that no rank
    ever holds more than one unit's full parameters: materialize the unit, run
    ``reset_parameters()`` (then ``param_init_fn``, if given) of each module that owns
    parameters in it, seeded by (seed, unit) so every rank computes the same values, keep
    this rank's shard and free the rest (and pass each group to ``after_group``: parameter
    offload moves the shard off the device there). A parameter built inside ``zero.Init``
    (``loaded``: the parameter built there, by the id of the one that replaced it) takes its values from the slices
    instead, and a module all of whose parameters do is not initialized. ``after_unit(module, ids)``
    runs after the unit's modules, under the same seed, with the ids of the parameters given values
    (PEFT's adapter initialization, ``core/adapters.py``)."""
    loaded = {} if loaded is None else loaded
    devices = [device] if device.type == "cuda" else []
    for unit in units:
        groups = [g for g in unit.groups if g.replaced]
        if not groups:
            continue
        mine = {id(p) for g in groups for p in g.params}
        for g in groups:
            g.materialize()
        if prefetcher is not None:
            prefetcher.note_peak()  # measured: what is allocated now
        modules = [m for m in unit.module.modules()
                   if any(id(p) in mine and id(p) not in loaded for p in m.parameters(recurse=False))]
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed + unit.index)
            for m in modules:
                if not hasattr(m, "reset_parameters") and param_init_fn is None:
                    raise ValueError(
                        f"{type(m).__name__} has parameters on the meta device but no "
                        "reset_parameters(); give it one or pass param_init_fn= to initialize")
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
                if param_init_fn is not None:
                    param_init_fn(m)
            if after_unit is not None:
                after_unit(unit.module, mine - set(loaded))
            for g in groups:
                for p in g.params:
                    if id(p) in loaded:
                        built = loaded.pop(id(p))
                        p.copy_(full_values(init_shard(built)))
                        adopted(built)  # its slice is freed now, unit by unit
        for g in groups:
            g.keep_own_shard()
            if after_group is not None:
                after_group(g)

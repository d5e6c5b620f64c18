"""Stage 3: a parameter read outside its unit's forward is gathered when it is read, as DeepSpeed
gathers it (its ``ZeROOrderedDict``).

``nn.MultiheadAttention`` reads ``self.out_proj.weight`` without ever calling ``out_proj``; a tied
output head reads the embedding's weight; torchvision's ViT and many custom attention layers read a
child's parameters the same way. No hook of the owner's unit runs for such a read, so the parameter
would be empty (released). Each module holding parameters of a unit gets a parameter dict that
notices reads (``module.weight`` is ``module._parameters["weight"]``). During a forward of the model,
reading a parameter whose unit is not gathered gathers the unit at once and registers the parameter
as external to the module whose forward is running (``register_external_parameter``): that module's
hooks then keep the unit gathered through its forward, this one and every later one, and gather it
again when backward reaches its outputs. Outside a forward a read is left alone: the parameter is
empty, as DeepSpeed leaves it (peft, the Trainer and Lightning tell a partitioned parameter by
``numel() == 0``). Iterating (``named_parameters()``, ``state_dict()``) is not a read.

Which module's forward is running comes from a stack kept by a pre-hook and an always-called hook on
every module of the model. When a forward raises, the stack also says in which module, so that the
engine's error names that module and the parameters under it that were not gathered (a parameter
reached another way than through its module's attribute, a list holding it, say, is not noticed).
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from .gather import Unit
from .param_api import external_users, register_external_parameter

if TYPE_CHECKING:
    from .gather import Prefetcher


class _ReadNoticingParameters(dict):
    """A module's ``_parameters`` whose item reads tell the :class:`ReadWatch`. A copy of it (a
    deep copy of the module, a pickle) is a plain dict: a copied module is not the engine's."""

    __slots__ = ("watch",)

    def __getitem__(self, name: str):
        p = dict.__getitem__(self, name)
        if p is not None and self.watch.stack and not torch.compiler.is_compiling():
            self.watch.read(p)
        return p

    def __reduce__(self):
        return (dict, (dict(self),))


class ReadWatch:
    """Notices reads of parameters outside their unit's forward (see module docstring); one per
    stage-3 engine, made by ``ShardedParams``."""

    def __init__(self, model: nn.Module, units: list[Unit], prefetcher: "Prefetcher",
                 install_external: Callable[[nn.Module, list[Unit]], list]) -> None:
        self.prefetcher = prefetcher
        self.install_external = install_external  # ShardedParams.install_external
        self.stack: list[nn.Module] = []  # the modules whose forward is running, innermost last
        self.raised_in: Optional[nn.Module] = None  # the innermost module a forward raised in
        self.unit_of = {id(p): u for u in units[1:] for g in u.groups for p in g.params}
        self.names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.param_names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        self._registered: set[tuple[int, int]] = set()  # (reading module, unit) with hooks installed
        self._watched: list[nn.Module] = []
        self.hooks: list = []
        for module in model.modules():
            self.hooks += [module.register_forward_pre_hook(self._entered),
                           module.register_forward_hook(self._left, always_call=True)]
            if any(p is not None and id(p) in self.unit_of for p in module._parameters.values()):
                watched = _ReadNoticingParameters(module._parameters)
                watched.watch = self
                module._parameters = watched
                self._watched.append(module)

    def forward_begins(self) -> None:
        """A call of the model begins: forget modules left on the stack by a forward that a compiled
        graph ended (their hooks ran as Python on the way in and inside the graph on the way out)."""
        self.stack.clear()
        self.raised_in = None

    def _entered(self, module: nn.Module, args) -> None:
        if torch.compiler.is_compiling():  # inside a compiled graph nothing is gathered on a read
            return
        if not self.stack:
            self.raised_in = None
        self.stack.append(module)

    def _left(self, module: nn.Module, args, output) -> None:
        if torch.compiler.is_compiling():
            return
        if self.stack and self.stack[-1] is module:
            self.stack.pop()
        if output is None and self.raised_in is None and sys.exc_info()[0] is not None:
            self.raised_in = module  # hooks run innermost first as the error unwinds

    def read(self, p: nn.Parameter) -> None:
        """``p`` was read during a forward: if its unit is not gathered (or its gather is still in
        flight), gather it now and register ``p`` as external to the module whose forward runs."""
        unit = self.unit_of.get(id(p))
        if unit is None or (unit.gathered and not any(g.gather_in_flight for g in unit.groups)):
            return
        reader = self.stack[-1]
        register_external_parameter(reader, p)
        key = (id(reader), unit.index)
        if key not in self._registered:  # its hooks run from this forward's end on
            self._registered.add(key)
            self.hooks += self.install_external(reader, [unit])
            unit.pin()  # as their pre-hook would have; their post-hook, at this forward's end, unpins
        self.prefetcher.gather_now(unit)

    def not_gathered_under(self, module: nn.Module) -> list[str]:
        """Names of the parameters under ``module`` (its own and its children's, and those registered
        as external to any of them) whose unit is not gathered now."""
        params = list(module.parameters()) + [p for _, ps in external_users(module) for p in ps]
        out: dict[int, str] = {}
        for p in params:
            unit = self.unit_of.get(id(p))
            if unit is not None and not unit.gathered:
                out.setdefault(id(p), self.param_names.get(id(p), "?"))
        return list(out.values())

    def explain(self) -> Optional[str]:
        """After a forward raised: the module it raised in and the parameters under it that were not
        gathered, with what to do; None when the forward did not raise in a module, or when every
        parameter there was gathered (the error is then not about released parameters)."""
        module = self.raised_in
        if module is None:
            return None
        missing = self.not_gathered_under(module)
        if not missing:
            return None
        name = self.names.get(id(module)) or "the model"
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        return (f"stage 3: the forward of {name} (a {type(module).__name__}) raised while these parameters under it "
                f"were not gathered (their data is then empty, as under DeepSpeed): {shown}. A parameter is gathered "
                "when its module runs, or when a forward reads it as its module's attribute (module.weight); one "
                "reached another way (kept in a list or a closure, say) is not. Read it as an attribute inside the "
                "forward, declare the use with zerodp.register_external_parameter(reading_module, parameter), or "
                "raise stage3_param_persistence_threshold so that its owner is not a unit of its own.")

    def remove(self) -> None:
        """Remove the hooks and give the modules plain parameter dicts again."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for module in self._watched:
            module._parameters = dict(module._parameters)
        self._watched = []


_EMPTY_OPERAND = re.compile(r"(size|shape|dimension|storage|allocated).*(?<![\d.])0(?![\d.])", re.I | re.S)
# what torch says of an operand it cannot take (an empty parameter among them): "mat2 must be a
# matrix, got 1-D tensor", "The size of tensor a (0) must match ...", "shape '[4, 6]' is invalid ..."
_ABOUT_SHAPES = re.compile(r"size|shape|dimension|matri|tensor|element|numel|empty|\b\d-?D\b", re.I)
_RETYPED = (RuntimeError, ValueError, TypeError, IndexError)  # rebuilt with the explanation; others pass


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _raised_here(e: BaseException) -> bool:
    """Whether ``e`` was raised by zerodp's own code (its innermost frame is in the package)."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE + os.sep)


@contextlib.contextmanager
def released_parameters_named(watch: Optional[ReadWatch]):
    """Around a stage-3 forward or backward (``watch``: the engine's :class:`ReadWatch`): an error
    raised in a module's forward while parameters under it were not gathered is raised again with
    their names and the module's when torch's message is about an operand it could not take, whatever
    it says of it (``ReadWatch.explain``); an error in backward whose message tells of an empty
    operand, with the likely cause. zerodp's own errors and others' (a ``ValueError`` a forward raises
    of its own) pass unchanged."""
    if watch is not None:
        watch.raised_in = None
    try:
        yield
    except _RETYPED as e:
        if _raised_here(e):  # zerodp's own errors (the ranks' agreement, say) say what they mean
            raise
        about_shapes = _ABOUT_SHAPES.search(str(e)) is not None  # an error of a user's own stays as it is
        note = watch.explain() if watch is not None and about_shapes else None
        if note is None and watch is not None and isinstance(e, RuntimeError) and _EMPTY_OPERAND.search(str(e)):
            note = ("stage 3: if an operand above is empty (size 0), a parameter was used while its unit was not "
                    "gathered (its data is then empty, as under DeepSpeed), reached another way than as its "
                    "module's attribute in a forward (kept in a list or a closure, say). Declare the use with "
                    "zerodp.register_external_parameter(reading_module, parameter), make the reading module a unit "
                    "that encloses the owner (initialize(unit_classes=...)), or raise "
                    "stage3_param_persistence_threshold so the owner is not a unit of its own.")
        if note is None:
            raise
        raise type(e)(f"{e}\n\n{note}") from e

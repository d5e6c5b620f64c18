"""Stage-3 leaf modules: a module gathered and reduced whole, as one unit, with no unit inside it.

A mixture-of-experts block routes each token to a few experts, so ranks run different experts
in the same step. Were each expert a unit of its own, a rank would skip the all-gathers of the
experts it did not use while its peers issue them, and the ranks would wait on each other forever
(the unit agreement, ``agree.py``, stops that with an error instead). Marked a *leaf*, the block
is one unit: every rank gathers all its experts when the block runs, and every rank reduces all
their gradients after its backward (zero for an expert this rank's tokens did not reach), so
every rank issues the same collectives whatever the routing.

Leaves are declared as DeepSpeed declares them (the module's ``_z3_leaf`` flag):

* ``zerodp.utils.set_z3_leaf_modules(model, classes)``, ``set_z3_leaf_modules_by_name`` and
  ``set_z3_leaf_modules_by_suffix``, before ``initialize``;
* the config's ``zero_optimization.leaf_module`` block (``classes``, ``names``,
  ``name_suffixes``), whose ``classes`` default to the sparse MoE blocks of transformers' Mixtral,
  Qwen2-MoE and Qwen3-MoE, as DeepSpeed applies them without being asked;
* ``zero_optimization.stage3_module_granularity_threshold``: every module whose parameters per
  layer (its parameters over the modules with parameters in it, itself included) are at most
  this many becomes a leaf, parents before children (DeepSpeed's automatic leaves by size).

``initialize`` applies the config (:func:`apply_leaf_config`) and then plans the units
(``gather.plan_units``), in which a leaf is a unit with its whole subtree; each parameter of a
leaf then carries ``ds_z3_leaf_module`` (:func:`z3_leaf_parameter`).
"""
from __future__ import annotations

import logging
import sys
from typing import Iterable, Optional

from torch import nn

from ..config.schema import DEFAULT_LEAF_CLASSES
from .init_shards import full_shape

logger = logging.getLogger("zerodp")

#: DeepSpeed's attribute for a module that ZeRO-3 treats as a leaf.
LEAF_ATTR = "_z3_leaf"
#: DeepSpeed's attribute of a parameter that belongs to a leaf module (set by ``initialize``).
LEAF_PARAM_ATTR = "ds_z3_leaf_module"
_LARGEST_LEAF = 10**9  # a module with more parameters never becomes a leaf by size (it would all be live at once)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)


def is_leaf(module: nn.Module) -> bool:
    """Whether ``module`` is marked a stage-3 leaf: one unit, its whole subtree, no unit inside."""
    return bool(getattr(module, LEAF_ATTR, False))


def set_leaf(module: nn.Module, flag: bool) -> None:
    setattr(module, LEAF_ATTR, flag)


def _class_names(module: nn.Module) -> tuple[str, str]:
    cls = type(module)
    return cls.__name__, f"{cls.__module__}.{cls.__qualname__}"


def mark_by_class(model: nn.Module, classes: Iterable, flag: bool = True) -> list[nn.Module]:
    """Flag every module of ``model`` that is an instance of one of ``classes`` (types), or whose
    class name or fully qualified class name is one of them (strings). Returns those modules."""
    classes = list(classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf module classes must be classes or class names, got {bad!r}")
    types = tuple(c for c in classes if isinstance(c, type))
    names = {c for c in classes if isinstance(c, str)}
    marked = []
    for m in model.modules():
        if isinstance(m, types) or names.intersection(_class_names(m)):
            set_leaf(m, flag)
            marked.append(m)
    return marked


def mark_by_name(model: nn.Module, names: Iterable[str], flag: bool = True,
                 suffix: bool = False) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules named ``names`` in ``model.named_modules()`` (with ``suffix``: every module
    whose name ends with one of them). Returns the modules flagged and the names that matched none."""
    modules = dict(model.named_modules())
    marked: dict[int, nn.Module] = {}
    missing = []
    for wanted in names:
        found = [m for n, m in modules.items() if n.endswith(wanted)] if suffix else \
            [modules[wanted]] if wanted in modules else []
        for m in found:
            set_leaf(m, flag)
            marked.setdefault(id(m), m)
        if not found:
            missing.append(wanted)
    return list(marked.values()), missing


def mark_by_granularity(model: nn.Module, threshold: int) -> list[nn.Module]:
    """DeepSpeed's ``stage3_module_granularity_threshold``: a module's granularity is its parameter
    count over its layers (the modules with parameters and no children inside it, plus itself and
    every module between, containers excluded); walking from the root, a module at or under
    ``threshold`` becomes a leaf and its children are not visited. Modules without children,
    containers and modules over 1e9 parameters are never leaves by size."""
    granularity: dict[int, float] = {}

    def measure(m: nn.Module) -> tuple[int, int]:  # (layers, parameters) of m's subtree
        granularity[id(m)] = sys.maxsize
        if not any(True for _ in m.parameters()):
            return 0, 0
        own = sum(full_shape(p).numel() for p in m.parameters(recurse=False))
        children = list(m.children())
        if not children:
            return 1, own
        layers, params = 0, own
        for c in children:
            cl, cp = measure(c)
            layers, params = layers + cl, params + cp
        if isinstance(m, _CONTAINERS):
            return layers, params
        layers += 1
        granularity[id(m)] = params // layers if params <= _LARGEST_LEAF else sys.maxsize
        return layers, params

    measure(model)
    marked = []

    def walk(m: nn.Module) -> None:
        if not any(True for _ in m.parameters()):
            return
        if granularity[id(m)] <= threshold:
            set_leaf(m, True)
            marked.append(m)
            return
        for c in m.children():
            walk(c)

    walk(model)
    if not marked:
        finest = min(granularity.values())
        logger.warning("zero_optimization.stage3_module_granularity_threshold %d makes no module a leaf; the "
                       "finest module has %s parameters per layer", threshold,
                       "no" if finest == sys.maxsize else finest)
    return marked


def apply_leaf_config(model: nn.Module, leaf_module: Optional[object], granularity_threshold: int = 0
                      ) -> list[nn.Module]:
    """Flag the leaves the config declares (``zero_optimization.leaf_module`` and
    ``stage3_module_granularity_threshold``), as DeepSpeed's ``initialize`` does: classes, names and
    suffixes that match nothing are not an error (the defaults name transformers' MoE blocks, which
    most models lack); entries the user wrote that match nothing are warned about."""
    marked: dict[int, nn.Module] = {}
    if leaf_module is not None:
        for m in mark_by_class(model, leaf_module.classes):
            marked.setdefault(id(m), m)
        custom_classes = tuple(leaf_module.classes) != DEFAULT_LEAF_CLASSES
        for key, suffix in (("names", False), ("name_suffixes", True)):
            found, missing = mark_by_name(model, getattr(leaf_module, key), suffix=suffix)
            for m in found:
                marked.setdefault(id(m), m)
            if missing:
                logger.warning("zero_optimization.leaf_module.%s: no module %s %s", key,
                               "name ends with" if suffix else "is named", ", ".join(missing))
        if custom_classes and leaf_module.classes and not any(
                set(_class_names(m)) & set(leaf_module.classes) for m in marked.values()):
            logger.warning("zero_optimization.leaf_module.classes: no module of %s in the model",
                           ", ".join(leaf_module.classes))
    if granularity_threshold > 0:
        for m in mark_by_granularity(model, granularity_threshold):
            marked.setdefault(id(m), m)
    return list(marked.values())


def mark_leaf_parameters(model: nn.Module) -> None:
    """Give each parameter of a leaf module DeepSpeed's ``ds_z3_leaf_module`` (the leaf)."""
    for leaf in model.modules():
        if is_leaf(leaf):
            for p in leaf.parameters():
                setattr(p, LEAF_PARAM_ATTR, leaf)


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """Whether ``param`` belongs to a leaf module (DeepSpeed's name)."""
    return hasattr(param, LEAF_PARAM_ATTR)


def enclosing_leaf_candidate(model: nn.Module, names: list[str]) -> Optional[tuple[str, str]]:
    """For the units ``names`` that ranks disagreed on: the module that likely chose which of them
    run, i.e. the nearest module above one of them that holds it through a list of modules
    (``ModuleList``/``ModuleDict``, as an MoE block holds its experts), and that module's class
    name; made a leaf it is gathered whole on every rank. None when that is the model itself."""
    modules = dict(model.named_modules())
    for name in sorted((n for n in names if n), key=lambda n: -n.count(".")):  # deepest first
        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):
            holder, listed = ".".join(parts[:k - 1]), modules.get(".".join(parts[:k]))
            if k > 1 and isinstance(listed, _CONTAINERS) and not isinstance(modules.get(holder), _CONTAINERS):
                return holder, type(modules[holder]).__name__
    return None

"""DeepSpeed's ``deepspeed.utils`` names that zerodp provides (thin faces over zerodp's own code)."""
from __future__ import annotations

from typing import Iterable

from torch import nn

from ..checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint
from ..core.leaves import is_leaf, mark_by_class, mark_by_name, set_leaf, z3_leaf_parameter
from . import logging  # noqa: F401 (DeepSpeed's deepspeed.utils.logging, read as an attribute)
from .logging import logger  # DeepSpeed's deepspeed.utils.logger: zerodp's own logger
from .tensor_fragment import *  # noqa: F403  (a parameter's gradient, master and optimizer state)
from .tensor_fragment import __all__ as _PARAM_ACCESS

__all__ = ["logger", "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "z3_leaf_parameter",
           *_PARAM_ACCESS]


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Iterable,
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark every module of ``model`` of these classes (classes, or class names, plain or fully
    qualified) a stage-3 leaf: it is gathered and reduced as one unit with its whole subtree, and no
    hooks run inside it (for modules whose forward does not call every child, such as
    mixture-of-experts blocks, whose ranks run different experts). Call it before
    ``zerodp.initialize``. Returns the modules marked; none is an error unless
    ``raise_if_not_found=False``."""
    return _checked(mark_by_class(model, leaf_module_classes, True), leaf_module_classes, model, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Iterable,
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    return _checked(mark_by_class(model, leaf_module_classes, False), leaf_module_classes, model, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: Iterable[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules with these names (as ``model.named_modules()`` gives them) leaves (or not,
    with ``flag=False``). Returns the modules and the names that matched none (an error unless
    ``raise_if_not_found=False``)."""
    return _named(mark_by_name(model, list(module_names), flag), "named", raise_if_not_found)


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: Iterable[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark every module whose name ends with one of these suffixes (``"mlp"`` marks every block's
    ``...mlp``). Returns the modules and the suffixes that matched none."""
    return _named(mark_by_name(model, list(module_name_suffixes), flag, suffix=True), "matching suffixes",
                  raise_if_not_found)


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    set_leaf(model, flag)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_leaf(m)]


def z3_leaf_module(model: nn.Module) -> bool:
    return is_leaf(model)


def _checked(marked: list[nn.Module], classes: Iterable, model: nn.Module, raise_if_not_found: bool) -> list:
    if not marked and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules: no module of {[getattr(c, '__name__', c) for c in classes]} "
                         f"in {type(model).__name__}")
    return marked


def _named(found: tuple[list[nn.Module], list[str]], how: str, raise_if_not_found: bool) -> tuple:
    if found[1] and raise_if_not_found:
        raise ValueError(f"no modules {how} {found[1]} in the model")
    return found

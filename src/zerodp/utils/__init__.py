"""DeepSpeed's ``deepspeed.utils`` names that zerodp provides (thin faces over zerodp's own code)."""
from __future__ import annotations

import logging
from typing import Iterable

from torch import nn

from ..checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint
from ..core.gather import LEAF_ATTR, is_leaf

#: DeepSpeed's ``deepspeed.utils.logger``: zerodp's own logger
logger = logging.getLogger("zerodp")

__all__ = ["logger", "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module"]


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Iterable) -> list[nn.Module]:
    """Mark every module of ``model`` of these classes (classes, or class names) a stage-3 leaf:
    it is gathered and released as one unit with its whole subtree, and no hooks run inside it
    (for modules whose forward does not call every child, such as mixture-of-experts blocks).
    Call it before ``zerodp.initialize``. Returns the modules marked."""
    return _mark(model, leaf_module_classes, True)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Iterable) -> list[nn.Module]:
    return _mark(model, leaf_module_classes, False)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_leaf(m)]


def z3_leaf_module(model: nn.Module) -> bool:
    return is_leaf(model)


def _mark(model: nn.Module, classes: Iterable, flag: bool) -> list[nn.Module]:
    classes = list(classes)
    names = {c for c in classes if isinstance(c, str)}
    types = tuple(c for c in classes if isinstance(c, type))
    marked = []
    for m in model.modules():
        if isinstance(m, types) or type(m).__name__ in names:
            setattr(m, LEAF_ATTR, flag)
            marked.append(m)
    if not marked:
        raise ValueError(f"set_z3_leaf_modules: no module of {[getattr(c, '__name__', c) for c in classes]} "
                         f"in {type(model).__name__}")
    return marked

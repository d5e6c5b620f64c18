"""``deepspeed.moe.utils``: which parameters are experts' and the optimizer param groups for them."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..parallel.expert import is_moe_param, split_moe_param_groups
from ..parallel.expert_capacity import MoE

__all__ = ["has_moe_layers", "is_moe_param", "is_moe_param_group", "configure_moe_param_groups",
           "split_params_into_shared_and_expert_params", "split_params_grads_into_shared_and_expert_params",
           "split_params_into_different_moe_groups_for_optimizer"]

split_params_into_different_moe_groups_for_optimizer = split_moe_param_groups


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """Whether ``model`` has a :class:`MoE` layer, and the first one's number of experts (0 if none)."""
    first = next((m for m in model.modules() if isinstance(m, MoE)), None)
    return first is not None, first.num_experts if first is not None else 0


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    """``(dense parameters, expert parameters)`` of ``params``."""
    params = list(params)
    return [p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(group) -> tuple[list, list]:
    """The gradients (in their parameters' dtypes) of ``group``'s dense and expert parameters."""
    dense, expert = split_params_into_shared_and_expert_params(p for p in group if p.grad is not None)
    return [p.grad.to(p.dtype) for p in dense], [p.grad.to(p.dtype) for p in expert]


def configure_moe_param_groups(model_parameters: list) -> Any:
    """Param groups with the expert parameters apart: a list of parameters becomes one dense group
    (``"dense-params"``) and its expert groups; a list of groups is split unless it already has
    ``moe`` groups."""
    if not isinstance(model_parameters, list):
        raise TypeError("configure_moe_param_groups: model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an iterable of Tensors "
                            f"or dicts, but got {type(p)}")
    if model_parameters and isinstance(model_parameters[0], torch.Tensor):
        return split_moe_param_groups({"params": model_parameters, "name": "dense-params"})
    if any("moe" in g for g in model_parameters):
        return model_parameters
    return split_moe_param_groups(model_parameters)

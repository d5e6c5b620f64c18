"""DeepSpeed's Adam classes, as the best Adam torch has for each device.

``FusedAdam`` and ``DeepSpeedCPUAdam`` take DeepSpeed's arguments and build torch's ``AdamW``
(``adam_w_mode=True``, the default) or ``Adam`` with ``fused=True`` (one kernel per step over
all tensors, on CUDA and, since torch 2.4, on the CPU); the update is torch's, so results equal
``torch.optim.AdamW``'s. ``bias_correction=False`` is refused (torch always corrects).
"""
from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]


def _fused_ok(params: list) -> bool:
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    return all(isinstance(p, torch.Tensor) and p.is_floating_point() and p.device.type in ("cpu", "cuda")
               for p in tensors)


class _DeepSpeedAdamMixin:
    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                 **_deepspeed_only) -> None:
        if not bias_correction:
            raise ValueError("bias_correction=False is not supported: torch's Adam always corrects the bias")
        params = list(params)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, fused=_fused_ok(params) or None)


class _FusedAdamW(_DeepSpeedAdamMixin, torch.optim.AdamW):
    """DeepSpeed's FusedAdam with ``adam_w_mode=True``: torch's fused AdamW."""


class _FusedAdamL2(_DeepSpeedAdamMixin, torch.optim.Adam):
    """DeepSpeed's FusedAdam with ``adam_w_mode=False``: torch's fused Adam (L2 weight decay)."""


def FusedAdam(params: Iterable, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),  # noqa: N802
              eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
              set_grad_none: bool = True) -> torch.optim.Optimizer:
    """DeepSpeed's ``FusedAdam`` (its signature): torch's fused AdamW, or Adam without ``adam_w_mode``."""
    cls = _FusedAdamW if adam_w_mode else _FusedAdamL2
    return cls(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
               weight_decay=weight_decay, amsgrad=amsgrad)


def DeepSpeedCPUAdam(model_params: Iterable, lr: float = 1e-3, bias_correction: bool = True,  # noqa: N802
                     betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                     adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> torch.optim.Optimizer:
    """DeepSpeed's ``DeepSpeedCPUAdam`` (its signature): torch's fused AdamW (or Adam)."""
    return FusedAdam(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                     adam_w_mode=adamw_mode, weight_decay=weight_decay, amsgrad=amsgrad)

"""DeepSpeed's ``deepspeed.ops.lion``: ``DeepSpeedCPULion`` and ``FusedLion`` with DeepSpeed's
signatures, as zerodp's :class:`~zerodp.optim.lion.Lion` (decoupled weight decay, as DeepSpeed's)."""
from __future__ import annotations

from typing import Iterable

from ..optim.lion import Lion

__all__ = ["Lion", "DeepSpeedCPULion", "FusedLion"]


class DeepSpeedCPULion(Lion):
    """DeepSpeed's signature (``fp32_optimizer_states`` accepted)."""

    def __init__(self, model_params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


class FusedLion(Lion):
    """DeepSpeed's signature (``set_grad_none`` accepted)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)

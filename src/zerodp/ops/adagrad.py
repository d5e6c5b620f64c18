"""DeepSpeed's ``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` as torch's Adagrad (Accelerate
builds it in place of a ``torch.optim.Adagrad`` when the optimizer is offloaded to the CPU).
The update is torch's, so results equal ``torch.optim.Adagrad``'s."""
from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's signature over torch's Adagrad (``amsgrad`` and ``fp32_optimizer_states`` are
    accepted: the states are in the parameters' dtype, fp32 masters under zerodp's 16-bit modes)."""

    def __init__(self, model_params: Iterable, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)

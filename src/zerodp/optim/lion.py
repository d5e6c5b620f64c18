"""Lion (torch has none): the sign of an interpolated momentum (Chen et al., 2023, "Symbolic
Discovery of Optimization Algorithms"), elementwise, so it runs on zerodp's flat shards unchanged.

Per step, with gradient g, momentum m, learning rate lr, betas (b1, b2), weight decay wd:
``p -= lr * wd * p``; ``p -= lr * sign(b1 * m + (1 - b1) * g)``; ``m = b2 * m + (1 - b2) * g``.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """The Lion optimizer (decoupled weight decay, as DeepSpeed's)."""

    def __init__(self, params: Iterable, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0) -> None:
        if lr < 0 or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0:
            raise ValueError(f"Lion: lr={lr}, betas={tuple(betas)}, weight_decay={weight_decay}; "
                             "allowed: lr >= 0, 0 <= beta < 1, weight_decay >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(torch.lerp(p.grad, m, b1).sign_(), alpha=-lr)  # lerp(g, m, b1) = b1 * m + (1 - b1) * g
                m.lerp_(p.grad, 1 - b2)                               # b2 * m + (1 - b2) * g
        return loss

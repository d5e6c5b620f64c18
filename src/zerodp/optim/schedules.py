"""DeepSpeed-compatible learning-rate schedules.

Implements ``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR`` with the
parameter names, defaults and formulas of DeepSpeed's ``"scheduler"`` config
block, as subclasses of :class:`torch.optim.lr_scheduler.LRScheduler` (so
``step()``, ``get_last_lr()``, ``state_dict()`` and ``load_state_dict()``
behave like any torch scheduler).

Step semantics
--------------
DeepSpeed schedules are indexed by ``last_batch_iteration``, which starts at
``-1``.  Constructing a schedule writes the lr for iteration ``-1`` into the
optimizer (``warmup_min_lr`` for WarmupLR/WarmupDecayLR, ``0.0`` for
WarmupCosineLR), and every ``step()`` (called after each optimizer step)
advances the iteration by one.  So the first optimizer step runs with the
iteration ``-1`` lr, the second with the iteration ``0`` lr, and so on.

The torch base class counts differently: its constructor already performs
one step, leaving ``last_epoch == 0``.  The classes here therefore evaluate
the DeepSpeed formula at ``last_batch_iteration = last_epoch - 1``, which
yields exactly the lr sequence a DeepSpeed user observes.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "build_scheduler", "SUPPORTED_SCHEDULERS"]

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
_WARMUP_TYPES = (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE)


def _is_number(value: Any) -> bool:
    return isinstance(value, (numbers.Real, torch.Tensor)) and not isinstance(value, bool)


def _check_positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_warmup_type(value: Any) -> str:
    if value not in _WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {list(_WARMUP_TYPES)}, got {value!r}")
    return value


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list:
    """Broadcast a scalar to every param group, or validate a per-group list."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} values but the optimizer has {n} param groups")
        values = list(value)
    else:
        values = [value] * n
    for v in values:
        if not _is_number(v):
            raise ValueError(f"{name} must be a number or a list of numbers, got {value!r}")
    return values


def _current_lrs(optimizer: torch.optim.Optimizer) -> list:
    return [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in optimizer.param_groups]


class _DeepSpeedSchedule(LRScheduler):
    """Base class: maps torch's ``last_epoch`` onto DeepSpeed's iteration index."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, numbers.Integral):
            raise ValueError(f"last_batch_iteration must be an integer, got {last_batch_iteration!r}")
        if last_batch_iteration < -1:
            raise ValueError(f"last_batch_iteration must be >= -1, got {last_batch_iteration}")
        super().__init__(optimizer)
        if last_batch_iteration != -1:
            # Resume at the given iteration (DeepSpeed's last_batch_iteration argument).
            self.last_epoch = int(last_batch_iteration) + 1
            self._apply(self.get_lr())

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's iteration index: ``-1`` right after construction."""
        return self.last_epoch - 1

    def lr_at(self, iteration: int) -> list:
        """Learning rate of every param group at DeepSpeed iteration ``iteration``."""
        raise NotImplementedError

    def get_lr(self) -> list:
        return self.lr_at(self.last_epoch - 1)

    def step(self, last_batch_iteration: int | None = None) -> None:  # type: ignore[override]
        """Advance one iteration, or jump to ``last_batch_iteration`` when given."""
        if last_batch_iteration is not None:
            # The base class increments last_epoch before calling get_lr().
            self.last_epoch = int(last_batch_iteration)
        super().step()

    def _apply(self, lrs: Sequence) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(float(lr))
            else:
                group["lr"] = lr
        self._last_lr = _current_lrs(self.optimizer)

    def _warmup_gamma(self, iteration: int) -> float:
        """Warmup progress in [0, 1) for ``0 <= iteration < warmup_num_steps``."""
        if self.warmup_type == WARMUP_LOG_RATE:
            return (1.0 / math.log(self.warmup_num_steps)) * math.log(iteration + 1)
        return iteration / self.warmup_num_steps


class WarmupLR(_DeepSpeedSchedule):
    """Warm the lr of each param group from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    ``lr(i) = min_lr + (max_lr - min_lr) * gamma(i)`` with
    ``gamma(i) = log(i + 1) / log(W)`` (``"log"``) or ``i / W`` (``"linear"``)
    for ``0 <= i < W`` and ``gamma(i) = 1`` afterwards, where
    ``W = max(2, warmup_num_steps)``.  At ``i = -1`` (right after
    construction) the lr is ``min_lr``.

    Args:
        optimizer: the wrapped optimizer.
        warmup_min_lr: starting lr, a number or one per param group.
        warmup_max_lr: final lr, a number or one per param group; ``None``
            (default) uses each group's current lr.
        warmup_num_steps: number of warmup iterations.
        warmup_type: ``"log"`` (default) or ``"linear"``.
        last_batch_iteration: iteration to resume from; ``-1`` starts fresh.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _check_positive_int(warmup_num_steps, "warmup_num_steps")
        if warmup_max_lr is None:
            warmup_max_lr = _current_lrs(optimizer)
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup_gamma(iteration)
        return 1.0

    def lr_at(self, iteration: int) -> list:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


def _check_schedule_length(total_num_steps, warmup_num_steps) -> None:
    _check_positive_int(total_num_steps, "total_num_steps")
    _check_positive_int(warmup_num_steps, "warmup_num_steps")
    if total_num_steps < warmup_num_steps:
        raise ValueError(
            f"total_num_steps ({total_num_steps}) must be >= warmup_num_steps ({warmup_num_steps})"
        )


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR` warmup followed by a linear decay to 0 at ``total_num_steps``.

    After warmup, ``gamma(i) = max(0, (T - i) / max(1, T - W))`` with
    ``T = total_num_steps``.

    Args:
        optimizer: the wrapped optimizer.
        total_num_steps: iteration at which the lr reaches 0; must be at least
            ``warmup_num_steps``.
        warmup_min_lr: starting lr, a number or one per param group.
        warmup_max_lr: peak lr, a number or one per param group (default 0.001).
        warmup_num_steps: number of warmup iterations.
        warmup_type: ``"log"`` (default) or ``"linear"``.
        last_batch_iteration: iteration to resume from; ``-1`` starts fresh.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _check_schedule_length(total_num_steps, warmup_num_steps)
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup_gamma(iteration)
        remaining = float(self.total_num_steps - iteration)
        return max(0.0, remaining / float(max(1, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_DeepSpeedSchedule):
    """Warmup then cosine decay, expressed as ratios of each group's base lr.

    With ``W = max(2, warmup_num_steps)`` and ``T = total_num_steps``, the lr
    of a group whose lr at construction was ``base`` is ``base * ratio(i)``:

    * ``i < 0``: ``ratio = 0``;
    * ``0 <= i < W``: ``ratio = r0 + (1 - r0) * gamma(i)`` with
      ``r0 = warmup_min_ratio`` and ``gamma`` as in :class:`WarmupLR`;
    * ``i >= W``: ``p = min(1, (i - W + 1) / max(1, T - W))`` and
      ``ratio = max(0, c + (1 - c) * (1 + cos(pi * p)) / 2)`` with
      ``c = cos_min_ratio``.

    Args:
        optimizer: the wrapped optimizer.
        total_num_steps: total number of training iterations; must be at least
            ``warmup_num_steps``.
        warmup_min_ratio: lr ratio at the start of warmup.
        warmup_num_steps: number of warmup iterations.
        cos_min_ratio: lr ratio at the end of the cosine decay.
        warmup_type: ``"log"`` (default) or ``"linear"``.
        last_batch_iteration: iteration to resume from; ``-1`` starts fresh.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _check_schedule_length(total_num_steps, warmup_num_steps)
        for name, value in (("warmup_min_ratio", warmup_min_ratio), ("cos_min_ratio", cos_min_ratio)):
            if not _is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        self.org_lrs = _current_lrs(optimizer)
        super().__init__(optimizer, last_batch_iteration)

    def lr_ratio(self, iteration: int) -> float:
        """The multiplier applied to each group's base lr at ``iteration``."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            gamma = self._warmup_gamma(iteration)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        progress = (iteration - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, progress)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, iteration: int) -> list:
        ratio = self.lr_ratio(iteration)
        return [base * ratio for base in self.org_lrs]


_SCHEDULERS: dict[str, type[_DeepSpeedSchedule]] = {
    "warmuplr": WarmupLR,
    "warmupdecaylr": WarmupDecayLR,
    "warmupcosinelr": WarmupCosineLR,
}

#: DeepSpeed scheduler type names accepted by :func:`build_scheduler`.
SUPPORTED_SCHEDULERS: tuple[str, ...] = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")

_PARAM_NAMES: dict[type, tuple[str, ...]] = {
    WarmupLR: ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    WarmupDecayLR: (
        "total_num_steps",
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "last_batch_iteration",
    ),
    WarmupCosineLR: (
        "total_num_steps",
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
        "last_batch_iteration",
    ),
}


def build_scheduler(
    optimizer: torch.optim.Optimizer, type_name: str, params: dict[str, Any] | None
) -> LRScheduler:
    """Build a DeepSpeed-style lr schedule from a ``"scheduler"`` config block.

    Args:
        optimizer: the optimizer whose param groups are scheduled.
        type_name: ``"WarmupLR"``, ``"WarmupDecayLR"`` or ``"WarmupCosineLR"``
            (case-insensitive).
        params: the block's ``"params"`` dict, using DeepSpeed's names.

    Raises:
        ValueError: for an unknown type, unknown or missing parameters, or
            invalid values (the message names the parameter).
    """
    key = str(type_name).strip().lower() if type_name is not None else ""
    cls = _SCHEDULERS.get(key)
    if cls is None:
        raise ValueError(
            f"Unknown scheduler type {type_name!r}; supported types are: {', '.join(SUPPORTED_SCHEDULERS)}"
        )
    params = dict(params or {})
    allowed = _PARAM_NAMES[cls]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"Unknown parameter(s) {unknown} for scheduler {cls.__name__}; accepted: {list(allowed)}"
        )
    if "total_num_steps" in allowed and "total_num_steps" not in params:
        raise ValueError(f"Scheduler {cls.__name__} requires total_num_steps")
    return cls(optimizer, **params)

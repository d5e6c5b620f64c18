"""Optimizer and learning-rate schedule construction from DeepSpeed-style configs."""

from zerodp.optim.build import SUPPORTED_OPTIMIZERS, check_elementwise, optimizer_factory_from_config
from zerodp.optim.schedules import (
    SUPPORTED_SCHEDULERS,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = [
    "optimizer_factory_from_config",
    "check_elementwise",
    "build_scheduler",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_SCHEDULERS",
]

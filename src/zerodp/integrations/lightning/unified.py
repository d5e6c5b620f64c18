"""The strategies for ``lightning`` (``lightning.Trainer``, ``lightning.Fabric``)."""
from __future__ import annotations

from .common import convert_zero_checkpoint_to_fp32_state_dict, engine_metrics
from .fabric import make_fabric_strategy
from .flavors import UNIFIED
from .trainer import make_zero_strategy

UNIFIED.require()
ZeroStrategy = make_zero_strategy(UNIFIED)
ZeroFabricStrategy = make_fabric_strategy(UNIFIED)

__all__ = ["ZeroStrategy", "ZeroFabricStrategy", "convert_zero_checkpoint_to_fp32_state_dict", "engine_metrics"]

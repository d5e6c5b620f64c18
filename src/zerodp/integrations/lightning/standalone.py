"""The strategies for the standalone ``pytorch_lightning`` and ``lightning_fabric`` packages
(``pytorch_lightning.Trainer``, ``lightning_fabric.Fabric``)."""
from __future__ import annotations

from .common import convert_zero_checkpoint_to_fp32_state_dict, engine_metrics
from .fabric import make_fabric_strategy
from .flavors import STANDALONE
from .trainer import make_zero_strategy

STANDALONE.require()
ZeroStrategy = make_zero_strategy(STANDALONE)
ZeroFabricStrategy = make_fabric_strategy(STANDALONE)

__all__ = ["ZeroStrategy", "ZeroFabricStrategy", "convert_zero_checkpoint_to_fp32_state_dict", "engine_metrics"]

"""``from zerodp.lightning import ZeroStrategy, ZeroFabricStrategy``: zerodp's strategies for the
``lightning`` package's Trainer and Fabric, registered under ``zerodp_stage_*`` names on import
(the code lives in ``zerodp/integrations/lightning/``; docs/lightning.md). For the standalone
``pytorch_lightning`` package: ``zerodp.pytorch_lightning``."""
from .integrations.lightning.unified import (  # noqa: F401
    ZeroFabricStrategy,
    ZeroStrategy,
    convert_zero_checkpoint_to_fp32_state_dict,
    engine_metrics,
)

__all__ = ["ZeroStrategy", "ZeroFabricStrategy", "convert_zero_checkpoint_to_fp32_state_dict", "engine_metrics"]

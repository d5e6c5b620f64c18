"""``from zerodp.pytorch_lightning import ZeroStrategy, ZeroFabricStrategy``: zerodp's strategies
for the standalone ``pytorch_lightning`` Trainer and ``lightning_fabric`` Fabric (``import
pytorch_lightning as pl``), registered under ``zerodp_stage_*`` names in their registries on
import. The same code as ``zerodp.lightning`` (docs/lightning.md)."""
from .integrations.lightning.standalone import (  # noqa: F401
    ZeroFabricStrategy,
    ZeroStrategy,
    convert_zero_checkpoint_to_fp32_state_dict,
    engine_metrics,
)

__all__ = ["ZeroStrategy", "ZeroFabricStrategy", "convert_zero_checkpoint_to_fp32_state_dict", "engine_metrics"]

"""zerodp for Lightning: ``ZeroStrategy`` (``lightning.Trainer``) and ``ZeroFabricStrategy``
(``lightning.Fabric``), registered on import under DeepSpeed's strategy names with ``zerodp``
in place of ``deepspeed`` (``zerodp``, ``zerodp_stage_1``, ``zerodp_stage_2``,
``zerodp_stage_2_offload``, ``zerodp_stage_3``, ``zerodp_stage_3_offload``,
``zerodp_stage_3_offload_nvme``; Fabric also has ``zerodp_stage_1_offload``), and
:func:`convert_zero_checkpoint_to_fp32_state_dict` for one-file exports. Needs the
``lightning`` package (``pip install 'zerodp[lightning]'``). See docs/lightning.md."""
from __future__ import annotations

try:
    import lightning  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("zerodp.lightning needs Lightning: pip install 'zerodp[lightning]' "
                      "(or pip install lightning)") from e

from .common import convert_zero_checkpoint_to_fp32_state_dict, engine_metrics
from .fabric import ZeroFabricStrategy
from .trainer import ZeroStrategy

__all__ = ["ZeroStrategy", "ZeroFabricStrategy", "convert_zero_checkpoint_to_fp32_state_dict", "engine_metrics"]

"""DeepSpeed's mixture-of-experts names (``deepspeed.moe``): the layer, its gate and experts, and the
helpers for optimizer param groups. They are faces of ``zerodp.parallel.expert_capacity`` (the layer)
and ``zerodp.parallel.expert`` (groups and marks)."""
from . import experts, layer, sharded_moe, utils  # noqa: F401  (deepspeed.moe.layer.MoE without an import)
from .layer import MoE

__all__ = ["MoE", "experts", "layer", "sharded_moe", "utils"]

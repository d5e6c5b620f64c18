"""``deepspeed.moe.layer``: the mixture-of-experts layer."""
from ..parallel.expert_capacity import MoE

__all__ = ["MoE"]

"""``deepspeed.moe.experts``: a rank's copies of the expert module."""
from ..parallel.expert_capacity import Experts

__all__ = ["Experts"]

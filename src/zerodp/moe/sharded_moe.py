"""``deepspeed.moe.sharded_moe``: the gate and the layer that exchanges tokens with the experts."""
from ..parallel.expert_capacity import MOELayer, TopKGate

__all__ = ["MOELayer", "TopKGate"]

"""DeepSpeed's ``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is zerodp's engine."""
from ..engine import ZeroEngine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]

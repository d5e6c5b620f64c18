"""DeepSpeed's ``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is zerodp's engine."""
from ..core.engine import ZeroEngine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]

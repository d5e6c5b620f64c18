"""DeepSpeed's ``deepspeed.runtime.lr_schedules``: the learning-rate schedules by their names."""
from ..optim.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]

"""DeepSpeed's ``deepspeed.runtime.lr_schedules``: the learning-rate schedules by their names."""
from ..optim.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "VALID_LR_SCHEDULES"]

#: The schedule names a config's ``scheduler.type`` may give (DeepSpeed's ``LRRangeTest`` and
#: ``OneCycle`` are not implemented); Accelerate tests a scheduler's class name against it.
VALID_LR_SCHEDULES = [WarmupLR.__name__, WarmupDecayLR.__name__, WarmupCosineLR.__name__]

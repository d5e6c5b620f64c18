"""DeepSpeed's ``deepspeed.runtime.base_optimizer``: ``DeepSpeedOptimizer``, the base class of
DeepSpeed's ZeRO optimizers, which frameworks test optimizers against. zerodp hands out the
torch optimizer itself (its param groups re-pointed at this rank's shards), so the base class
is torch's."""
from torch.optim import Optimizer as DeepSpeedOptimizer

__all__ = ["DeepSpeedOptimizer"]

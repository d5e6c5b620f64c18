"""DeepSpeed's ``deepspeed.sequence.layer``: ``DistributedAttention`` wraps a local attention so that
it runs over the whole sequence for this rank's share of the heads (``zerodp.parallel.sequence``)."""
from ..parallel.sequence import DistributedAttention

__all__ = ["DistributedAttention"]

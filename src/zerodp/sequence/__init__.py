"""DeepSpeed's ``deepspeed.sequence``: Ulysses sequence parallelism (``layer.DistributedAttention``);
the implementation is ``zerodp.parallel.sequence``."""

"""DeepSpeed's ``deepspeed.runtime.sequence_parallel``: the sequence-parallel groups
(``parallel_state_sp``), over ``zerodp.parallel.sequence``."""

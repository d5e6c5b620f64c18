"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.parallel_state_sp``: the module that makes the
sequence-parallel groups and is itself the ``mpu`` given to ``initialize(mpu=...)``.

``initialize_sequence_parallel(n)`` makes groups of ``n`` consecutive ranks (every rank calls it);
the sequence-data-parallel group is every rank (ZeRO shards over it). ``initialize`` recognises this
module as an mpu by its ``initialize_sequence_parallel`` and builds the grid from its groups
(``zerodp.parallel.sequence``, whose ``STATE`` these functions are)."""
from __future__ import annotations

from ...parallel.sequence import STATE

initialize_sequence_parallel = STATE.initialize_sequence_parallel
get_sequence_parallel_group = STATE.get_sequence_parallel_group
get_sequence_parallel_world_size = STATE.get_sequence_parallel_world_size
get_sequence_parallel_rank = STATE.get_sequence_parallel_rank
get_sequence_data_parallel_group = STATE.get_sequence_data_parallel_group
get_sequence_data_parallel_world_size = STATE.get_sequence_data_parallel_world_size
get_sequence_data_parallel_rank = STATE.get_sequence_data_parallel_rank
get_model_parallel_group = STATE.get_model_parallel_group
get_model_parallel_world_size = STATE.get_model_parallel_world_size
get_model_parallel_rank = STATE.get_model_parallel_rank

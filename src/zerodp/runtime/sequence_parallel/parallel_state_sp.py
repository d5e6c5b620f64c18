"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.parallel_state_sp``: the module that makes the
sequence-parallel groups and is itself the ``mpu`` given to ``initialize(mpu=...)``.

``initialize_sequence_parallel(n)`` makes groups of ``n`` consecutive ranks (every rank calls it);
the sequence-data-parallel group is every rank (ZeRO shards over it). ``initialize`` recognises this
module as an mpu by its ``initialize_sequence_parallel`` and builds the grid from its groups
(``zerodp.parallel.sequence``)."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ...parallel import sequence as _sequence


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Make the sequence-parallel groups: blocks of ``sequence_parallel_size`` consecutive ranks."""
    if _sequence.sequence_axis() is not None:
        raise AssertionError("sequence parallel group is already initialized")
    _sequence.initialize_sequence_parallel(sequence_parallel_size)


def _axis():
    axis = _sequence.sequence_axis()
    if axis is None:
        raise AssertionError("sequence parallel group is not initialized: call initialize_sequence_parallel first")
    return axis


def get_sequence_parallel_group() -> Any:
    axis = _axis()
    return axis.group


def get_sequence_parallel_world_size() -> int:
    return _axis().size


def get_sequence_parallel_rank() -> int:
    return _axis().rank


def get_sequence_data_parallel_group() -> Any:
    _axis()
    return dist.group.WORLD


def get_sequence_data_parallel_world_size() -> int:
    _axis()
    return dist.get_world_size()


def get_sequence_data_parallel_rank() -> int:
    _axis()
    return dist.get_rank()


# DeepSpeed's aliases: the sequence group is this mpu's "model parallel" group
get_model_parallel_group = get_sequence_parallel_group
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_rank = get_sequence_parallel_rank

"""DeepSpeed's ``deepspeed.utils.groups``: the process groups of the run, as Accelerate and the
Transformers Trainer read them under sequence parallelism (``_get_sequence_parallel_group`` and its
family). Without sequence parallelism the sequence group is this rank alone and the
sequence-data-parallel group the data-parallel one (the world)."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..parallel.sequence import sequence_axis


def _world() -> tuple[int, int]:
    return (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else (1, 0)


def _get_sequence_parallel_world_size() -> int:
    axis = sequence_axis()
    return axis.size if axis is not None else 1


def _get_sequence_parallel_rank() -> int:
    axis = sequence_axis()
    return axis.rank if axis is not None else 0


def _get_sequence_parallel_group() -> Any:
    axis = sequence_axis()
    if axis is None:
        raise KeyError("No sequence parallel group found")
    return axis.group


def _get_sequence_data_parallel_world_size() -> int:
    return _world()[0]


def _get_sequence_data_parallel_rank() -> int:
    return _world()[1]


def _get_sequence_data_parallel_group() -> Any:
    return dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    """The ranks that run different batches (a sequence group's ranks share one)."""
    return _world()[0] // _get_sequence_parallel_world_size()


def _get_data_parallel_rank() -> int:
    return _world()[1] // _get_sequence_parallel_world_size()


def _get_model_parallel_world_size() -> int:
    return 1

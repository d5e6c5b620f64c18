"""DeepSpeed's ``deepspeed.pipe``: a model as a sequence of layers split into pipeline stages.

``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec`` (``module.py``) describe the model;
``zerodp.initialize(model=PipelineModule(...))`` returns a pipeline engine whose
``train_batch()`` runs a step over the stages (``zerodp/engine/pipeline.py``). The topology
classes say where each rank sits, as DeepSpeed's do (pipeline outermost, then data, then
tensor / model parallel).
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

from .module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec, partition_balanced, partition_uniform

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipelineError", "ProcessTopology",
           "PipeDataParallelTopology", "PipeModelDataParallelTopology", "partition_uniform", "partition_balanced"]


class ProcessTopology:
    """Ranks laid out on named axes, the last axis varying fastest (DeepSpeed's class)."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        self.axes, self.dims = list(axes), list(dims)
        self.ProcessCoord = NamedTuple("ProcessCoord", [(a, int) for a in self.axes])
        self.mapping = {self.ProcessCoord(*c): r
                        for r, c in enumerate(itertools.product(*(range(d) for d in self.dims)))}

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 1

    def world_size(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    def get_rank(self, **coords: int) -> int:
        return self.mapping[self.ProcessCoord(**coords)]

    def get_coord(self, rank: int):
        return next(c for c, r in self.mapping.items() if r == rank)

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        return sorted(r for c, r in self.mapping.items() if getattr(c, axis) == idx)


class PipeDataParallelTopology(ProcessTopology):
    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data"], [num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data", "model"], [num_pp, num_dp, num_mp])

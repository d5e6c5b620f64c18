"""The global gradient norm of a step: every rank's gradients, each element counted once.

``engine.py`` calls :func:`global_norm_and_usage` once per optimizer step, on the gradient shards
of its trainable flat groups (divided already, in fp32). One small all-reduce carries the squared
norm and, per parameter, whether any rank produced a gradient for it (the optimizer skips the
others, as unsharded PyTorch does); with pipeline stages, whose ranks hold other parameters, the
usage is summed inside the stage and the norm over everyone (two).

An element counts once: a shard held by several ranks (stage 0's whole gradients, the replicas
of hybrid sharding) only on the first of them, a parameter replicated over the tensor-parallel
ranks only on tensor rank 0 while every rank's slice of a split one counts (Megatron's and
DeepSpeed's rule), and a weight tied across pipeline stages on its first stage only
(``FlatGroup.counted_here``). The norm is inf or NaN on every rank when any rank's gradients
hold inf or NaN (fp16 overflow: every rank skips the step together).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .axes import ShardAxes
from .collectives import Comm
from .flat import FlatGroup

#: Elements per row when summing squares (see ``squared_l2``).
NORM_ROW = 1 << 12


def squared_l2(t: torch.Tensor) -> torch.Tensor:
    """The sum of squares of a 1-D tensor as a float64 scalar, accurate at any length.

    One fp32 ``vector_norm`` over millions of elements loses about 1e-4 relative on CPU
    (its accumulation error grows with the length; 4e-4 at 10M elements measured here), so
    the tensor is cut into rows of ``NORM_ROW`` elements whose fp32 norms are combined in
    float64 (fp32: error ~1e-8 at 10M elements; bf16 tensors, upcast inside the kernel, ~1e-6).
    """
    n = t.numel()
    whole = n // NORM_ROW * NORM_ROW
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    if whole:
        rows = torch.linalg.vector_norm(t[:whole].view(-1, NORM_ROW), dim=1, dtype=torch.float32)
        total += rows.double().pow(2).sum()
    if whole < n:
        total += torch.linalg.vector_norm(t[whole:], dtype=torch.float32).double() ** 2
    return total


def global_norm_and_usage(grads: Sequence[torch.Tensor], groups: Sequence[FlatGroup], usage: list[list[bool]],
                          grid, *, whole_on_every_rank: bool, axes: ShardAxes, data_comm: Comm, grid_comm: Comm,
                          device: torch.device) -> tuple[float, list[list[bool]]]:
    """The L2 norm of every rank's ``grads`` (one per group of ``groups``) and, per group and
    parameter, whether any rank of the stage used it. ``whole_on_every_rank``: every rank of a
    group's shard axis holds the whole gradient (stage 0), so rank 0 of the axis counts it;
    ``axes`` are the groups' shard axes (``axes.py``), ``data_comm`` the stage's data-parallel
    ranks, ``grid_comm`` all ranks."""
    comm = axes.comm()
    local = torch.zeros((), dtype=torch.float64, device=device)
    if grid.replica.rank == 0:
        for g, grad in zip(groups, grads):
            holder = not whole_on_every_rank or axes.of(g).rank == 0
            if holder and (g.tp_split or grid.tensor.rank == 0) and g.counted_here:
                local += squared_l2(grad)
    flags = [float(u) for used in usage for u in used]
    vec = torch.cat([local.reshape(1), torch.tensor(flags, dtype=torch.float64, device=device)])
    if grid.pipe.size == 1:  # every rank of the grid has the same parameters (its own slices): one sum
        (comm if grid.only_data else grid_comm).all_reduce_sum(vec, kind="control")
    else:  # pipeline stages hold other parameters: their usage stays in the stage, the norm is everyone's
        data_comm.all_reduce_sum(vec[1:], kind="control")
        grid_comm.all_reduce_sum(vec[:1], kind="control")
    norm = math.sqrt(vec[0].item())
    got = (vec[1:] > 0).tolist()
    used, k = [], 0
    for g in groups:
        used.append(got[k:k + len(g.params)])
        k += len(g.params)
    return norm, used

"""Ulysses sequence parallelism: the sequence split over the ranks of a sequence-parallel group,
each rank attending over the whole sequence for its share of the heads.

The sequence-parallel ranks of a group hold the same parameters and run the same samples, each
its own slice of the sequence. Everything outside attention works on the slice as it is (an MLP,
a norm, the loss act per token). Around the attention core an all-to-all turns the slices of the
sequence into slices of the heads (each rank: the whole sequence, ``heads / sp`` heads), the core
runs, and a second all-to-all turns the output back into slices of the sequence
(:func:`ulysses_attention`; ``DistributedAttention``, DeepSpeed's ``deepspeed.sequence.layer``
class, wraps a local attention the same way). Backward runs the same exchanges the other way.

For ZeRO the sequence-parallel ranks are data-parallel ranks: the model states shard and the
gradients reduce over data x sequence ranks (the grid's ``data`` axis holds both, as DeepSpeed's
sequence-data-parallel group does), and the gradients are averaged over all of them. Batch sizes
count the data-parallel ranks alone (``engine.dp_world_size``): the ranks of a sequence group
share one batch. A loss each rank computes on its own slice, averaged over its tokens, gives the
gradients of the whole-sequence loss when the slices hold as many tokens each; a loss combined
over the group (the Hugging Face Trainer's, weighted by each slice's tokens) gives them always.

The groups are contiguous ranks (sequence innermost, as DeepSpeed lays them out);
:func:`initialize_sequence_parallel` makes them before a model is built (the
``runtime.sequence_parallel.parallel_state_sp`` face calls it), and ``initialize`` builds them
from the config's ``sequence_parallel_size`` otherwise.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..core import teardown
from ..core.collectives import Comm, CommCounter
from .base import Parallelism
from .grid import Axis, Grid, new_axis

_AXIS: list[Axis] = []  # the sequence axis of this process, once made (one per process, as DeepSpeed's)
teardown.on_exit_release(_AXIS.clear)


class SequenceParallelError(ValueError):
    """A model, batch or grid that Ulysses cannot split as asked."""


def initialize_sequence_parallel(sequence_parallel_size: int) -> Axis:
    """Make the sequence-parallel groups of the world: blocks of ``sequence_parallel_size``
    consecutive ranks (every rank must call it). Returns this rank's sequence axis; a second
    call with the same size returns the same axis."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise SequenceParallelError("sequence parallelism needs torch.distributed initialized first")
    world, me = dist.get_world_size(), dist.get_rank()
    sp = int(sequence_parallel_size)
    if sp < 1 or world % sp:
        raise SequenceParallelError(f"sequence_parallel_size: {sp} does not divide the world size {world}")
    if _AXIS:
        if _AXIS[0].size != sp:
            raise SequenceParallelError(f"sequence_parallel_size: the sequence groups were made with {_AXIS[0].size} "
                                        f"ranks; this process cannot use {sp} as well")
        return _AXIS[0]
    axis = new_axis("sequence", [list(range(i, i + sp)) for i in range(0, world, sp)], me)
    _AXIS.append(axis)
    return axis


def sequence_axis() -> Optional[Axis]:
    """The sequence axis made by :func:`initialize_sequence_parallel` (or by ``initialize``), or None."""
    return _AXIS[0] if _AXIS else None


def forget_sequence_axis() -> None:
    """Forget the sequence axis (the process group is being destroyed)."""
    _AXIS.clear()


class _AllToAll(torch.autograd.Function):
    """``Comm.all_to_all`` with its backward: the same exchange with the dimensions swapped."""

    @staticmethod
    def forward(ctx, comm: Comm, x: torch.Tensor, scatter_dim: int, gather_dim: int, what: str):
        ctx.comm, ctx.dims, ctx.what = comm, (scatter_dim, gather_dim), what
        return comm.all_to_all(x, scatter_dim, gather_dim, what=what)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return None, ctx.comm.all_to_all(grad.contiguous(), gather_dim, scatter_dim, what=ctx.what + " (backward)"), \
            None, None, None


def all_to_all(x: torch.Tensor, comm: Comm, scatter_dim: int, gather_dim: int, what: str = "") -> torch.Tensor:
    """``x`` cut along ``scatter_dim`` over the group's ranks and joined along ``gather_dim``,
    differentiably."""
    return _AllToAll.apply(comm, x, scatter_dim, gather_dim, what)


def check_heads(heads: int, kv_heads: int, sp: int) -> int:
    """How many times each key/value head is repeated so that every rank gets whole heads: 1 when
    ``kv_heads`` divides over ``sp``; ``sp // kv_heads`` when fewer key/value heads than ranks
    (each rank then gets one). Refuses what does not split."""
    if heads % sp:
        raise SequenceParallelError(f"sequence parallelism: {heads} attention heads do not split over "
                                    f"{sp} sequence-parallel ranks; use a sequence_parallel_size that divides them")
    if kv_heads % sp == 0:
        return 1
    if sp % kv_heads == 0:
        return sp // kv_heads
    raise SequenceParallelError(f"sequence parallelism: {kv_heads} key/value heads neither split over nor divide "
                                f"{sp} sequence-parallel ranks; use a sequence_parallel_size they divide "
                                "or that divides them")


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention: Callable[..., torch.Tensor], comm: Comm, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Attention over the whole sequence from this rank's slice of it.

    ``query``, ``key``, ``value``: ``[batch, heads, local sequence, head dim]`` (torch's
    ``scaled_dot_product_attention`` layout); ``attention(q, k, v, *args, **kwargs)`` the core, called
    with ``[batch, heads / sp, sequence, head dim]`` and returning that shape. Returns this rank's
    slice of the output, ``[batch, heads, local sequence, head dim]``. Key/value heads fewer than the
    ranks are repeated so that each rank gets one."""
    sp = comm.world_size
    if sp == 1:
        return attention(query, key, value, *args, **kwargs)
    repeat = check_heads(query.shape[1], key.shape[1], sp)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    # heads scattered, sequence gathered: [b, h, s/sp, d] -> [b, h/sp, s, d]
    q, k, v = (all_to_all(t, comm, 1, 2, what=name)
               for t, name in ((query, "queries"), (key, "keys"), (value, "values")))
    out = attention(q, k, v, *args, **kwargs)
    return all_to_all(out, comm, 2, 1, what="attention output")  # back: [b, h/sp, s, d] -> [b, h, s/sp, d]


class DistributedAttention(nn.Module):
    """DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention``: ``local_attention`` run over the
    whole sequence for this rank's share of the heads.

    ``forward(query, key, value, batch_dim_idx, *args, **kwargs)`` takes ``[batch, local sequence,
    heads, head dim]`` (``batch_dim_idx`` 0) or ``[local sequence, batch, heads, head dim]`` (1), calls
    ``local_attention(q, k, v, *args, **kwargs)`` with the same layout over the whole sequence and
    ``heads / sp`` heads, and returns this rank's slice of its output in the layout it came in.
    ``sequence_process_group``: the sequence-parallel group (None: the one this process made,
    :func:`initialize_sequence_parallel` or ``initialize``'s). As DeepSpeed's, it refuses fewer
    key/value heads than ranks (``ulysses_attention`` repeats them instead)."""

    def __init__(self, local_attention: Callable[..., torch.Tensor], sequence_process_group: Any = None,
                 scatter_idx: int = 2, gather_idx: int = 0, sp_stream: Any = None, num_kv_heads: Optional[int] = None
                 ) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.num_kv_heads = num_kv_heads
        self._comm: Optional[Comm] = None

    def _group_comm(self) -> Comm:
        if self._comm is None:
            if self.spg is not None:
                self._comm = Comm(self.spg, "sequence")
            else:
                axis = sequence_axis()
                if axis is None:
                    raise SequenceParallelError("DistributedAttention: no sequence-parallel group; pass "
                                                "sequence_process_group= or call initialize_sequence_parallel first")
                self._comm = axis.comm(label="sequence")
        return self._comm

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int = 0,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        comm = self._group_comm()
        sp = comm.world_size
        kv = self.num_kv_heads or key.shape[2]
        if sp > 1 and kv < sp:
            raise SequenceParallelError(f"DistributedAttention: {kv} key/value heads are fewer than the {sp} "
                                        "sequence-parallel ranks; repeat them first (or use a smaller group)")
        check_heads(query.shape[2], kv, sp)
        seq = 1 - batch_dim_idx
        q, k, v = (all_to_all(t, comm, 2, seq, what=name) for t, name in ((query, "queries"), (key, "keys"),
                                                                         (value, "values")))
        out = self.local_attn(q, k, v, *args, **kwargs)
        return all_to_all(out, comm, seq, 2, what="attention output")


class SequenceParallel(Parallelism):
    """The engine's handle on Ulysses sequence parallelism (see the module docstring): the group's
    collectives, counted with the engine's; nothing done to inputs, parameters or the step (the
    model's attention runs the exchanges, ZeRO's data axis spans the sequence ranks)."""

    name = "sequence"

    def __init__(self, grid: Grid, counter: CommCounter) -> None:
        counter.declare("all_to_all")
        self.comm = grid.sequence.comm(counter, "sequence")


class ParallelStateSP:
    """DeepSpeed's ``parallel_state_sp`` as an object (``STATE``): the sequence-parallel groups of
    this process, and what ``initialize(mpu=...)`` takes (it is recognised by
    ``initialize_sequence_parallel``). The sequence-data-parallel group is every rank."""

    @staticmethod
    def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
        if sequence_axis() is not None:
            raise AssertionError("sequence parallel group is already initialized")
        initialize_sequence_parallel(sequence_parallel_size)

    @staticmethod
    def _axis() -> Axis:
        axis = sequence_axis()
        if axis is None:
            raise AssertionError("sequence parallel group is not initialized: call initialize_sequence_parallel first")
        return axis

    def get_sequence_parallel_group(self) -> Any:
        return self._axis().group

    def get_sequence_parallel_world_size(self) -> int:
        return self._axis().size

    def get_sequence_parallel_rank(self) -> int:
        return self._axis().rank

    def get_sequence_data_parallel_group(self) -> Any:
        import torch.distributed as dist
        self._axis()
        return dist.group.WORLD

    def get_sequence_data_parallel_world_size(self) -> int:
        import torch.distributed as dist
        self._axis()
        return dist.get_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        import torch.distributed as dist
        self._axis()
        return dist.get_rank()

    # DeepSpeed's aliases: the sequence group is this mpu's "model parallel" group
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank


STATE = ParallelStateSP()

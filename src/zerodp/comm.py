"""DeepSpeed's ``deepspeed.comm``: the collectives a training script calls itself.

Thin faces over ``torch.distributed`` with DeepSpeed's names and signatures (its profiling
keywords ``prof``, ``log_name`` and ``debug`` are accepted and ignored), so ``import zerodp.comm
as dist`` works where a script had ``import deepspeed.comm as dist``. The engine's own collectives
(backend-aware forms, byte counts) are in ``zerodp.collectives``; ``log_summary`` prints what
they moved.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as _dist
from torch.distributed import ReduceOp

from .core import teardown
from .core.device import backend_for, default_device, local_rank
from .core.device import init_distributed as _start_group

__all__ = ["ReduceOp", "init_distributed", "is_initialized", "is_available", "get_rank", "get_world_size",
           "get_local_rank", "get_global_rank", "get_backend", "barrier", "all_reduce", "broadcast",
           "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce", "gather", "scatter",
           "send", "recv", "isend", "irecv", "new_group", "destroy_process_group", "log_summary"]

def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: timedelta = timedelta(minutes=30), init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Start the default process group unless it is started (DeepSpeed's signature).

    Under a launcher (torchrun sets ``RANK``/``WORLD_SIZE``) the group comes from its
    environment; with ``init_method``, ``rank`` and ``world_size`` from those; otherwise the
    process is a group of one (``MASTER_ADDR`` 127.0.0.1 and a free port, unless ``MASTER_ADDR`` /
    ``MASTER_PORT`` are set; ``distributed_port`` is accepted for DeepSpeed's signature).
    The backend is NCCL on CUDA and gloo on CPU unless ``dist_backend`` says otherwise.
    ``auto_mpi_discovery`` is accepted; zerodp does not read MPI's environment. A group started
    here is destroyed at interpreter exit (``zerodp.core.teardown``).
    """
    if dist_init_required is False or (_dist.is_available() and _dist.is_initialized()):
        return
    if init_method is not None or (rank >= 0 and world_size > 0):
        backend = dist_backend or backend_for(default_device())
        _dist.init_process_group(backend=backend, init_method=init_method or "env://",
                                 rank=rank, world_size=world_size, timeout=timeout)
        teardown.group_started()  # destroyed at interpreter exit (core/teardown.py)
        return
    if "WORLD_SIZE" not in os.environ:  # not launched: a group of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
    _start_group(dist_backend)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def is_available() -> bool:
    return _dist.is_available()


def get_rank(group=None) -> int:
    return _dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return _dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's index on its node (``LOCAL_RANK``)."""
    return local_rank()


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return _dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_backend(group=None) -> str:
    return _dist.get_backend(group)


def barrier(group=None, async_op: bool = False, device_ids=None, **_ignored):
    return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, **_ignored):
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, **_ignored):
    return _dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list: list, tensor: torch.Tensor, group=None, async_op: bool = False, **_ignored):
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op: bool = False, **_ignored):
    return _dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op: bool = False,
                          **_ignored):
    return _dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce(tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False, **_ignored):
    return _dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def gather(tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False, **_ignored):
    return _dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False, **_ignored):
    return _dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def send(tensor, dst: int, group=None, tag: int = 0, **_ignored):
    return _dist.send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor, src: Optional[int] = None, group=None, tag: int = 0, **_ignored):
    return _dist.recv(tensor, src=src, group=group, tag=tag)


def isend(tensor, dst: int, group=None, tag: int = 0, **_ignored):
    return _dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor, src: Optional[int] = None, group=None, tag: int = 0, **_ignored):
    return _dist.irecv(tensor, src=src, group=group, tag=tag)


def new_group(ranks=None, **kwargs):
    return _dist.new_group(ranks=ranks, **kwargs)


def destroy_process_group(group=None) -> None:
    _dist.destroy_process_group(group)


def log_summary(show_straggler: bool = False) -> None:
    """Print, on rank 0, the bytes each live engine moved in its last optimizer step, per
    collective kind (``engine.comm_stats()``; ``show_straggler`` is accepted and ignored)."""
    if get_rank() != 0:
        return
    from .core.live import live_engines
    for i, engine in enumerate(live_engines()):
        stats = engine.comm_stats()
        parts = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in stats.items())
        print(f"zerodp engine {i} (ZeRO stage {engine.zero_stage}, {engine.world_size} ranks), last step: {parts}",
              flush=True)

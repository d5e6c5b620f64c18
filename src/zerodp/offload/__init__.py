"""Offload: model states in host memory or on disk (see ``docs/offload.md``).

* ``optimizer.py``: ``offload_optimizer`` — fp32 masters and optimizer states on the host
  (``cpu``) or in files (``nvme``), the step walked tile by tile on the CPU;
* ``swap.py``: tensors paged to and from files with parallel positional I/O;
* ``params.py``: stage 3's ``offload_param`` — parameter shards in host memory or in files,
  brought to the device when their unit is gathered;
* ``host.py``: the host-memory check made before anything is allocated;
* ``activations.py``: ``activation_checkpointing.cpu_checkpointing``, checkpointed layers' inputs
  in host memory from forward to backward.
"""
from __future__ import annotations

from .host import HostMemoryError, available_host_bytes, check_host_budget
from .optimizer import OptimizerOffload
from .params import ParamOffload

__all__ = ["OptimizerOffload", "ParamOffload", "HostMemoryError", "available_host_bytes", "check_host_budget",
           "group_cap"]


def group_cap(zero_config, world_size: int) -> int:
    """Elements per flat group: ``reduce_bucket_size``, and with optimizer offload at most
    ``sub_group_size`` per rank's shard (a group's shard is the tile the offloaded step walks)."""
    cap = int(zero_config.reduce_bucket_size)
    if zero_config.optimizer_offload != "none":
        cap = min(cap, int(zero_config.sub_group_size) * world_size)
    return cap

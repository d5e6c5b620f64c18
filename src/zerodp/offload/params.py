"""Stage 3 ``offload_param``: each flat group's parameter shard in host memory or in a file.

``park(g)`` moves group ``g``'s shard off the compute device as soon as it has its values (for a
model built on the meta device, right after its unit is initialized, so no more than one unit's
shards are in memory at once during set-up). ``FlatGroup.open_for_gather`` copies a host shard to the
device, or reads a shard on disk, copies it and drops it again; the offloaded optimizer step
writes updated shards back (``optimizer.py``).
"""
from __future__ import annotations

import torch

from ..core.flat import FlatGroup
from .swap import PagedTensors, SwapDir


class ParamOffload:
    """Where this rank's parameter shards live (``offload_param``)."""

    def __init__(self, zero_config, aio_config, device: torch.device, rank: int) -> None:
        pc = zero_config.offload_param
        self.kind: str = pc.device  # "cpu" or "nvme"
        self.pin = bool(pc.pin_memory) and self.kind == "cpu" and device.type == "cuda"
        self.swap = (SwapDir(pc.nvme_path, rank, aio_config.block_size, aio_config.queue_depth)
                     if self.kind == "nvme" else None)
        self._groups: dict[int, FlatGroup] = {}

    def park(self, g: FlatGroup) -> None:
        """Move ``g``'s shard to host memory (and with ``nvme`` to its file); once per group."""
        if g.index in self._groups:
            return
        g.offload_shard(self.pin)
        if self.swap is not None:
            page = PagedTensors(self.swap, f"p{g.index}")
            page.add(g.shard)
            g.attach_shard_page(page)
            page.page_out(wait=True)
        self._groups[g.index] = g

    def close(self) -> None:
        for g in self._groups.values():
            if g.shard_page is not None:
                g.shard_page.wait()
        if self.swap is not None:
            self.swap.close()

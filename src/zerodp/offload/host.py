"""How much host memory offload may take, checked before it takes it.

Offload moves model states into host memory, and page-locked (pinned) buffers cannot be swapped
out, so over-committing the host ends in the kernel's OOM killer, not a Python error. Before
allocating, every rank checks that what all ranks on its node will hold fits in the memory the
host has available (``MemAvailable``, and the cgroup's limit where one is set).
"""
from __future__ import annotations

import os
from pathlib import Path

#: Part of the available memory offload may plan to take (the rest is for the process itself,
#: data loading, the page cache that disk offload reads through).
HOST_SHARE = 0.9


class HostMemoryError(MemoryError):
    """Offload would need more host memory than the host has available."""


def available_host_bytes() -> int:
    """Memory this process can still get: ``MemAvailable``, capped by the cgroup limit less its usage."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < (1 << 60):
                avail = min(avail, int(limit) - int(Path(usage_file).read_text().strip()))
            break
        except (OSError, ValueError):
            continue
    return max(avail, 0)


def local_ranks() -> int:
    """Ranks of this job on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 when unset)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def check_host_budget(per_rank: dict[str, int], pinned: bool, *, available: int | None = None,
                      ranks: int | None = None) -> None:
    """Raise :class:`HostMemoryError` when ``per_rank`` bytes (by what they are) times the ranks
    on this node exceed ``HOST_SHARE`` of the host's available memory."""
    ranks = local_ranks() if ranks is None else ranks
    available = available_host_bytes() if available is None else available
    need = sum(per_rank.values()) * ranks
    if need <= HOST_SHARE * available:
        return
    parts = ", ".join(f"{k} {gib(v)}" for k, v in per_rank.items() if v)
    raise HostMemoryError(
        f"offload needs {gib(need)} of host memory on this node ({ranks} rank(s) x [{parts}]"
        f"{', page-locked' if pinned else ''}), and the host has {gib(available)} available "
        f"(offload plans for at most {HOST_SHARE:.0%} of it). Use more nodes or ranks per model copy "
        "(ZeRO shards these states), offload the optimizer to disk (offload_optimizer.device \"nvme\"), "
        "or free host memory" + ("; pin_memory false needs no less memory but lets the kernel swap it"
                                 if pinned else ""))

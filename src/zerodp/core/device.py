"""Device and backend choice, in one place.

Every other module asks here which device a rank computes on and which
collective backend goes with it, so CPU + gloo and CUDA + NCCL share all code.
"""
from __future__ import annotations

import importlib
import logging
import os

import torch
import torch.distributed as dist

from . import teardown

logger = logging.getLogger("zerodp")


def local_rank() -> int:
    """This process's index on its node (``LOCAL_RANK`` as set by torchrun), 0 if unset."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, otherwise ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def select(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (nothing on the CPU), so that what picks
    a device from the current one (torch's ``DeviceMesh``, NCCL's group start-up) picks the
    engine's, also where ranks share a GPU and ``LOCAL_RANK`` is past the device count."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def backend_for(device: torch.device) -> str:
    """The collective backend that suits ``device``: NCCL for CUDA, gloo for CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(backend: str | None = None) -> bool:
    """Start the default process group from torchrun's environment if not started yet.

    Returns True when a process group is available after the call; False when the
    process runs alone (no ``WORLD_SIZE`` in the environment and no group). A group started
    here is destroyed at interpreter exit (``teardown.py``); one started before is left alone.
    """
    if dist.is_available() and dist.is_initialized():
        return True
    if "WORLD_SIZE" not in os.environ or not dist.is_available():
        return False
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Imported before the group exists: imported after (as the optimizers do), it keeps gloo's
    # threads alive past destroy_process_group, and one that ends during interpreter
    # shutdown aborts the process ("terminate called without an active exception").
    importlib.import_module("torch._dynamo")  # not "import torch._dynamo", which makes torch local here
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and \
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        logger.warning("restarted by torchrun, which kept its store from the failed attempt: if the "
                       "process group cannot connect (gloo 'Connection refused'), launch torchrun with "
                       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (zerodp train does)")
    dist.init_process_group(backend=backend or backend_for(device))
    teardown.group_started()  # destroyed at interpreter exit (teardown.py)
    return True


def empty_cache(device: torch.device) -> None:
    """Return the memory the device's caching allocator keeps unused (CUDA; nothing on CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (a no-op on CPU); used around timings."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_empty(numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """A host tensor for moving data to and from ``device``: page-locked when ``pin`` and the
    device is a GPU (so copies run asynchronously), ordinary memory otherwise."""
    return torch.empty(numel, dtype=dtype, pin_memory=pin and device.type == "cuda")


class CopiesDone:
    """Marks the copies queued on ``device`` so far; ``wait()`` returns once they are done
    (at once on the CPU, where copies are synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self._event = None
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

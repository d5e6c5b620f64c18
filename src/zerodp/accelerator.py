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

logger = logging.getLogger("zerodp")


def local_rank() -> int:
    """This process's index on its node (``LOCAL_RANK`` as set by torchrun), 0 if unset."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, otherwise ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The collective backend that suits ``device``: NCCL for CUDA, gloo for CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(backend: str | None = None) -> bool:
    """Start the default process group from torchrun's environment if not started yet.

    Returns True when a process group is available after the call; False when the
    process runs alone (no ``WORLD_SIZE`` in the environment and no group).
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
    return True


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


class Accelerator:
    """DeepSpeed's accelerator object (``get_accelerator()``), for the device zerodp computes on:
    CUDA when available, otherwise the CPU. Its methods answer for that device, so a script
    written against ``deepspeed.accelerator.get_accelerator()`` runs unchanged on either."""

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()
        self._name = "cuda" if self._cuda else "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"``/``"cuda:i"``, or ``"cpu"``."""
        if not self._cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or "cuda") if self._cuda else torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(state, device_index or "cuda")
        else:
            torch.set_rng_state(state)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    @property
    def Stream(self):  # noqa: N802 (DeepSpeed's name)
        if not self._cuda:
            raise RuntimeError("streams exist on CUDA devices only; zerodp is running on the CPU")
        return torch.cuda.Stream

    @property
    def Event(self):  # noqa: N802
        if not self._cuda:
            raise RuntimeError("events exist on CUDA devices only; zerodp is running on the CPU")
        return torch.cuda.Event

    def __getattr__(self, name: str):
        raise AttributeError(f"zerodp's accelerator has no {name!r}: it implements the everyday part of "
                             "DeepSpeed's accelerator interface (device names and counts, seeds, memory, "
                             "synchronization, streams); see the README's table of DeepSpeed names")


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The accelerator zerodp computes on (DeepSpeed's ``deepspeed.accelerator.get_accelerator``)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR

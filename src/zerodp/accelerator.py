"""DeepSpeed's ``deepspeed.accelerator``: ``get_accelerator()`` and its object.

A face over the device choice in ``zerodp.core.device`` (which device a rank computes on, which
backend goes with it), with DeepSpeed's method names.
"""
from __future__ import annotations

import os

import torch

from .core.device import CopiesDone, backend_for, default_device, host_empty, init_distributed, local_rank, synchronize  # noqa: F401


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

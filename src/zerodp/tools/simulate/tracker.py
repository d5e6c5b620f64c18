"""Bytes allocated on one device, live and at their peak, counted from the tensors themselves.

A fake process group allocates every buffer a rank would allocate, and CPU memory has no
allocator statistics (``torch.cuda.max_memory_allocated`` exists for CUDA only), so
:class:`PeakMemory` counts storages: those alive when it starts (found through the garbage
collector), every storage an operator returns while it is active (a ``TorchDispatchMode``),
and every ``UntypedStorage.resize_`` (stage 3 frees and refills its gathered buffers that way).
A storage counts from when it is seen until it is freed (a weak reference's callback). What an
operator allocates and frees inside itself (a matmul's workspace) is not seen; on CUDA the
caching allocator's own figures are read beside it (:func:`device_peak`).
"""
from __future__ import annotations

import gc
import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["PeakMemory", "device_peak"]


def _storages(t: torch.Tensor) -> list:
    """The storages behind ``t`` (the local tensors of a ``DTensor``)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, n) for n in names]
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
    if t.is_meta or t.device.type == "meta":
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a functional wrapper)
        return []


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory("cpu") as m: ...``; then ``m.peak`` (bytes), ``m.live`` and ``m.start``."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self._size: dict[int, int] = {}
        self._refs: dict[int, Any] = {}
        self.live = self.peak = self.start = 0
        self._resize: Optional[Any] = None

    # -- counting -------------------------------------------------------------------------

    def _see(self, st) -> None:
        if st.device.type != self.device_type:
            return
        key = id(st)
        if key in self._refs:
            return
        try:
            self._refs[key] = weakref.ref(st, lambda _r, key=key: self._gone(key))
        except TypeError:
            return
        self._size[key] = st.nbytes()
        self._add(self._size[key])

    def _gone(self, key: int) -> None:
        self._refs.pop(key, None)
        self.live -= self._size.pop(key, 0)

    def _add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def _resized(self, st) -> None:
        key = id(st)
        if key not in self._refs:
            self._see(st)
            return
        new = st.nbytes()
        self._add(new - self._size[key])
        self._size[key] = new

    # -- the mode -------------------------------------------------------------------------

    def __enter__(self) -> "PeakMemory":
        for obj in gc.get_objects():  # what exists already: the model, the engine's buffers
            if issubclass(type(obj), torch.Tensor):  # (type(): no attribute lookups on odd objects)
                for st in _storages(obj):
                    self._see(st)
        self.start = self.live
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            out = original(st, size)
            tracker._resized(st)
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._see(st)
        return out


def device_peak(device: torch.device) -> Optional[int]:
    """The caching allocator's peak on a CUDA device since its last reset, else None."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None

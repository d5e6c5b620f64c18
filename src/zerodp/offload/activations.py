"""Checkpointed activations in host memory (``activation_checkpointing.cpu_checkpointing``).

Activation checkpointing keeps only each checkpointed layer's inputs through the forward and
recomputes the rest in backward; for a long sequence those inputs (``[batch, sequence, hidden]``
per layer) are what is left of activation memory. :class:`ActivationOffload` moves them to host
memory as the forward saves them and brings each back when backward recomputes its layer, so
the device holds one layer's inputs at a time.

It is a ``torch.autograd.graph.saved_tensors_hooks`` pair, active around the engine's forward. Only
tensors *marked* as checkpoint inputs move; everything else autograd saves stays where it is:

* ``zerodp.checkpointing.checkpoint`` (DeepSpeed's ``deepspeed.checkpointing.checkpoint``) marks
  its tensor arguments;
* a Hugging Face layer under gradient checkpointing (a module with ``gradient_checkpointing`` on
  and a ``_gradient_checkpointing_func``, transformers' ``GradientCheckpointingLayer``) marks its
  first argument, the hidden states, as DeepSpeed's ``CheckpointHiddenStatesOffload`` does. The
  mark is made by wrapping the layer's ``_gradient_checkpointing_func`` at each forward, so the
  Trainer may turn gradient checkpointing on before or after ``initialize``.

torch's non-reentrant checkpoint saves its inputs through the active saved-tensor hooks before its
own recomputation hooks take over, which is what lets the pack hook see them. When the activations
already live in host memory (a CPU run) nothing is copied; the hooks still count what they would
move (:attr:`ActivationOffload.stats`).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

_ACTIVE = threading.local()
_WRAPPED = "_zerodp_offload_marks"


@dataclass
class OffloadStats:
    """What the hooks saw since the last :meth:`ActivationOffload.reset`."""

    marked: int = 0  # checkpoint inputs marked for host memory
    offloaded: int = 0  # of them, copied to host memory
    offloaded_bytes: int = 0
    restored: int = 0  # copies brought back for backward


class _OnHost:
    """A saved tensor's host copy and the device it returns to."""

    __slots__ = ("tensor", "device")

    def __init__(self, tensor: torch.Tensor, device: torch.device):
        self.tensor, self.device = tensor, device


def active() -> "Optional[ActivationOffload]":
    """The offload active on this thread (inside an engine forward with ``cpu_checkpointing``)."""
    return getattr(_ACTIVE, "offload", None)


def mark(*tensors: Any) -> None:
    """Mark checkpoint inputs for host memory, if an offload is active (else nothing)."""
    offload = active()
    if offload is not None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                offload.mark(t)


class ActivationOffload:
    """Marked saved tensors go to host memory in forward and back to their device in backward.

    ``min_bytes``: smaller tensors stay put (the copy would cost more than it saves).
    ``copy_host_tensors``: copy marked tensors that already live in host memory too (a CPU run then
    pays, and shows, what the round trip costs; no memory is saved).
    """

    def __init__(self, host: "torch.device | str" = "cpu", min_bytes: int = 1024,
                 copy_host_tensors: bool = False):
        self.host = torch.device(host)
        self.min_bytes = int(min_bytes)
        self.copy_host_tensors = copy_host_tensors
        self.stats = OffloadStats()
        self._marks: dict[int, int] = {}

    def reset(self) -> None:
        self.stats = OffloadStats()

    def mark(self, tensor: torch.Tensor) -> None:
        self._marks[id(tensor)] = self._marks.get(id(tensor), 0) + 1
        self.stats.marked += 1

    def _take_mark(self, tensor: torch.Tensor) -> bool:
        n = self._marks.get(id(tensor), 0)
        if n <= 0:
            return False
        if n == 1:
            del self._marks[id(tensor)]
        else:
            self._marks[id(tensor)] = n - 1
        return True

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self._take_mark(tensor):
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_bytes or (tensor.device == self.host and not self.copy_host_tensors):
            return tensor
        pin = tensor.device.type != "cpu" and torch.cuda.is_available()
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        copy.copy_(tensor, non_blocking=pin)
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += nbytes
        return _OnHost(copy, tensor.device)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _OnHost):
            self.stats.restored += 1
            return packed.tensor.to(packed.device, non_blocking=True)
        return packed

    @contextlib.contextmanager
    def forward(self, model: Optional[nn.Module] = None) -> Iterator["ActivationOffload"]:
        """The context a forward runs in: saved marked tensors move to host memory. ``model``'s
        Hugging Face gradient-checkpointing layers mark their hidden states."""
        if model is not None:
            _wrap_checkpointing_layers(model)
        previous = active()
        _ACTIVE.offload = self
        try:
            with saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            _ACTIVE.offload = previous
            self._marks.clear()  # a mark the pack hook did not take (a layer run without grad)


def _marking(func: Any) -> Any:
    """``func`` (a layer's ``_gradient_checkpointing_func``) that first marks its first tensor argument
    (the hidden states; the layer's forward is its first argument)."""
    @functools.wraps(func)
    def checkpoint_marked(function, *args, **kwargs):
        if args:
            mark(args[0])
        return func(function, *args, **kwargs)

    setattr(checkpoint_marked, _WRAPPED, True)
    return checkpoint_marked


def _wrap_checkpointing_layers(model: nn.Module) -> None:
    """Wrap each gradient-checkpointing layer's checkpoint function with :func:`_marking` (once; a
    function set again by ``gradient_checkpointing_enable`` is wrapped again)."""
    for module in model.modules():
        func = module.__dict__.get("_gradient_checkpointing_func")
        if func is not None and getattr(module, "gradient_checkpointing", False) \
                and not getattr(func, _WRAPPED, False):
            module._gradient_checkpointing_func = _marking(func)

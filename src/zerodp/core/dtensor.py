"""Parameters that may be ``DTensor`` s (tensor parallelism, ``parallel/tensor.py``): this rank's
local tensor of one, binding its storage, its gradient in its own layout. A flat group lays out
local tensors; these helpers are how every module reaches them.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor``. torch's DTensor package is not imported for this (it costs
    about 40 MiB of memory per process): while nothing imported it, no tensor is one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of ``t``: the local tensor of a ``DTensor``, else ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t


def bind_local(p: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``view`` the storage of ``p``'s values (its local tensor, for a ``DTensor``)."""
    if is_dtensor(p):
        p._local_tensor = view
    else:
        p.data = view


def grad_local(p: nn.Parameter) -> torch.Tensor:
    """This rank's part of ``p.grad``, laid out as ``p``'s local tensor: a ``DTensor`` gradient that
    autograd produced in another layout than the parameter's (an embedding split over the
    vocabulary gets a replicated gradient) is redistributed to the parameter's first."""
    g = p.grad
    if is_dtensor(g):
        if g.placements != p.placements:
            g = g.redistribute(p.device_mesh, p.placements)
        return g._local_tensor
    return g


def set_param_data(p: nn.Parameter, new: torch.Tensor) -> None:
    """``p.data = new``, which for a ``DTensor`` changes the wrapper (its dtype) but not the local
    tensor it wraps: that is set too."""
    p.data = new
    if is_dtensor(p):
        p._local_tensor = new._local_tensor


def grad_like(p: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """A gradient for ``p`` whose values are ``local`` (a ``DTensor`` laid out as ``p`` is)."""
    if is_dtensor(p):
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return local

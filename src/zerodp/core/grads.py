"""A flat group's gradient storage (``FlatGroup.grads``), as the stage policy decides
(``stages.py``):

* ``full``: a full-size gradient buffer (stages 0-1), whose views are the parameters' ``.grad``;
* ``shard``: this rank's gradient shard (a view into ``full`` at stages 0-1; at stages 2-3 its
  own buffer, made by the first reduction of a step and freed after the update, so between steps
  no gradient memory is held, as with ``zero_grad(set_to_none=True)``).

The buckets gradients are reduced in are the reducer's (``reduce.py``).
"""
from __future__ import annotations

from typing import Optional

import torch

from .dtensor import grad_like, local_tensor
from .group_layout import GroupLayout


class GroupGrads:
    """The gradients of one flat group (see the module docstring; ``group``: the flat group, of which
    this uses its layout, ``params`` and ``device``); made empty with the group, given storage by
    :meth:`allocate`."""

    def __init__(self, group: GroupLayout) -> None:
        self._group = group
        self.full: Optional[torch.Tensor] = None
        self.shard: Optional[torch.Tensor] = None
        self.dtype: torch.dtype = group.dtype

    def allocate(self, keep_full: bool, dtype: Optional[torch.dtype] = None) -> None:
        """Allocate gradient storage in ``dtype`` (default: the parameters'): a full buffer
        whose views are ``p.grad`` (stages 0-1; views only where the dtypes match, as torch
        requires), or only this rank's shard (stages 2-3)."""
        g = self._group
        self.dtype = dtype or g.dtype
        if keep_full:
            self.full = torch.zeros(g.padded_numel, dtype=self.dtype, device=g.device)
            self.shard = g.shard_of(self.full)
            self._bind_to_full()

    @property
    def nbytes(self) -> int:
        """Bytes of gradient storage this group holds during a step (the full buffer, or the
        shard whether or not it is allocated right now)."""
        g = self._group
        numel = g.padded_numel if self.full is not None else g.shard_numel
        return numel * self.dtype.itemsize

    def claim_shard(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The gradient shard, newly allocated for the step's first reduction to land in
        (stages 2-3; the reduce-scatter writes it, no copy); None when the shard already
        holds an earlier reduction or ``dtype`` is not the gradients' (then the reduced part
        goes through :meth:`add_to_shard`)."""
        if self.full is not None or self.shard is not None or dtype != self.dtype:
            return None
        self.shard = torch.empty(self._group.shard_numel, dtype=self.dtype, device=self._group.device)
        return self.shard

    def add_to_shard(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced part of a gradient bucket into ``shard`` (stages 2-3),
        allocating the shard with the first one of a step."""
        if self.shard is None:
            self.shard = torch.empty(self._group.shard_numel, dtype=self.dtype, device=self._group.device)
            self.shard.copy_(reduced)
        else:
            self.shard.add_(reduced)

    def zero(self, keep_views: bool = False) -> None:
        """Clear the gradients: ``p.grad`` is None afterwards at every stage, as in DeepSpeed (code
        that reads ``.grad`` after a step, such as the Hugging Face Trainer's norm over mixed
        ``DTensor`` meshes, sees no gradient rather than zeros). A full gradient buffer is zeroed and
        kept: the next backward's gradients are added into it and ``.grad`` becomes its view again
        (at once with ``keep_views``: ``zero_grad(set_to_none=False)``)."""
        if self.full is not None:
            self.full.zero_()
            if keep_views:
                self._bind_to_full()
                return
        else:
            self.shard = None  # the next step's first reduction allocates it again
        for p in self._group.params:
            p.grad = None

    def _bind_to_full(self) -> None:
        """Make every ``p.grad`` a view of ``full`` so autograd accumulates into it (when
        gradients are kept in another dtype, ``p.grad`` is folded in and dropped instead)."""
        g = self._group
        same = self.full.dtype == g.dtype
        for i, p in enumerate(g.params):
            if not same:
                p.grad = None
            elif p.grad is None or local_tensor(p.grad).data_ptr() != g.view(self.full, i).data_ptr():
                p.grad = grad_like(p, g.view(self.full, i))

"""DeepSpeed's ``deepspeed.checkpoint.utils`` name the Hugging Face integration imports."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]

_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item: Any, device: torch.device = _CPU) -> Any:
    """``item`` with every tensor in it (in lists, tuples and dicts, recursively) replaced by a
    detached copy on ``device`` with storage of its own, so that ``torch.save`` writes only
    those elements (not a view's whole storage). Other values are returned as they are."""
    if torch.is_tensor(item):
        return item.detach().to(device=device, copy=True)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item

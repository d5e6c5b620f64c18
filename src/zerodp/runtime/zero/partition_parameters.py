"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters``: the names ``transformers`` uses
around ``zero.Init`` (``prevent_arange_dtype_change`` swaps ``zero_wrapper_for_fp_tensor_constructor``
and compares with ``_orig_torch_arange``), the parameter status enum, and ``Init`` itself.

zerodp's ``Init`` does not replace torch's tensor constructors (it shards each module's
parameters when the module is built, ``core/init_shards.py``), so the wrapper here is only the
function DeepSpeed's code and ``transformers`` expect to find and swap."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...core.init_shards import ZeroParamStatus
from ...zero import GatheredParameters, Init, register_external_parameter

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "ZeroParamStatus",
           "zero_wrapper_for_fp_tensor_constructor"]

_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype,
                                           target_device: Optional[Any] = None) -> Callable:
    """DeepSpeed's wrapper of a tensor constructor: floating-point results in
    ``target_fp_dtype``, on ``target_device`` when the call names no device."""

    def wrapped_fn(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped_fn

"""DeepSpeed's ``deepspeed.zero`` names: ``Init``, ``GatheredParameters``, ``register_external_parameter``.

``Init`` builds a model so that no rank ever holds all of it: every parameter a module registers
inside the context is replaced by one on the meta device (no storage), while buffers keep their
real values (causal masks, rotary frequencies). ``zerodp.initialize`` at stage 3 then gives the
parameters their values one unit at a time and keeps only this rank's shard: each module's
``reset_parameters()``, then ``param_init_fn`` or, for a ``transformers`` model, the model's own
``_init_weights``, seeded identically on every rank (see the README's stage-3 section). The
values are therefore drawn per unit, not in the order a model built outside ``Init`` draws
them; load pretrained weights after ``initialize`` (``GatheredParameters(...,
modifier_rank=0)`` or ``engine.load_checkpoint``).

A model loaded inside the context (``AutoModelForCausalLM.from_pretrained`` builds on the meta
device, then puts each loaded tensor in place of its parameter) keeps the loaded values: a value
that replaces a parameter without data is never turned back into one. Such a model is whole on
every rank until ``initialize`` shards it (as ``from_pretrained`` without DeepSpeed's
integration holds it); parameters the checkpoint lacks stay without data, and ``initialize``
refuses a unit that mixes the two.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from .core.param_api import GatheredParameters, register_external_parameter

__all__ = ["Init", "GatheredParameters", "register_external_parameter"]


def _to_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> Optional[nn.Parameter]:
    if param is None or param.is_meta:
        return None
    old = module._parameters.get(name)
    if old is not None and old.is_meta:
        # a value put in place of a parameter that has none yet: loaded weights
        # (``from_pretrained`` built inside the context), kept
        return None
    return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)


class Init:
    """Build the model inside this context at stage 3 (DeepSpeed's ``zero.Init``; its keyword
    arguments are accepted). ``enabled=False`` builds it normally. Parameters created inside are
    on the meta device until ``zerodp.initialize`` shards them; buffers are real. ``module=``
    (an existing model) needs nothing: ``initialize`` shards it at stage 3."""

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group=None,
                 mem_efficient_linear: bool = True, remote_device: Any = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None, **kwargs) -> None:
        self.enabled = enabled and module is None
        self._handle = None

    def __enter__(self) -> "Init":
        if self.enabled:
            self._handle = register_module_parameter_registration_hook(_to_meta)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

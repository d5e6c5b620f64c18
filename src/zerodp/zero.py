"""DeepSpeed's ``deepspeed.zero`` names: ``Init``, ``GatheredParameters``, ``register_external_parameter``.

``Init`` builds a model so that no rank ever holds all of it: every parameter a module registers
inside the context is replaced by one that keeps only this rank's slice of its values (rank 0's
values, broadcast as it is made; ``core/init_shards.py``) and looks like DeepSpeed's partitioned
parameter: empty data on the real device, its shape in ``ds_shape``; buffers
keep their real values (causal masks, rotary frequencies). Read or write such parameters whole
with ``GatheredParameters(params, modifier_rank=r)``: inside they hold their full values; on
exit rank r's become everyone's. ``transformers`` loads checkpoints that way under DeepSpeed's
ZeRO-3 (``from_pretrained`` after ``TrainingArguments(deepspeed=<stage 3>)``), and it keeps the
loaded weights. ``zerodp.initialize`` at stage 3 then gives each unit its values from the slices
and keeps this rank's shard of it, one unit at a time.

A parameter created after the context with values of its own (a LoRA adapter placed on its base
layer's device, a new head) keeps them: ``initialize`` shards it in place, rank 0's values. One
on the meta device in such a model has lost its values, and ``initialize`` says so, naming it.

``ShardedLoad`` (zerodp's) is ``Init`` for a 4-bit model that transformers loads: it builds a
quantized model on the meta device and skips ``Init``, so call ``from_pretrained`` inside
``ShardedLoad()`` instead, and each rank keeps only its slice of every packed weight as it loads
(``core/packed.py``).

A parameter created inside the context on the meta device (a model built with
``torch.device("meta")``) stays without values: ``initialize`` gives them, one unit at a time,
by each module's ``reset_parameters()`` and then ``param_init_fn`` or, for a ``transformers``
model, the model's own ``_init_weights``, seeded identically on every rank (see the README's
stage-3 section); PEFT's LoRA adapters added to such a model get PEFT's own initialization
(``lora_B`` zero, ``core/adapters.py``). A real tensor put in place of such a parameter (loaded weights assigned by
``load_state_dict(assign=True)``) is kept; ``initialize`` refuses a unit that mixes the two.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from .core.init_shards import ShardedConstruction
from .core.packed import ShardedLoad
from .core.param_api import GatheredParameters, register_external_parameter

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "ShardedLoad"]


def _config_dtype(config: Any) -> Optional[torch.dtype]:
    """The 16-bit dtype a config trains in (``bf16`` or ``fp16`` enabled), which the engine
    casts parameters to anyway: parameters built in ``Init`` keep their slices in it. Only those
    two keys are read: a config handed to ``Init`` may still hold ``"auto"`` values that the
    Hugging Face integration fills in later (model-dependent bucket sizes)."""
    if config is None:
        return None
    if hasattr(config, "compute_dtype"):  # a validated Config
        raw = {"bf16": {"enabled": config.bf16.enabled}, "fp16": {"enabled": config.fp16.enabled}}
    elif isinstance(config, dict):
        raw = config
    else:
        from .config.load import _read_json
        raw = _read_json(Path(config))
    enabled = {k: (raw.get(k) or {}).get("enabled") is True for k in ("bf16", "bfloat16", "fp16")}
    return torch.bfloat16 if enabled["bf16"] or enabled["bfloat16"] else torch.float16 if enabled["fp16"] else None


class Init:
    """Build the model inside this context at stage 3 (DeepSpeed's ``zero.Init``; its keyword
    arguments are accepted). ``enabled=False`` builds it normally. ``dtype``, or the 16-bit
    dtype of ``config_dict_or_path`` (``config``), is the dtype the slices are kept in.
    ``meta=True`` (zerodp's): keep no values at all, only parameters on the meta device, for a
    model whose values come later: from ``initialize`` (each unit initialized in turn, so no
    rank ever holds the whole model, not even its slices) or from weight files
    (``zerodp.inference.stream``). Buffers stay real either way. Without ``meta``, modules are
    built on the engine's device (``cuda:LOCAL_RANK`` on a GPU, as DeepSpeed's ``Init`` builds on
    the accelerator: seeded values come from that device's generator), unless the caller entered
    a device of their own (``torch.device``) around it. Parameters created inside have
    empty data on the real device (``ds_shape`` is their shape), each keeping this rank's slice of
    its values, until ``zerodp.initialize``
    shards them by units (``data_parallel_group``: the group whose ranks share the slices, the
    world by default; give ``initialize`` the same one). Buffers are real. ``module=`` (an
    existing model) needs nothing: ``initialize`` shards it at stage 3."""

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group=None,
                 mem_efficient_linear: bool = True, remote_device: Any = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None, meta: bool = False, **kwargs) -> None:
        self.enabled = enabled and module is None
        self._construction = ShardedConstruction(
            data_parallel_group, dtype or _config_dtype(config_dict_or_path or config), meta=meta)

    def __enter__(self) -> "Init":
        if self.enabled:
            self._construction.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._construction.__exit__(*exc)

"""DeepSpeed's ``deepspeed.checkpointing``: activation checkpointing.

``checkpoint(function, *args)`` recomputes ``function``'s forward during backward instead of
keeping its activations, with torch's non-reentrant ``torch.utils.checkpoint`` (which composes
with ZeRO stage 3: the recomputed forward finds its unit gathered). ``configure`` accepts
DeepSpeed's options. ``checkpoint_in_cpu`` (the config's ``cpu_checkpointing``) keeps the
checkpointed function's inputs in host memory until backward (``zerodp/offload/activations.py``);
an engine whose config has ``cpu_checkpointing`` does the same for the checkpoints its forward runs.
``partition_activations`` and ``contiguous_checkpointing`` change memory, not results, and zerodp
does not implement them: it says so once.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch.utils.checkpoint

from .offload import activations

__all__ = ["checkpoint", "configure", "is_configured", "reset", "non_reentrant_checkpoint"]

logger = logging.getLogger("zerodp")
_CONFIGURED = False
_IN_CPU = False  # checkpoint inputs to host memory, outside an engine's forward too


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: Any = None,
              contiguous_checkpointing: Any = None, num_checkpoints: Any = None,
              checkpoint_in_cpu: Any = None, synchronize: Any = None, profile: Any = None) -> None:
    """DeepSpeed's signature: ``checkpoint_in_cpu`` (or ``deepspeed_config``'s
    ``activation_checkpointing.cpu_checkpointing``) keeps checkpoint inputs in host memory; the
    other options are accepted and warned about."""
    global _CONFIGURED, _IN_CPU
    _CONFIGURED = True
    block = _activation_block(deepspeed_config)
    if checkpoint_in_cpu is None:
        checkpoint_in_cpu = block.get("cpu_checkpointing")
    if partition_activations is None:
        partition_activations = block.get("partition_activations")
    if contiguous_checkpointing is None:
        contiguous_checkpointing = block.get("contiguous_memory_optimization")
    _IN_CPU = bool(checkpoint_in_cpu)
    ignored = [name for name, value in (("partition_activations", partition_activations),
                                        ("contiguous_checkpointing", contiguous_checkpointing)) if value]
    if ignored:
        logger.warning("zerodp.checkpointing: %s not implemented: activations are kept as torch keeps "
                       "them (same results, more memory)", ", ".join(ignored))


def _activation_block(deepspeed_config: Any) -> dict:
    """The ``activation_checkpointing`` block of a config given as a dict, a JSON path or a Config."""
    if deepspeed_config is None:
        return {}
    if isinstance(deepspeed_config, str):
        import json
        with open(deepspeed_config) as f:
            deepspeed_config = json.load(f)
    if isinstance(deepspeed_config, dict):
        return dict(deepspeed_config.get("activation_checkpointing") or {})
    block = getattr(deepspeed_config, "activation_checkpointing", None)
    return block.model_dump() if hasattr(block, "model_dump") else {}


def is_configured() -> bool:
    return _CONFIGURED


def reset() -> None:
    """DeepSpeed's buffer reset between iterations: nothing to reset here."""


_OWN = activations.ActivationOffload()


def checkpoint(function: Callable, *args: Any) -> Any:
    """``function(*args)``, its activations recomputed in backward (non-reentrant); its tensor
    arguments wait in host memory when an engine's ``cpu_checkpointing`` or ``configure``'s
    ``checkpoint_in_cpu`` asks."""
    if activations.active() is not None:
        activations.mark(*args)
    elif _IN_CPU and torch.is_grad_enabled():
        with _OWN.forward():
            activations.mark(*args)
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


non_reentrant_checkpoint = checkpoint

"""DeepSpeed's ``deepspeed.checkpointing``: activation checkpointing.

``checkpoint(function, *args)`` recomputes ``function``'s forward during backward instead of
keeping its activations, with torch's non-reentrant ``torch.utils.checkpoint`` (which composes
with ZeRO stage 3: the recomputed forward finds its unit gathered). ``configure`` accepts
DeepSpeed's options; those about where activations live (``partition_activations``,
``checkpoint_in_cpu``, ``contiguous_checkpointing``) change memory, not results, and zerodp
does not implement them: it says so once.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch.utils.checkpoint

__all__ = ["checkpoint", "configure", "is_configured", "reset", "non_reentrant_checkpoint"]

logger = logging.getLogger("zerodp")
_CONFIGURED = False


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: Any = None,
              contiguous_checkpointing: Any = None, num_checkpoints: Any = None,
              checkpoint_in_cpu: Any = None, synchronize: Any = None, profile: Any = None) -> None:
    """DeepSpeed's signature. Activation checkpointing needs no set-up in zerodp."""
    global _CONFIGURED
    _CONFIGURED = True
    ignored = [name for name, value in (("partition_activations", partition_activations),
                                        ("contiguous_checkpointing", contiguous_checkpointing),
                                        ("checkpoint_in_cpu", checkpoint_in_cpu)) if value]
    if ignored:
        logger.warning("zerodp.checkpointing: %s not implemented: activations are kept as torch keeps "
                       "them (same results, more memory)", ", ".join(ignored))


def is_configured() -> bool:
    return _CONFIGURED


def reset() -> None:
    """DeepSpeed's buffer reset between iterations: nothing to reset here."""


def checkpoint(function: Callable, *args: Any) -> Any:
    """``function(*args)``, its activations recomputed in backward (non-reentrant)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


non_reentrant_checkpoint = checkpoint

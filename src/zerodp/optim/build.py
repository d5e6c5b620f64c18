"""Optimizer construction from DeepSpeed-style ``"optimizer"`` config blocks.

zerodp partitions every parameter into flat 1-D shards and lets each rank run
a plain ``torch.optim`` optimizer over its own shard.  That is only exact when
the optimizer's update is *elementwise*: the new value of each element may
depend only on that element's gradient and state (plus scalars such as the
step count and learning rate).  Adam, AdamW, SGD, Adagrad, RMSprop and friends
satisfy this; optimizers that compute norms, factorizations or line searches
over whole tensors do not, and are refused here.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

__all__ = ["optimizer_factory_from_config", "check_elementwise", "SUPPORTED_OPTIMIZERS"]


# Lower-cased DeepSpeed type name -> torch optimizer class.  "adam" is
# resolved separately because it depends on ``adam_w_mode``.
_TORCH_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
    "adamax": torch.optim.Adamax,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
    "adadelta": torch.optim.Adadelta,
}

#: DeepSpeed optimizer type names accepted by :func:`optimizer_factory_from_config`.
SUPPORTED_OPTIMIZERS: tuple[str, ...] = (
    "Adam",
    "AdamW",
    "SGD",
    "Adagrad",
    "RMSprop",
    "Adamax",
    "NAdam",
    "RAdam",
    "Adadelta",
)

# Lower-cased type names that are recognised but refused because their update
# is not elementwise.
_NON_ELEMENTWISE_TYPES: dict[str, str] = {
    "lamb": "LAMB (per-tensor trust ratio)",
    "onebitlamb": "1-bit LAMB (per-tensor trust ratio)",
    "fusedlamb": "LAMB (per-tensor trust ratio)",
    "lars": "LARS (per-tensor trust ratio)",
    "shampoo": "Shampoo (matrix preconditioners)",
    "lbfgs": "L-BFGS (line search over the full parameter vector)",
    "adafactor": "Adafactor (factored row/column second moments)",
    "muon": "Muon (whole-matrix orthogonalisation)",
}

# DeepSpeed-only keys that have no torch equivalent and are silently dropped.
_DROPPED_KEYS = ("torch_adam", "adam_w_mode", "fused", "fp32_optimizer_states", "set_grad_none")

# DeepSpeed's fused/CPU Adam kernels default weight_decay to 0.0, whereas
# torch.optim.AdamW defaults to 0.01.
_DEEPSPEED_ADAM_WEIGHT_DECAY = 0.0


def _non_elementwise_message(what: str) -> str:
    return (
        f"{what} is not supported by zerodp: zerodp shards every parameter into flat "
        "pieces owned by different ranks and runs the optimizer on each piece "
        "independently, so optimizers whose update depends on whole-tensor statistics "
        "(trust ratios, matrix preconditioners, factored moments, line searches) would "
        "produce different numbers than unsharded training. Use an elementwise "
        f"optimizer instead: {', '.join(SUPPORTED_OPTIMIZERS)}."
    )


def optimizer_factory_from_config(
    type_name: str, params: dict[str, Any] | None
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Map a DeepSpeed optimizer block to a torch optimizer class and its kwargs.

    Args:
        type_name: the block's ``"type"`` (case-insensitive), e.g. ``"Adam"``.
        params: the block's ``"params"`` dict (may be ``None``).  It is not
            modified.

    Returns:
        ``(optimizer_cls, kwargs)`` such that
        ``optimizer_cls(param_groups, **kwargs)`` builds the optimizer.

    DeepSpeed semantics that are mirrored:

    * ``"Adam"`` honours ``adam_w_mode`` which defaults to ``True``, so plain
      ``"Adam"`` means decoupled weight decay (:class:`torch.optim.AdamW`);
      ``adam_w_mode: false`` gives :class:`torch.optim.Adam`.  ``"AdamW"``
      always gives AdamW.
    * For the Adam family, ``weight_decay`` defaults to ``0.0`` (DeepSpeed's
      fused/CPU Adam default) unless ``torch_adam: true`` is set, in which case
      torch's own defaults apply, as they do in DeepSpeed.
    * DeepSpeed-only keys (``torch_adam``, ``adam_w_mode``, ``fused``,
      ``fp32_optimizer_states``, ``set_grad_none``) are dropped;
      ``bias_correction: true`` is dropped (torch always bias-corrects).
    * ``betas`` given as a list becomes a tuple.
    * ``max_grad_norm`` is rejected; use the top-level ``gradient_clipping``.

    Raises:
        ValueError: for unknown types, for optimizers whose update is not
            elementwise (LAMB, Shampoo, LBFGS, Adafactor, Muon, ...), and for
            parameters torch cannot honour.
    """
    if not isinstance(type_name, str) or not type_name:
        raise ValueError(f"optimizer type must be a non-empty string, got {type_name!r}")
    key = type_name.strip().lower().replace("-", "").replace("_", "")
    kwargs: dict[str, Any] = dict(params or {})

    if key in _NON_ELEMENTWISE_TYPES:
        raise ValueError(_non_elementwise_message(f"Optimizer type {type_name!r} ({_NON_ELEMENTWISE_TYPES[key]})"))

    if "max_grad_norm" in kwargs:
        raise ValueError(
            "'max_grad_norm' is not supported as an optimizer parameter; use the top-level "
            "'gradient_clipping' config key instead"
        )

    if key in ("adam", "adamw"):
        adam_w_mode = bool(kwargs.get("adam_w_mode", True))
        torch_adam = bool(kwargs.get("torch_adam", False))
        cls: type[torch.optim.Optimizer] = (
            torch.optim.AdamW if (key == "adamw" or adam_w_mode) else torch.optim.Adam
        )
        if "bias_correction" in kwargs:
            if not kwargs.pop("bias_correction"):
                raise ValueError(
                    "bias_correction=False is not supported: torch's Adam/AdamW always apply "
                    "bias correction"
                )
        if not torch_adam:
            kwargs.setdefault("weight_decay", _DEEPSPEED_ADAM_WEIGHT_DECAY)
    elif key in _TORCH_OPTIMIZERS:
        cls = _TORCH_OPTIMIZERS[key]
    else:
        raise ValueError(
            f"Unknown optimizer type {type_name!r}; supported types are: "
            f"{', '.join(SUPPORTED_OPTIMIZERS)} (case-insensitive)"
        )

    for k in _DROPPED_KEYS:
        kwargs.pop(k, None)
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    return cls, kwargs


# ---------------------------------------------------------------------------
# Elementwise check for user-supplied optimizer classes
# ---------------------------------------------------------------------------

_KNOWN_ELEMENTWISE: tuple[type, ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
    torch.optim.ASGD,
)

_KNOWN_NON_ELEMENTWISE: tuple[type, ...] = tuple(
    cls
    for cls in (
        torch.optim.LBFGS,
        getattr(torch.optim, "Adafactor", None),
        getattr(torch.optim, "Muon", None),
    )
    if cls is not None
)

# Class-name patterns of optimizers that use per-tensor statistics.  "Lamb" is
# not allowed to be followed by "da" so that e.g. "LambdaSGD" is not caught.
_NON_ELEMENTWISE_NAME = re.compile(r"Lamb(?!da)|LAMB|Shampoo|Lars|LARS|Muon|Adafactor")


def check_elementwise(optimizer_cls: type) -> None:
    """Check that an optimizer class is safe to run on flat parameter shards.

    Args:
        optimizer_cls: an optimizer class (an instance is also accepted and
            its type is checked).

    Raises:
        ValueError: if the class is known to compute whole-tensor statistics
            (``torch.optim.LBFGS``, ``torch.optim.Adafactor``, or a class whose
            name contains Lamb/LAMB/Shampoo/Lars/LARS/Muon/Adafactor).

    Warns:
        UserWarning: if the class is not one of the known elementwise torch
            optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam,
            RAdam, Adadelta, ASGD) or a class named ``Lion``; zerodp then
            assumes the update is elementwise per tensor.
    """
    cls = optimizer_cls if isinstance(optimizer_cls, type) else type(optimizer_cls)
    name = cls.__name__
    if (_KNOWN_NON_ELEMENTWISE and issubclass(cls, _KNOWN_NON_ELEMENTWISE)) or _NON_ELEMENTWISE_NAME.search(name):
        raise ValueError(_non_elementwise_message(f"Optimizer class {cls.__module__}.{name}"))
    if cls in _KNOWN_ELEMENTWISE or name == "Lion" or cls.__module__ == "zerodp.ops.adam":
        return
    warnings.warn(
        f"zerodp does not know optimizer class {cls.__module__}.{name}; it assumes the "
        "update is elementwise per tensor (each element's update depends only on its own "
        "gradient and state), because parameters are sharded into flat pieces across ranks. "
        "Results will differ from unsharded training if the optimizer uses whole-tensor "
        "statistics such as norms or matrix preconditioners.",
        UserWarning,
        stacklevel=2,
    )

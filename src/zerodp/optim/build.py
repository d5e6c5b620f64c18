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

import inspect
import json
import re
import types
import typing
import warnings
from typing import Any

import torch

from ..config import ConfigError
from .lion import Lion
from .muon import MuonWithAuxAdam, check_muon_params, is_muon_type

__all__ = ["optimizer_factory_from_config", "optimizer_from_config", "check_optimizer_params",
           "check_elementwise", "SUPPORTED_OPTIMIZERS", "FUSED_OPTIMIZERS"]


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
    "lion": Lion,
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
    "Lion",
    "Muon",
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
}

# DeepSpeed-only keys that have no torch equivalent and are silently dropped.
_DROPPED_KEYS = ("torch_adam", "adam_w_mode", "fused", "fp32_optimizer_states", "set_grad_none")

# DeepSpeed's fused/CPU Adam kernels default weight_decay to 0.0, whereas
# torch.optim.AdamW defaults to 0.01.
_DEEPSPEED_ADAM_WEIGHT_DECAY = 0.0


def _non_elementwise_message(what: str) -> str:
    if "muon" in what.lower():
        return (f"{what} is not supported by zerodp as a class: Muon needs each matrix whole. Use the config's "
                '"optimizer": {"type": "Muon", ...} (DeepSpeed\'s MuonWithAuxAdam, parameters tagged use_muon) or '
                "pass a torch.optim.Muon, which zerodp runs with each matrix orthogonalized by one owner rank.")
    return (
        f"{what} is not supported by zerodp: zerodp shards every parameter into flat "
        "pieces owned by different ranks and runs the optimizer on each piece "
        "independently, so optimizers whose update depends on whole-tensor statistics "
        "(trust ratios, matrix preconditioners, factored moments, line searches) would "
        "produce different numbers than unsharded training. Use an elementwise "
        f"optimizer instead: {', '.join(t for t in SUPPORTED_OPTIMIZERS if t != 'Muon')}."
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
        ConfigError (a ValueError) naming the key (``optimizer.type`` or
            ``optimizer.params.<name>``): for unknown types, for optimizers whose
            update is not elementwise (LAMB, Shampoo, LBFGS, Adafactor, Muon,
            ...), and for the DeepSpeed parameters torch cannot honour. The
            values themselves are checked by :func:`optimizer_from_config`.
    """
    if not isinstance(type_name, str) or not type_name:
        raise ConfigError(f"optimizer.type: got {_fmt(type_name)}; allowed: a non-empty string")
    key = type_name.strip().lower().replace("-", "").replace("_", "")
    kwargs: dict[str, Any] = dict(params or {})

    if key == "muon":
        raise ConfigError(f"optimizer.type: got {_fmt(type_name)}; Muon's groups come from the model's use_muon "
                          "tags: the engine builds it (optimizer_from_config with its param groups)")
    if key in _NON_ELEMENTWISE_TYPES:
        raise ConfigError(f"optimizer.type: got {_fmt(type_name)}; " + _non_elementwise_message(
            f"Optimizer type {type_name!r} ({_NON_ELEMENTWISE_TYPES[key]})"))

    if "max_grad_norm" in kwargs:
        raise ConfigError(
            f"optimizer.params.max_grad_norm: got {_fmt(kwargs['max_grad_norm'])}; 'max_grad_norm' is "
            "not supported as an optimizer parameter; use the top-level 'gradient_clipping' config key instead"
        )

    if key in ("adam", "adamw"):
        adam_w_mode = bool(kwargs.get("adam_w_mode", True))
        torch_adam = bool(kwargs.get("torch_adam", False))
        cls: type[torch.optim.Optimizer] = (
            torch.optim.AdamW if (key == "adamw" or adam_w_mode) else torch.optim.Adam
        )
        if "bias_correction" in kwargs:
            value = kwargs.pop("bias_correction")
            if value is not True:
                raise ConfigError(
                    f"optimizer.params.bias_correction: got {_fmt(value)}; allowed: true (torch's "
                    "Adam/AdamW always apply bias correction; bias_correction=False is not supported)"
                )
        if not torch_adam:
            kwargs.setdefault("weight_decay", _DEEPSPEED_ADAM_WEIGHT_DECAY)
    elif key in _TORCH_OPTIMIZERS:
        cls = _TORCH_OPTIMIZERS[key]
    else:
        raise ConfigError(
            f"optimizer.type: got {_fmt(type_name)}; Unknown optimizer type {type_name!r}; supported types are: "
            f"{', '.join(SUPPORTED_OPTIMIZERS)} (case-insensitive)"
        )

    for k in _DROPPED_KEYS:
        kwargs.pop(k, None)
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    return cls, kwargs


# ---------------------------------------------------------------------------
# Building the config's optimizer: every mistake named by its config key
# ---------------------------------------------------------------------------

#: Optimizers built from the config with ``fused=True`` (torch's fused kernels, on CPU and CUDA;
#: its fused SGD fails without momentum): the step reads and writes each state once, at about
#: the memory's bandwidth.
FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)

#: Words in torch optimizers' error messages -> the parameter they are about (used only when
#: trying the parameters one at a time cannot tell which value is at fault).
_PARAM_WORDS = (("learning rate", "lr"), ("epsilon", "eps"), ("beta", "betas"), ("weight decay", "weight_decay"),
                ("momentum", "momentum"), ("dampening", "dampening"), ("alpha", "alpha"), ("rho", "rho"))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether ``value`` fits a constructor parameter's type annotation (the forms torch's
    optimizers use: float, int, bool, Tensor, None, unions, fixed-length tuples). Forms it does
    not know accept anything: the constructor itself judges those."""
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is float:
        return _is_number(value)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is torch.Tensor:
        return isinstance(value, torch.Tensor)
    if annotation is None or annotation is type(None):
        return value is None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in args)
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return isinstance(value, (list, tuple)) and all(_accepts(args[0], v) for v in value)
        return (isinstance(value, (list, tuple)) and len(value) == len(args)
                and all(_accepts(a, v) for a, v in zip(args, value)))
    return True


def _describe(annotation: Any) -> str:
    """``annotation`` in a config's terms (JSON values; tensors are left out)."""
    if annotation is bool:
        return "true or false"
    if annotation in (float, int):
        return "a number" if annotation is float else "an integer"
    if annotation is None or annotation is type(None):
        return "null"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(a) for a in args if a is not torch.Tensor]
        return " or ".join(dict.fromkeys(p for p in parts if p))
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
        kinds = {_describe(a) for a in args}
        if kinds == {"a number"}:
            return f"a list of {len(args)} numbers"
        return f"a list of {len(args)} values"
    return ""


def _annotation_from_default(default: Any) -> Any:
    """A stand-in annotation for a parameter that has none, from its default value."""
    if isinstance(default, bool):
        return bool
    if _is_number(default):
        return float
    if isinstance(default, tuple) and default and all(_is_number(d) for d in default):
        return tuple[(float,) * len(default)]
    return inspect.Parameter.empty


def _constructor_params(cls: type) -> tuple[dict[str, tuple[Any, Any]], bool]:
    """``({name: (annotation, default)}, takes_any_keyword)`` of ``cls(params, ...)``."""
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return {}, True
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable string annotations: fall back to the defaults
        hints = {}
    out, any_keyword = {}, False
    for i, (name, p) in enumerate(sig.parameters.items()):
        if p.kind is p.VAR_KEYWORD:
            any_keyword = True
            continue
        if i < 2 or p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY):  # self, params
            continue
        annotation = hints.get(name, p.annotation)
        if annotation is inspect.Parameter.empty or isinstance(annotation, str):
            annotation = _annotation_from_default(p.default)
        out[name] = (annotation, p.default)
    return out, any_keyword


def _key(name: str) -> str:
    return f"optimizer.params.{name}"


def _fmt(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def check_optimizer_params(cls: type, kwargs: dict[str, Any], type_name: str) -> None:
    """Check each of ``kwargs`` (from the config's ``optimizer.params``) against ``cls``'s
    constructor: the name must be one of its parameters, and the value must have the type and
    shape its annotation (or, without one, its default) says (a number, true or false, a list
    of two numbers for ``betas``, ...). Raises :class:`ConfigError` naming the key, the value
    and what is allowed."""
    accepted, any_keyword = _constructor_params(cls)
    for name, value in kwargs.items():
        if name not in accepted:
            if any_keyword:
                continue
            raise ConfigError(f"{_key(name)}: got {_fmt(value)}; allowed: only {type_name}'s parameters "
                              f"({', '.join(accepted)})")
        annotation, default = accepted[name]
        if annotation is inspect.Parameter.empty or _accepts(annotation, value):
            continue
        text = _describe(annotation) or "a value of the parameter's type"
        shown = f", default {_fmt(default)}" if default is not inspect.Parameter.empty else ""
        raise ConfigError(f"{_key(name)}: got {_fmt(value)}; allowed: {text} ({type_name}'s {name}{shown})")


def _constructs(cls: type, kwargs: dict[str, Any]) -> bool:
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
    except Exception:  # noqa: BLE001 - any failure counts
        return False
    return True


def _blame(cls: type, kwargs: dict[str, Any], message: str) -> str | None:
    """The parameter whose value made ``cls(..., **kwargs)`` fail with ``message``: the one whose
    removal (its default taking its place) lets the constructor succeed on a stand-in
    parameter; failing that, the one the message names or describes."""
    for name in kwargs:
        if _constructs(cls, {k: v for k, v in kwargs.items() if k != name}):
            return name
    for name in sorted(kwargs, key=len, reverse=True):
        if re.search(rf"\b{re.escape(name)}\b", message):
            return name
    low = message.lower()
    for words, name in _PARAM_WORDS:
        if words in low and name in kwargs:
            return name
    return None


def _rejected(cls: type, kwargs: dict[str, Any], type_name: str, exc: BaseException) -> ConfigError:
    detail = f"{type(exc).__name__}: {exc}" if not isinstance(exc, (ValueError, TypeError)) else str(exc)
    name = _blame(cls, kwargs, str(exc))
    if name is None:
        return ConfigError(f"optimizer.params: got {_fmt(kwargs)}; {type_name} rejects it: {detail}")
    return ConfigError(f"{_key(name)}: got {_fmt(kwargs[name])}; {type_name} rejects it: {detail}")


def optimizer_from_config(type_name: str, params: dict[str, Any] | None,
                          param_groups: list | None = None) -> torch.optim.Optimizer:
    """Build the config's optimizer (``{"type": type_name, "params": params}``) on
    ``param_groups`` (default: one stand-in parameter, to check the block before anything
    else runs).

    Every problem with the block raises :class:`ConfigError` naming the key at fault
    (``optimizer.type`` or ``optimizer.params.<name>``) and its value: an unknown or refused
    type; a parameter the optimizer does not take; a value of the wrong type or shape
    (:func:`check_optimizer_params`); and anything the constructor itself raises, traced back
    to the parameter whose value it is about by building the optimizer on a stand-in
    parameter with that value replaced by its default. Adam and AdamW are built with
    ``fused=True`` where torch has the kernel (unless the block says ``foreach``).
    """
    if is_muon_type(type_name):  # Muon's own keys; its halves are the groups' use_muon
        check_muon_params(dict(params or {}))
        adam_w_mode = (params or {}).get("adam_w_mode", True)
        probe_groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "use_muon": False}]
        return MuonWithAuxAdam(param_groups if param_groups is not None else probe_groups, adam_w_mode=adam_w_mode)
    try:
        cls, kwargs = optimizer_factory_from_config(type_name, dict(params or {}))
        check_elementwise(cls)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"optimizer: {e}") from None
    check_optimizer_params(cls, kwargs, type_name)
    probe = [torch.nn.Parameter(torch.zeros(1))]
    try:
        cls(probe, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the class makes of the values
        raise _rejected(cls, kwargs, type_name, e) from None
    groups = param_groups if param_groups is not None else probe
    try:
        if cls in FUSED_OPTIMIZERS and "fused" not in kwargs and "foreach" not in kwargs:
            try:  # one kernel over all pieces: ~6x torch's default CPU step (benchmarks/offload.py)
                return cls(groups, **kwargs, fused=True)
            except RuntimeError:  # a device or dtype without a fused kernel
                pass
        return cls(groups, **kwargs)
    except (ValueError, TypeError) as e:  # the values passed on a stand-in: a param group's own
        raise ConfigError(f"optimizer: {type_name} rejects the parameter groups: {e}") from None


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
    if getattr(cls, "whole_matrices", False) and cls.__module__.startswith("zerodp."):
        return  # zerodp's Muon: brings each matrix whole to one rank (optim/muon.py)
    if (_KNOWN_NON_ELEMENTWISE and issubclass(cls, _KNOWN_NON_ELEMENTWISE)) or _NON_ELEMENTWISE_NAME.search(name):
        raise ValueError(_non_elementwise_message(f"Optimizer class {cls.__module__}.{name}"))
    if cls in _KNOWN_ELEMENTWISE or name == "Lion" or cls.__module__.startswith("zerodp.ops."):
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

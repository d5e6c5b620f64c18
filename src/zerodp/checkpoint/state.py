"""Everything a checkpoint holds besides parameters and optimizer tensors, as JSON plus tensors.

Loading a checkpoint never unpickles. Python values are stored as JSON; tensors inside them
(a client state holding a tensor, the torch RNG state) go to a tensor file and are replaced
in the JSON by a reference. :func:`encode` / :func:`decode` do this for nested dicts, lists and
tuples of JSON scalars and tensors, keeping what JSON alone would lose (tuples, dict keys
that are not strings). A few plain types that training scripts put there are kept too, without
pickling: ``argparse.Namespace`` (``client_state={"args": args}``), paths (back as
``pathlib.Path``), NumPy arrays (back as arrays) and NumPy scalars (back as Python numbers).
Anything else is refused at save time, naming where it sits.

RNG states (:func:`capture_rng` / :func:`restore_rng`): Python's ``random``, NumPy's global
generator (when NumPy is loaded), torch's CPU generator and every initialized CUDA device's.
"""
from __future__ import annotations

import argparse
import math
import pathlib
import random
import sys
from typing import Any

import torch

from .source import CheckpointError

_TENSOR, _TUPLE, _DICT, _FLOAT = "__tensor__", "__tuple__", "__dict__", "__float__"
_PATH, _NAMESPACE, _NDARRAY = "__path__", "__namespace__", "__ndarray__"
_MARKERS = (_TENSOR, _TUPLE, _DICT, _FLOAT, _PATH, _NAMESPACE, _NDARRAY)


def encode(value: Any, tensors: dict[str, torch.Tensor], prefix: str, where: str = "client_state") -> Any:
    """``value`` as JSON-compatible data; its tensors are added to ``tensors`` under keys that
    start with ``prefix`` (CPU copies). Raises TypeError naming the path of a value that is
    neither a JSON scalar, a tensor, nor a list, tuple or dict of those."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {_FLOAT: repr(value)}
    if isinstance(value, torch.Tensor):
        key = f"{prefix}{len(tensors)}"
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {_TENSOR: key}
    if isinstance(value, torch.Size):
        value = tuple(value)
    if isinstance(value, pathlib.PurePath):
        return {_PATH: str(value)}
    if isinstance(value, argparse.Namespace):
        return {_NAMESPACE: encode(vars(value), tensors, prefix, where)}
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic) and not isinstance(value, (np.object_, np.void)):
        return encode(value.item(), tensors, prefix, where)
    if np is not None and isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        key = f"{prefix}{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(value).copy())
        return {_NDARRAY: key}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {_TUPLE: [encode(v, tensors, prefix, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, tensors, prefix, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        plain = all(isinstance(k, str) for k in value) and not any(k in _MARKERS for k in value)
        if plain:
            return {k: encode(v, tensors, prefix, f"{where}[{k!r}]") for k, v in value.items()}
        return {_DICT: [[encode(k, tensors, prefix, f"{where} key {k!r}"),
                         encode(v, tensors, prefix, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise TypeError(f"{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be stored in "
                    "a checkpoint, which holds JSON values (numbers, strings, booleans, None, lists, "
                    "tuples, dicts), tensors, NumPy arrays, paths and argparse.Namespace only, so that "
                    "loading never unpickles; convert it to those (e.g. a state_dict() of plain values)")


def decode(value: Any, tensors: "TensorLookup") -> Any:
    """The inverse of :func:`encode`; ``tensors(key)`` returns a stored tensor."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (k, v), = value.items()
            if k == _TENSOR:
                return tensors(v)
            if k == _TUPLE:
                return tuple(decode(x, tensors) for x in v)
            if k == _DICT:
                return {_hashable(decode(a, tensors)): decode(b, tensors) for a, b in v}
            if k == _FLOAT:
                return float(v)
            if k == _PATH:
                return pathlib.Path(v)
            if k == _NAMESPACE:
                return argparse.Namespace(**decode(v, tensors))
            if k == _NDARRAY:
                return tensors(v).numpy()
        return {k: decode(v, tensors) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


TensorLookup = Any  # Callable[[str], torch.Tensor]


def tensor_keys(value: Any) -> list[str]:
    """The tensor keys an encoded value refers to."""
    found: list[str] = []
    if isinstance(value, list):
        for v in value:
            found += tensor_keys(v)
    elif isinstance(value, dict):
        if len(value) == 1 and (_TENSOR in value or _NDARRAY in value):
            return [value.get(_TENSOR, value.get(_NDARRAY))]
        for v in value.values():
            found += tensor_keys(v)
    return found


# -- RNG states --------------------------------------------------------------------------------

def capture_rng(tensors: dict[str, torch.Tensor], prefix: str = "rng.") -> dict:
    """This process's RNG states: JSON, with the torch generator states added to ``tensors``."""
    state: dict[str, Any] = {"python": encode(random.getstate(), tensors, prefix, "random state")}
    tensors[prefix + "torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states = torch.cuda.get_rng_state_all()
        for i, s in enumerate(states):
            tensors[f"{prefix}cuda{i}"] = s
        state["cuda_devices"] = len(states)
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return state


def restore_rng(state: dict, tensors: TensorLookup, prefix: str = "rng.") -> None:
    """Put back the RNG states :func:`capture_rng` recorded."""
    try:
        random.setstate(_as_tuple(decode(state["python"], tensors)))
        torch.set_rng_state(tensors(prefix + "torch"))
        n = int(state.get("cuda_devices", 0))
        if n and torch.cuda.is_available():
            count = min(n, torch.cuda.device_count())
            torch.cuda.set_rng_state_all([tensors(f"{prefix}cuda{i}") for i in range(count)])
        if "numpy" in state and "numpy" in sys.modules:
            import numpy as np
            s = state["numpy"]
            np.random.set_state((s["kind"], np.array(s["keys"], dtype=np.uint32), s["pos"],
                                 s["has_gauss"], s["gauss"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"the checkpoint's RNG state cannot be restored: {e}") from None


def _as_tuple(v: Any) -> Any:
    return tuple(_as_tuple(x) for x in v) if isinstance(v, (list, tuple)) else v

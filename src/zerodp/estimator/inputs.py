"""The estimator's inputs: :class:`EstimateError`, parameter counts and memory sizes read from
text (``7.5B``, ``80GB``), whole numbers, and the config schema's defaults for the buffer sizes."""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Optional, Union

from ..config import ZeroConfig

GB = 10**9

_ZERO_DEFAULTS = ZeroConfig.model_fields
DEFAULT_REDUCE_BUCKET = int(_ZERO_DEFAULTS["reduce_bucket_size"].default)
DEFAULT_MAX_LIVE = int(_ZERO_DEFAULTS["stage3_max_live_parameters"].default)
DEFAULT_PERSISTENCE = int(_ZERO_DEFAULTS["stage3_param_persistence_threshold"].default)


class EstimateError(ValueError):
    """Input the estimator cannot use. ``name`` is the input (an argument of :func:`estimate`,
    e.g. ``device_memory``); the message says what was wrong and what is allowed."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name, self.detail = name, message


_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_MEMORY_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_NUMBER = r"((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"


def _scaled(number: str, multiplier: int) -> Optional[int]:
    """``number * multiplier`` if it is a whole number, else None (exact decimal arithmetic)."""
    try:
        value = Decimal(number) * multiplier
    except InvalidOperation:
        return None
    if value.adjusted() > 30:  # far beyond any real model or memory; int() of it could be huge
        return None
    return int(value) if value == value.to_integral_value() else None


def parse_count(text: str, name: str = "model") -> int:
    """A parameter count: ``8B``, ``7.5B``, ``350M``, ``125K``, ``1.2T``, ``5e8`` or a plain
    integer (K = 1e3, M = 1e6, B = G = 1e9, T = 1e12)."""
    m = re.fullmatch(r"\s*" + _NUMBER + r"\s*([KMBGT]?)\s*", str(text), re.IGNORECASE)
    value = _scaled(m.group(1), _COUNT_SUFFIX[m.group(2).upper()]) if m else None
    if value is None or value <= 0:
        raise EstimateError(name, f"{text!r} is not a count; allowed: a positive whole number, "
                                  "optionally with K, M, B or T (e.g. 8B, 7.5B, 350M, 125K, 5e8)")
    return value


def parse_memory(text: Union[str, int], name: str = "device_memory") -> int:
    """Bytes from ``80GB``, ``24GiB``, ``512MB``, ... (KB/MB/GB/TB are powers of 1000,
    KiB/MiB/GiB/TiB powers of 1024); an int is taken as bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text > 0:
            return text
        raise EstimateError(name, f"{text} bytes; allowed: a positive size")
    m = re.fullmatch(r"\s*" + _NUMBER + r"\s*([KMGT]I?B|B)\s*", str(text), re.IGNORECASE)
    value = _scaled(m.group(1), _MEMORY_UNITS[m.group(2).upper()]) if m else None
    if value is None or value <= 0:
        raise EstimateError(name, f"{text!r} is not a memory size; allowed: a positive number with "
                            "a unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
                            "(powers of 1024), e.g. 80GB or 24GiB")
    return value


def _positive_int(value: Any, name: str) -> int:
    """A positive whole number from an int or a string of digits."""
    if isinstance(value, str) and re.fullmatch(r"\s*\+?\d+\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EstimateError(name, f"{value!r}; allowed: a positive whole number")
    return value


def _element_count(value: Any, name: str) -> int:
    """A positive number of elements: an int, or a string such as ``5e8`` or ``500M``."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    try:
        return parse_count(str(value), name)
    except EstimateError:
        raise EstimateError(name, f"{value!r}; allowed: a positive whole number of elements "
                            "(e.g. 500000000, 5e8 or 500M)") from None


def _num(n: int) -> str:
    return f"{n:,}"


def _gb(b: Optional[int]) -> str:
    """Bytes in GB (1e9) with one decimal, or in MB, KB or bytes when below 0.1 GB."""
    if b is None:
        return "?"
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if b >= size // 10:
            return f"{b / size:.1f} {unit}"
    return f"{b} bytes"

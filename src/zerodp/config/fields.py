"""The field types every config block uses, and the blocks' base class: whole-number fields
that take ``2e8``, fields that allow one value only, and :class:`ConfigError`."""
from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """An invalid zerodp / DeepSpeed-style configuration."""


def _int_type(minimum: int = 0, allowed: tuple[int, ...] | None = None, auto: bool = False) -> Any:
    """An int field that also takes whole floats (``2e8``) but rejects bools and fractions.

    With ``auto``, ``"auto"`` and null are accepted too (DeepSpeed batch-size keys).
    """
    text = ", ".join(map(str, allowed)) if allowed else f"an integer >= {minimum}"
    text += ', "auto" or null' if auto else ""

    def check(v: Any) -> Any:
        if auto and v in (None, "auto"):
            return v
        whole = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
        if isinstance(v, bool) or not whole or v < minimum or (allowed and v not in allowed):
            raise ValueError(f"allowed: {text}")
        return int(v)

    kind = Union[int, Literal["auto"], None] if auto else int
    return Annotated[kind, BeforeValidator(check)]


def _only(value: Any, why: str) -> AfterValidator:
    """Reject any value but ``value``: zerodp lacks the feature and ignoring it would change results."""

    def check(v: Any) -> Any:
        if v != value:
            raise ValueError(f"allowed: {_fmt(value)}; {why}")
        return v

    return AfterValidator(check)


_NO_AMP = ("Apex AMP is not supported; use \"bf16\": {\"enabled\": true} or \"fp16\": {\"enabled\": true}, "
           "and ignoring it would change the numbers")
_NO_GRAD_OP = "not implemented in zerodp, and ignoring it would change the gradients"

_Stage = _int_type(allowed=(0, 1, 2, 3))
_Positive = _int_type(minimum=1)
_NonNegative = _int_type(minimum=0)
_BatchValue = _int_type(minimum=1, auto=True)


def _never_if_infinite(v: Any) -> Any:
    """``steps_per_print``: infinity (what Accelerate writes when no value is given) means never."""
    return None if isinstance(v, float) and v == float("inf") else v


_Period = Annotated[Union[_Positive, None], BeforeValidator(_never_if_infinite)]


class _Section(BaseModel):
    """Base for config blocks: unknown keys are kept (and warned about by :class:`Config`)."""

    model_config = ConfigDict(extra="allow", validate_default=True)
    warn_unknown_keys: ClassVar[bool] = True


def _fmt(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)

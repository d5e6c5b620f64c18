"""Mixed precision: which dtype each tensor lives in, and fp16 dynamic loss scaling.

With ``bf16`` or ``fp16`` enabled (see ``PrecisionPolicy``):

* parameters are cast to the 16-bit *compute* dtype and forward and backward run in it;
  floating-point buffers are cast too, except those of batch-normalization layers, which keep
  fp32 parameters and running statistics (their kernels accept 16-bit inputs with fp32
  statistics, and 16-bit running averages stall);
* floating-point tensor inputs of ``engine(...)`` are cast to the compute dtype (integer
  inputs such as token ids are left alone); outputs are what the model returns, so in the
  compute dtype;
* gradients are kept between backward and step in the *gradient* dtype (the compute dtype,
  or ``data_types.grad_accum_dtype``) and reduced across ranks in the *communication* dtype
  (``communication_data_type``, by default the gradient dtype);
* each rank keeps fp32 master weights for the part of the parameters it updates (all of them
  at stage 0, its shard from stage 1 on); the optimizer updates the masters in fp32 with fp32
  gradients, and the result is written back into the 16-bit parameters.

fp16 also scales the loss (``LossScaler``) so small gradients do not flush to zero; the
gradients are unscaled in fp32 before clipping, the reported norm and the update.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .flat import set_param_data
from .packed import is_packed

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of one engine (see module docstring)."""

    compute: torch.dtype
    grad_accum: Optional[torch.dtype] = None
    """Gradient dtype between backward and step; None: each group's parameter dtype."""
    communication: Optional[torch.dtype] = None
    """Reduction dtype; None: each group's gradient dtype."""

    @classmethod
    def from_config(cls, config) -> "PrecisionPolicy":
        name = config.data_types.grad_accum_dtype
        comm = config.communication_data_type
        return cls(compute=DTYPES[config.compute_dtype],
                   grad_accum=DTYPES[name] if name else None,
                   communication=DTYPES[comm] if comm else None)

    @property
    def mixed(self) -> bool:
        """Whether parameters are cast to a 16-bit dtype with fp32 masters."""
        return self.compute != torch.float32

    def keeps_master(self, param_dtype: torch.dtype) -> bool:
        """Whether groups of ``param_dtype`` get an fp32 master copy for the optimizer (16-bit
        groups under mixed precision; fp32 groups such as batch norm update in place)."""
        return self.mixed and param_dtype != torch.float32

    def grad_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of ``param_dtype`` parameters are kept in (fp32 groups such as
        batch normalization stay fp32)."""
        if self.grad_accum is None or param_dtype == torch.float32:
            return param_dtype
        return self.grad_accum

    def comm_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients kept in ``grad_dtype`` are reduced in."""
        return self.communication or grad_dtype

    def cast_model(self, model: nn.Module) -> None:
        """Cast floating-point parameters and buffers to the compute dtype, in place
        (parameter objects keep their identity); batch-norm layers stay fp32, and packed 4-bit
        weights keep their storage dtype (their data are codes, ``core/packed.py``)."""
        if not self.mixed:
            return
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._NormBase):
                continue
            for p in module.parameters(recurse=False):
                if p.is_floating_point() and p.dtype != self.compute and not is_packed(p):  # codes: not numbers
                    set_param_data(p, p.data.to(self.compute))
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point() and buf.dtype != self.compute:
                    module._buffers[name] = buf.to(self.compute)

    def cast_inputs(self, value: Any) -> Any:
        """``value`` with floating-point tensors (also inside tuples, lists and dicts) cast to
        the compute dtype."""
        if not self.mixed:
            return value
        if isinstance(value, torch.Tensor):
            return value.to(self.compute) if value.is_floating_point() else value
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            return type(value)(*(self.cast_inputs(v) for v in value))
        if isinstance(value, (tuple, list)):
            return type(value)(self.cast_inputs(v) for v in value)
        if isinstance(value, dict):
            return type(value)((k, self.cast_inputs(v)) for k, v in value.items())
        return value


class LossScaleAtMinimumError(RuntimeError):
    """fp16 gradients overflow although the loss scale is already at ``min_loss_scale``."""


class LossScaler:
    """fp16 loss scale: static, or dynamic with DeepSpeed's rules.

    Dynamic: start at ``2**initial_scale_power``. An overflow (inf or NaN in any gradient on
    any rank) skips the step; the first ``hysteresis - 1`` overflows only use up hysteresis, and
    from then on every overflow halves the scale (never below ``min_loss_scale``). After
    ``loss_scale_window`` consecutive steps without overflow the scale doubles and hysteresis
    is restored (with ``consecutive_hysteresis``, after every step without overflow).
    DeepSpeed 0.19 applies the same rules but doubles one step later (after window + 1 clean
    steps). An overflow at
    the minimum scale raises :class:`LossScaleAtMinimumError`: something other than the scale
    is wrong, and skipping steps forever would hide it. The engine asks for that error to be
    held back (``update(overflow, defer=True)``) and raises it with :meth:`raise_deferred` once
    it has skipped the step like any other overflow: gradients dropped, the step counted as
    skipped. So the error reports the bad batch and leaves nothing behind: the next clean step
    trains, with no ``zero_grad()`` needed.
    """

    def __init__(self, *, static_scale: float = 0.0, initial_scale_power: int = 16,
                 window: int = 1000, hysteresis: int = 2, min_scale: float = 1.0,
                 consecutive_hysteresis: bool = False) -> None:
        self.dynamic = static_scale == 0
        self.scale = float(2 ** initial_scale_power) if self.dynamic else float(static_scale)
        self.window, self.hysteresis, self.min_scale = window, hysteresis, min_scale
        self.consecutive_hysteresis = consecutive_hysteresis
        self.hysteresis_left = hysteresis
        self.good_steps = 0
        self.overflows = 0
        self._deferred: Optional[LossScaleAtMinimumError] = None

    @classmethod
    def from_config(cls, fp16) -> "LossScaler":
        return cls(static_scale=fp16.loss_scale, initial_scale_power=fp16.initial_scale_power,
                   window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                   min_scale=fp16.min_loss_scale, consecutive_hysteresis=fp16.consecutive_hysteresis)

    def update(self, overflow: bool, defer: bool = False) -> None:
        """Account one step; ``overflow``: its gradients held inf or NaN on some rank.

        An overflow at the minimum scale raises :class:`LossScaleAtMinimumError`; with
        ``defer``, the caller promises to skip the step and drop its gradients, and the error,
        saying so, is kept for :meth:`raise_deferred` instead."""
        if overflow:
            self.overflows += 1
            self.good_steps = 0
            if not self.dynamic:
                return
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
                return
            if self.scale <= self.min_scale:
                done = (" This step was skipped and its gradients dropped, so training can go on "
                        "with the next batch." if defer else "")
                error = LossScaleAtMinimumError(
                    f"fp16 gradients overflowed (inf or NaN) at the minimum loss scale "
                    f"{self.min_scale:g} (fp16.min_loss_scale): lowering the scale cannot help.{done} "
                    "Look for inf/NaN in the inputs or the loss, lower the learning rate, or use "
                    "bf16, whose range does not need loss scaling.")
                if not defer:
                    raise error
                self._deferred = error
                return
            self.scale = max(self.scale / 2, self.min_scale)
            return
        self.good_steps += 1
        if not self.dynamic:
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.good_steps % self.window == 0:
            self.scale *= 2
            self.hysteresis_left = self.hysteresis

    def raise_deferred(self) -> None:
        """Raise the error ``update(..., defer=True)`` kept, if any (once)."""
        error, self._deferred = self._deferred, None
        if error is not None:
            raise error

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left,
                "good_steps": self.good_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` (the settings stay those of this run's config)."""
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))
        self.good_steps = int(state.get("good_steps", 0))
        self.overflows = int(state.get("overflows", 0))

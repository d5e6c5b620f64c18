"""The ``compile`` block: DeepSpeed's settings for ``engine.compile()``.

DeepSpeed's keys are all about DeepCompile, its own graph passes (ZeRO-1 and ZeRO-3 traced into
the compiled graph, activation and state offload, its ``autosp``/``autotp`` passes). zerodp has no
such passes: ``engine.compile()`` runs ``torch.compile`` over the model with the engine's gather,
release and prefetch hooks outside the compiled regions (docs/training.md, "Compiling"). The keys
are accepted with DeepSpeed's defaults; ``debug_log`` does what its name says; DeepCompile's
switches (``deepcompile``, ``passes`` and the pass flags), when set, warn once, saying what runs
instead; its tuning values (thresholds, buffering) have no effect.
"""
from __future__ import annotations

import warnings
from typing import Literal, Optional

from pydantic import Field, model_validator

from .fields import _NonNegative, _Section

__all__ = ["CompileConfig"]

_INSTEAD = ("zerodp has no DeepCompile passes: engine.compile() runs torch.compile over the model, with the "
            "engine's gather, release and prefetch hooks outside the compiled regions (docs/training.md)")
_NOT_DEEPCOMPILE = ("autoep_non_moe", "free_activation", "offload_activation", "offload_opt_states", "symmetric_memory",
                    "offload_parameters", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
                    "sync_after_allgather", "keep_all_input_tensors")


class CompileConfig(_Section):
    """The ``compile`` block (DeepSpeed's ``CompileConfig``; read when ``engine.compile()`` runs)."""

    deepcompile: bool = Field(False, description="DeepSpeed's DeepCompile. zerodp has none: warned when true; "
                                                 "engine.compile() runs torch.compile with the engine's hooks "
                                                 "outside the compiled regions either way.")
    autoep_non_moe: bool = Field(False, description="DeepSpeed's AutoEP-only compile mode; warned when true "
                                                    "(zerodp compiles the whole model, expert layers included).")
    free_activation: bool = Field(False, description="DeepCompile pass; warned when true, no effect.")
    free_activation_threshold: _NonNegative = Field(10 * 1024 * 1024,
                                                    description="DeepCompile pass setting; no effect.")
    offload_activation: bool = Field(False, description="DeepCompile pass; warned when true, no effect (zerodp's "
                                                        "activation offload is activation_checkpointing."
                                                        "cpu_checkpointing).")
    offload_activation_pin_memory: bool = Field(True, description="DeepCompile pass setting; no effect.")
    offload_opt_states: bool = Field(False, description="DeepCompile pass; warned when true, no effect (zerodp's "
                                                        "is zero_optimization.offload_optimizer).")
    double_buffer: bool = Field(True, description="DeepCompile setting; no effect.")
    symmetric_memory: bool = Field(False, description="DeepCompile setting; warned when true, no effect.")
    debug_log: bool = Field(False, description="Log each graph break and recompilation that torch.compile makes "
                                               "(torch's graph_breaks and recompiles logs), from engine.compile() "
                                               "on.")
    offload_parameters: bool = Field(False, description="DeepCompile pass; warned when true, no effect (zerodp's "
                                                        "is zero_optimization.offload_param).")
    sync_before_reduce: bool = Field(False, description="DeepCompile setting; warned when true, no effect.")
    sync_after_reduce: bool = Field(False, description="DeepCompile setting; warned when true, no effect.")
    sync_before_allgather: bool = Field(False, description="DeepCompile setting; warned when true, no effect.")
    sync_after_allgather: bool = Field(False, description="DeepCompile setting; warned when true, no effect.")
    keep_int_input_tensors: bool = Field(True, description="DeepCompile setting; no effect.")
    keep_all_input_tensors: bool = Field(False, description="DeepCompile setting; warned when true, no effect.")
    passes: Optional[list[Literal["z1", "z3", "autosp", "autotp"]]] = Field(
        None, description="DeepCompile's passes; warned when given, none runs.")

    @model_validator(mode="after")
    def _warn_deepcompile(self) -> "CompileConfig":
        on = [k for k in ("deepcompile",) + _NOT_DEEPCOMPILE if getattr(self, k)]
        if self.passes:
            on.append(f"passes {self.passes}")
        if on:
            warnings.warn(f"compile: {', '.join(on)}: {_INSTEAD}", UserWarning, stacklevel=2)
        return self

"""DeepSpeed's ``deepspeed.runtime.zero.parameter_offload``: ``DeepSpeedZeRoOffload``, the stage-3
object DeepSpeed hangs on ``engine.optimizer.parameter_offload``.

TRL reaches it around generation (``unwrap_model_for_generation``): it gathers every parameter
(``GatheredParameters``), removes the module hooks listed in ``forward_hooks`` and
``backward_hooks``, generates, then asks for the hooks back (``_register_deepspeed_module``) and
invalidates the recorded fetch order (``param_coordinator``). zerodp's hooks on the model's
units stay in place instead (none are listed): each forward of ``generate`` gathers and
releases units as evaluation does, which is correct with or without the surrounding gather,
and ``_register_deepspeed_module`` has nothing to restore. Invalidating the trace makes the
engine record its units' order afresh in the next forward (``ShardedParams.invalidate``)."""
from __future__ import annotations

import types
from typing import Any

from ...core.param_api import external_users


class _ParamCoordinator:
    """``param_coordinator``: the recorded fetch order, as TRL queries and resets it."""

    def __init__(self, sharded: Any) -> None:
        self._sharded = sharded  # the engine's ShardedParams (core/sharded.py)

    def is_invalid_trace(self) -> bool:
        return not self._sharded.recorded

    def _invalidate_trace(self) -> None:
        self._sharded.invalidate()


class DeepSpeedZeRoOffload:
    """The face of a stage-3 engine's parameter management that TRL touches."""

    def __init__(self, module: Any, sharded: Any) -> None:
        self.module = module
        self.forward_hooks: list = []   # zerodp's unit hooks are not removed (see the module docstring)
        self.backward_hooks: list = []
        self.param_coordinator = _ParamCoordinator(sharded)

    def _register_deepspeed_module(self, module: Any, count: Any = None) -> None:
        """Put the module hooks back after generation: they were never removed."""


def attach(engine: Any) -> None:
    """Give a stage-3 engine DeepSpeed's parameter-management face: ``engine.optimizer.
    parameter_offload``, ``module.ds_external_parameters()`` on every module of the model (the
    parameters ``register_external_parameter`` gave it, as ``(name, param)`` pairs)."""
    if engine.optimizer is not None:
        engine.optimizer.parameter_offload = DeepSpeedZeRoOffload(engine.module, engine.sharded)
    external = {id(m): params for m, params in external_users(engine.module)}
    for m in engine.module.modules():
        pairs = [(f"external{i}", p) for i, p in enumerate(external.get(id(m), []))]
        m.ds_external_parameters = types.MethodType(lambda self, pairs=pairs: list(pairs), m)

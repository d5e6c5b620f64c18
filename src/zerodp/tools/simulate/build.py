"""The model one simulated rank builds: only what that rank would hold, with zeros for values.

* Stage 3 without tensor parallelism: built inside ``zero.Init(meta=True)`` (parameters on the
  meta device, buffers real); ``initialize`` materializes one unit at a time and keeps this
  rank's shard, so the whole model never exists here.
* Stages 0-2: every parameter is real (those stages keep the full parameters), allocated in the
  dtype the engine trains in.
* Tensor parallelism: the model is split over the grid's tensor axis while it is still on the
  meta device, then each parameter's local slice is allocated, so a rank holds its 1/T slice.
* Pipeline stages: the layers of this rank's stage only (``pipeline.py``).

Values are zeros, never initialized (``reset_parameters`` is skipped): the simulation measures
memory and communication, and zeros keep every loss and gradient finite.
"""
from __future__ import annotations

import contextlib
import importlib
import re
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from ...estimator import EstimateError

__all__ = ["ModelSpec", "build_model", "no_initialization"]


class ModelSpec:
    """What ``--model`` names: a ``transformers`` config (file or directory) or a factory
    ``module:function`` with keyword arguments."""

    def __init__(self, model: str, model_kwargs: Optional[dict] = None) -> None:
        self.text = str(model).strip()
        self.kwargs = dict(model_kwargs or {})
        self._config = None
        self.is_factory = re.fullmatch(r"[\w.]+:\w+", self.text) is not None and not Path(self.text).exists()
        if not self.is_factory and not Path(self.text).exists():
            raise EstimateError("model", f"{self.text!r} is neither an existing transformers config (config.json "
                                         "or a directory holding one) nor a factory 'module:function'")
        if self.kwargs and not self.is_factory:
            raise EstimateError("model_kwargs", "given for a transformers config; allowed only with a factory")

    def hf_config(self):
        """The ``transformers`` config, read once."""
        if self._config is None:
            from transformers import AutoConfig
            path = Path(self.text)
            self._config = AutoConfig.from_pretrained(str(path / "config.json" if path.is_dir() else path))
        return self._config

    def construct(self) -> nn.Module:
        """Call the factory or ``AutoModelForCausalLM.from_config`` (inside whatever context the
        caller set: ``zero.Init(meta=True)`` or the meta device)."""
        if self.is_factory:
            module_name, _, func_name = self.text.partition(":")
            try:
                factory = getattr(importlib.import_module(module_name), func_name)
            except (ImportError, AttributeError) as e:
                raise EstimateError("model", f"cannot load factory {self.text!r}: {e}") from None
            model = factory(**self.kwargs)
        else:
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_config(self.hf_config())
        if not isinstance(model, nn.Module):
            raise EstimateError("model", f"{self.text} gave a {type(model).__name__}, not a torch.nn.Module")
        return model


# -- values ----------------------------------------------------------------------------------

def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every parameter on the meta device zeros of its (local) shape, in ``dtype`` (floating
    point ones); tied parameters stay tied. Buffers are left as they are."""
    from torch.distributed.tensor import DTensor
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) in made:
                module._parameters[name] = made[id(p)]
                continue
            local = p.to_local() if isinstance(p, DTensor) else p
            if not local.is_meta:
                continue
            kind = dtype if local.is_floating_point() else local.dtype
            values = torch.zeros(local.shape, dtype=kind, device=device)
            if isinstance(p, DTensor):
                values = DTensor.from_local(values, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
            made[id(p)] = module._parameters[name] = nn.Parameter(values, requires_grad=p.requires_grad)


@contextlib.contextmanager
def no_initialization(model: nn.Module):
    """Skip every module's ``reset_parameters`` while ``initialize`` materializes the units
    (their values stay the zeros ``materialize`` gave them)."""
    patched = [m for m in model.modules() if hasattr(m, "reset_parameters")]
    for m in patched:
        m.reset_parameters = _nothing
    try:
        yield
    finally:
        for m in patched:
            m.__dict__.pop("reset_parameters", None)


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


def build_model(construct: Callable[[], nn.Module], *, stage: int, tp: int, dtype: torch.dtype,
                device: torch.device, grid=None, partition: Optional[Callable[[nn.Module], dict]] = None
                ) -> nn.Module:
    """The model ``construct()`` builds, as this rank of the fake group holds it (see the module
    docstring); ``grid``: the run's process grid, needed with ``tp`` > 1 (the model is split over
    it here, by its plan or by the ``partition_config`` that ``partition(model)`` gives)."""
    from ... import zero
    from ...parallel import GRID_ATTR, tensor_parallelize
    with zero.Init(meta=True):
        model = construct()
    if tp > 1:
        tensor_parallelize(model, grid, None if partition is None else partition(model))
    elif grid is not None:
        setattr(model, GRID_ATTR, grid)
    if stage < 3 or tp > 1:
        _materialize(model, dtype, device)
    return model

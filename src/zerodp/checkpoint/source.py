"""A checkpoint opened for reading, whatever wrote it: the one interface the loader and the
consolidator use.

A checkpoint is seen as a set of named parameters, each a tensor of known shape whose
elements can be read by range, together with the per-parameter optimizer state that
travels with it (elementwise state tensors such as Adam's ``exp_avg``/``exp_avg_sq``, read
by range like the value, and scalar state such as ``step``). Nothing in this view depends on
how many ranks wrote the checkpoint or at which ZeRO stage, so any reader of it (the loader,
at any world size and stage; ``zerodp consolidate``) works for every writer:
``ZerodpSource`` (``load.py``) for zerodp's own format, ``DeepSpeedSource``
(``deepspeed.py``) for DeepSpeed's.

The scalars that are not per parameter (step counters, the learning-rate schedule, the
loss scale, RNG states, the data-loader position, the user's ``client_state``) are plain
attributes in zerodp's own JSON-compatible formats.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

#: The kind of a read that asks for the parameter's own values (the fp32 master where the
#: run kept one, otherwise the parameter in its dtype).
VALUE = "value"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit the model: the message says what differs."""


@dataclass(frozen=True)
class ParamInfo:
    """What a checkpoint holds for one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    """The dtype of the stored value: fp32 for a run with fp32 masters or an fp32 run, the
    parameter's dtype otherwise (frozen 16-bit parameters)."""
    param_group: Optional[int]
    """The optimizer param group the parameter was in; None when the optimizer did not
    update it (frozen)."""
    state_keys: tuple[str, ...] = ()
    """Elementwise optimizer-state tensors stored for it (e.g. ``("exp_avg", "exp_avg_sq")``);
    empty when it has no optimizer state (frozen, or never got a gradient)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class OptimizerInfo:
    """The optimizer a checkpoint's states belong to."""

    type: str
    """Class name as written (``"AdamW"``, ``"FusedAdam"``, ``"SGD"`` ...)."""
    param_groups: list[dict[str, Any]]
    """Hyperparameters per param group (``lr``, ``betas``, ``weight_decay``, ``initial_lr``,
    ...), without ``params``; JSON values (tuples as lists)."""
    elementwise_keys: tuple[str, ...]
    """State keys with one value per parameter element (``exp_avg``, ``exp_avg_sq``)."""
    scalar_keys: tuple[str, ...]
    """State keys with one value per parameter (``step``)."""


@dataclass
class Read:
    """One range read: elements ``[lo, hi)`` of the flattened tensor ``kind`` of parameter
    ``name`` into ``out`` (1-D, ``hi - lo`` elements, any floating dtype: values are cast)."""

    name: str
    kind: str
    lo: int
    hi: int
    out: torch.Tensor


@dataclass
class EngineState:
    """Counters of the engine that wrote the checkpoint."""

    global_steps: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0
    global_samples: int = 0


class Source(abc.ABC):
    """A checkpoint opened for reading (see module docstring). Subclasses fill the attributes
    in their constructor and implement the reads."""

    kind: str = ""                 #: "zerodp" or "deepspeed"
    path: Path                     #: the tag directory
    tag: str
    world_size: int                #: ranks that wrote it
    zero_stage: int
    compute_dtype: str             #: "fp32", "bf16" or "fp16"
    params: dict[str, ParamInfo]   #: canonical name -> info, in the model's parameter order
    aliases: dict[str, str]        #: other names of tied parameters -> canonical name
    optimizer: Optional[OptimizerInfo]
    engine_state: EngineState
    lr_scheduler: Optional[dict]   #: the scheduler's state_dict (JSON values)
    loss_scaler: Optional[dict]    #: zerodp's LossScaler.state_dict() format
    client_state: dict
    rng_states: Optional[list[dict]] = None   #: per rank, zerodp's format (see state.py)
    data_loader: Optional[dict] = None        #: zerodp's loader position (see state.py)
    buffer_names: tuple[str, ...] = ()
    #: packed 4-bit weights (their values are codes, never cast) -> the names of their
    #: quantization-state tensors (``<weight>.absmax`` ...; see ``core/packed.py``)
    packed: dict[str, tuple[str, ...]] = {}

    @abc.abstractmethod
    def read(self, reads: list[Read]) -> None:
        """Fill every read's ``out``. Reads are given together so a source can order and merge
        its I/O; ``kind`` is ``VALUE`` or one of the parameter's ``state_keys``."""

    @abc.abstractmethod
    def scalar_state(self, name: str) -> Optional[dict[str, float]]:
        """The parameter's scalar optimizer state (``{"step": 12.0}``), or None when it has
        no optimizer state."""

    @abc.abstractmethod
    def read_buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers (batch-norm statistics ...), full, by name."""

    def read_packed_states(self) -> dict[str, torch.Tensor]:
        """The quantization state of the packed weights, every tensor by its name (empty for a
        checkpoint without packed weights)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional: a source with no open files keeps this
        """Release open files."""

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        return (f"{self.kind} checkpoint {self.path} (tag {self.tag!r}, written by {self.world_size} "
                f"rank{'s' if self.world_size != 1 else ''} at ZeRO stage {self.zero_stage}, "
                f"{self.compute_dtype})")

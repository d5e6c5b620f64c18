"""What a parallelism is to the engine: one object behind one interface.

The engine holds a list of parallelisms (``engine.parallelisms``; :func:`parallelisms_for` makes it
from the grid) and asks each of them the same five things; none of them adds a branch to the step:

* :meth:`Parallelism.prepare_inputs`: what it does to a forward's inputs before the model sees them
  (tensor parallelism checks that its ranks run the same batch; sequence parallelism will cut the
  sequence into this rank's slice);
* :meth:`Parallelism.region`: the context forward and backward run in (tensor parallelism's
  ``loss_parallel()`` when the logits stay split);
* :meth:`Parallelism.placement`: where each parameter lives, as the slice of its unsplit tensor this
  rank holds (``TPSlice``, by parameter id; tensor parallelism's split layers), which flat groups
  record and checkpoints use to write and read unsplit tensors;
* :meth:`Parallelism.shard_axes` and :meth:`Parallelism.shard_axis_of`: the axes its parameters
  shard and reduce over when they are not the data axis (expert parameters over the expert-data
  ranks), and which parameters those are (``core/axes.py``);
* :meth:`Parallelism.close`: remove its hooks when the engine is destroyed.

The base class does nothing in each, so a parallelism writes only what it changes.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager, Optional

from torch import nn

if TYPE_CHECKING:
    from ..core.collectives import Comm
    from .tensor import TPSlice


class Parallelism:
    """One parallelism the engine runs (see the module docstring); the defaults do nothing."""

    name = "none"

    def prepare_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A forward's inputs as the model should get them on this rank."""
        return args, kwargs

    def region(self) -> ContextManager[Any]:
        """The context the engine's forward and backward run in."""
        return contextlib.nullcontext()

    def placement(self, model: nn.Module) -> "dict[int, TPSlice]":
        """Parameter id -> the slice of the unsplit parameter this rank holds, for the parameters
        this parallelism splits."""
        return {}

    def shard_axes(self) -> "dict[str, Comm]":
        """Shard axes this parallelism adds (name -> collectives), beside the data axis."""
        return {}

    def shard_axis_of(self, model: nn.Module) -> dict[int, str]:
        """Parameter id -> the name of the shard axis it shards and reduces over, for parameters
        that do not use the data axis."""
        return {}

    def refuses_compile(self) -> Optional[str]:
        """Why a model compiled with ``torch.compile`` cannot run under this parallelism; None when it can."""
        return None

    def close(self) -> None:
        """Undo what the parallelism installed on the model (hooks)."""


def refuses_compile(parallelisms: "list[Parallelism]") -> Optional[str]:
    """The first reason one of ``parallelisms`` gives not to run a compiled model, or None."""
    return next((why for p in parallelisms if (why := p.refuses_compile()) is not None), None)


def enter_regions(parallelisms: "list[Parallelism]") -> ContextManager[Any]:
    """Every parallelism's region, entered in list order."""
    stack = contextlib.ExitStack()
    for p in parallelisms:
        stack.enter_context(p.region())
    return stack


def prepare_inputs(parallelisms: "list[Parallelism]", args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward's inputs passed through every parallelism, in list order."""
    for p in parallelisms:
        args, kwargs = p.prepare_inputs(args, kwargs)
    return args, kwargs


def placement(parallelisms: "list[Parallelism]", model: nn.Module) -> "dict[int, TPSlice]":
    """Where every split parameter lives; a parameter two parallelisms both place is refused."""
    out: dict = {}
    for p in parallelisms:
        mine = p.placement(model)
        both = out.keys() & mine.keys()
        if both:
            raise ValueError(f"parallelism '{p.name}' places {len(both)} parameter(s) another "
                             "parallelism already placed")
        out.update(mine)
    return out


def shard_axis_of(parallelisms: "list[Parallelism]", model: nn.Module) -> dict[int, str]:
    """Parameter id -> shard axis name, for the parameters some parallelism puts on its own axis."""
    out: dict[int, str] = {}
    for p in parallelisms:
        out.update(p.shard_axis_of(model))
    return out

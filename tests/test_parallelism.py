"""The interface a parallelism offers the engine (``parallel/base.py``): inputs pass through every
parallelism in order, regions nest in order, placements may not overlap, shard axes are named per
parameter. Tensor parallelism (``parallel.TensorParallel``) is the worked case: ``test_tp.py`` runs it."""
from __future__ import annotations

import contextlib

import pytest
from torch import nn

from zerodp.parallel import Parallelism, TensorParallel, TPSlice
from zerodp.parallel import base as parallel


class _Recording(Parallelism):
    def __init__(self, name: str, log: list, placed=(), axis=None) -> None:
        self.name, self.log, self.placed, self.axis = name, log, list(placed), axis

    def prepare_inputs(self, args, kwargs):
        self.log.append(f"inputs {self.name}")
        return args + (self.name,), kwargs

    @contextlib.contextmanager
    def region(self):
        self.log.append(f"enter {self.name}")
        yield
        self.log.append(f"exit {self.name}")

    def placement(self, model):
        return {id(p): TPSlice(0, 2, 0, tuple(p.shape)) for p in self.placed}

    def shard_axis_of(self, model):
        return {id(p): self.axis for p in self.placed} if self.axis else {}


def test_inputs_and_regions_go_through_every_parallelism_in_order():
    log: list = []
    ps = [_Recording("a", log), _Recording("b", log)]
    args, kwargs = parallel.prepare_inputs(ps, ("x",), {"k": 1})
    assert args == ("x", "a", "b") and kwargs == {"k": 1}
    with parallel.enter_regions(ps):
        log.append("body")
    assert log == ["inputs a", "inputs b", "enter a", "enter b", "body", "exit b", "exit a"]


def test_placements_merge_and_may_not_overlap():
    model = nn.Linear(4, 4)
    w, b = model.weight, model.bias
    merged = parallel.placement([_Recording("a", [], [w]), _Recording("b", [], [b], axis="expert")], model)
    assert set(merged) == {id(w), id(b)}
    assert parallel.shard_axis_of([_Recording("a", [], [w]), _Recording("b", [], [b], axis="expert")],
                                  model) == {id(b): "expert"}
    with pytest.raises(ValueError, match="'b' places 1 parameter"):
        parallel.placement([_Recording("a", [], [w]), _Recording("b", [], [w])], model)


def test_the_base_class_changes_nothing_and_tensor_parallelism_is_one():
    p = Parallelism()
    assert p.prepare_inputs((1,), {}) == ((1,), {}) and p.placement(nn.Linear(2, 2)) == {}
    assert p.shard_axes() == {} and p.shard_axis_of(nn.Linear(2, 2)) == {}
    assert issubclass(TensorParallel, Parallelism) and TensorParallel.name == "tensor"

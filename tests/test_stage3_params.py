"""Parameters built in ``zero.Init`` look like DeepSpeed's to the code around them: on the real
device with empty data and ``ds_shape``; a parameter added after ``Init`` keeps the values its
creator gave it (rank 0's); one whose values were lost is named, never filled in."""
from __future__ import annotations

import param_tasks as pt
import pytest
import torch


@pytest.mark.parametrize("stage", [2, 3])
def test_a_layer_added_after_init_keeps_its_values_and_trains_exactly(pool, stage):
    """The base built in ``zero.Init``; a layer made afterwards with rank-dependent values and moved
    to ``base.weight.device`` (peft's placement of a new adapter). The engine trains the whole model
    as one process does from the base and rank 0's layer (to 1e-6); at stage 2 the base gets its
    full values back. Before, the base reported ``meta``: the layer was moved there, lost its
    values, and ``initialize`` gave it new ones."""
    world = 2
    out = pool.run(pt.added_after_init, world, stage)
    want = pt.reference(world)
    for rank, r in enumerate(out):
        assert r["device"] == "cpu" and r["adapter_device"] == "cpu"
        assert r["shape"] == (0,) and r["ds_shape"] == (16, 8)  # DeepSpeed's partitioned parameter
        assert set(r["params"]) == set(want)
        for name, value in want.items():
            err = (r["params"][name] - value).abs().max().item()
            assert err <= 1e-6, f"rank {rank} {name}: {err:.3g}"


@pytest.mark.parametrize("where", ["initialize", "gather"])
def test_a_parameter_whose_values_were_lost_is_named(pool, where):
    errors = pool.run(pt.lost_values, 2, where)
    for e in errors:
        if where == "initialize":
            assert "parameters on the meta device with no values: 3.weight, 3.bias" in e, e
        else:
            assert "parameter(s) on the meta device hold no values (shapes (4, 8), (4,))" in e, e


def test_outside_a_gather_a_parameter_looks_like_deepspeeds(pool):
    """After ``initialize`` too, a stage-3 parameter outside a gather is what DeepSpeed leaves:
    empty data on the real device, ``ds_shape``/``ds_numel``, ``ds_status`` not available; its
    full shape inside ``GatheredParameters``. Reading it outside gives an empty result rather than
    touching freed memory (before, its data was a view of a freed buffer: ``sum()`` crashed the
    process)."""
    out = pool.run(pt.outside_a_gather, 2)
    for name, (_, whole) in out[0]["partition_numel"].items():  # every element kept by exactly one rank
        assert sum(r["partition_numel"][name][0] for r in out) == whole, name
    for r in out:
        rest = {"shape": (0,), "numel": 0, "device": "cpu", "dtype": "torch.float32", "ds_shape": (16, 8),
                "ds_numel": 128, "available": False}
        assert r["at_rest"] == rest and r["after_step"] == rest
        assert r["gathered"] == dict(rest, shape=(16, 8), numel=128, available=True)
        assert r["read"] == "ok"
        assert r["state_dict_shapes"] == [(0,)]


@pytest.mark.parametrize("stage,offload", [(2, "none"), (3, "none"), (3, "cpu")])
def test_data_a_layer_assigns_in_its_forward_is_kept(pool, stage, offload):
    """A layer that assigns its frozen weight new data in its first forward (another layout, read as
    int32 from then on; bitsandbytes' 4-bit layer does this in eval mode on a CPU) trains as in one
    process, and its weight is the repacked one afterwards: at stage 3 the data is kept in the flat
    group at release, so the next gather gives it back as the layer left it. Before, the next gather
    bound the old layout again, which the layer read as the new one, and every loss after the first
    was wrong."""
    world = 2
    out = pool.run(pt.repacking_in_engine, world, stage, offload)
    want = pt.repacking_reference(world)
    for rank, r in enumerate(out):
        for got, ref in zip(r["losses"], want["losses"]):
            assert abs(got - ref) <= 1e-6 * abs(ref), (rank, r["losses"], want["losses"])
        for got, ref in zip(r["weights"], want["weights"]):
            assert got.dtype == torch.int32 and torch.equal(got, ref), rank


@pytest.mark.parametrize("stage", [2, 3])
def test_data_assigned_inside_gathered_parameters_reaches_every_rank(pool, stage):
    """``p.data = new`` inside ``GatheredParameters(modifier_rank=0)`` is rank 0's edit, as an edit in
    place is: every rank and the optimizer continue from it (before, stage 3 dropped it at release)."""
    world = 2
    out = pool.run(pt.assign_with_modifier, world, stage)
    want = pt.assign_reference(world)
    for rank, r in enumerate(out):
        for name, value in want.items():
            err = (r[name] - value).abs().max().item()
            assert err <= 1e-6, f"rank {rank} {name}: {err:.3g}"

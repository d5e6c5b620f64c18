"""Stage 3 specifics: how units are chosen, and GatheredParameters."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from stage3_tasks import modify_with_gathered_parameters

from zerodp.core.gather import plan_units
from zerodp.examples.gpt import build_gpt


def test_units_skip_containers_and_keep_tied_weights_at_the_root():
    model = build_gpt("small")
    units, owner = plan_units(model, min_unit_params=10_000)
    names = [name for name, _ in units]
    assert names[0] == ""                                   # the root comes first
    assert "blocks" not in names                            # a ModuleList is never called
    assert all(owner[id(p)] in range(len(units)) for p in model.parameters())
    assert owner[id(model.wte.weight)] == 0                 # tied with lm_head: stays at the root
    # every unit's parameters sum to at least the threshold
    for u, _ in enumerate(units[1:], start=1):
        assert sum(p.numel() for p in model.parameters() if owner[id(p)] == u) >= 10_000


def test_named_unit_classes():
    from zerodp.examples.gpt import Block
    model = build_gpt("small")
    units, owner = plan_units(model, min_unit_params=10**9, unit_classes=(Block,))
    assert [name for name, _ in units] == ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    block0 = dict(model.named_modules())["blocks.0"]
    assert all(owner[id(p)] == 1 for p in block0.parameters())
    assert owner[id(model.ln_f.weight)] == 0


def test_threshold_decides_granularity():
    model = build_gpt("small")
    fine, _ = plan_units(model, min_unit_params=1)
    coarse, _ = plan_units(model, min_unit_params=10**9)
    assert len(coarse) == 1 and len(fine) > 10


@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_parameters_modifier_rank(pool, stage):
    results = pool.run(modify_with_gathered_parameters, 3, stage)
    for res in results:
        assert res["inside_shape"] == (8, 16)               # full inside the context
        assert torch.equal(res["after"]["2.weight"], torch.full((8, 16), 1.0))
        assert res["sharded_at_rest"]
    for name in results[0]["after"]:
        assert all(torch.equal(r["after"][name], results[0]["after"][name]) for r in results)


@pytest.mark.parametrize("world", [2, 3])
def test_parameter_unused_on_some_ranks_inside_a_unit(pool, world):
    """Parity when a parameter inside a unit gets a gradient on some ranks only, between
    other units' gathers and reduce-scatters (the engine reduces a unit's gradients when
    backward has gone through the unit, so every rank issues the same sequence)."""
    from stage3_tasks import gated_reference, gated_train
    results = pool.run(gated_train, world, 4, timeout=60)
    assert results[0]["units"] == ["", "inp", "gate", "out"]
    ref = gated_reference(world, 4)
    for res in results:
        for name, want in ref.items():
            assert (res["params"][name] - want).abs().max().item() < 2e-6, name


def test_prefetch_bounds_live_parameters_and_keeps_numbers(pool):
    """Without prefetch one unit's parameters are gathered at a time; prefetching one unit
    ahead keeps at most two alive, two units ahead at most three (the units prefetched
    earlier count toward the bucket: it bounds what is gathered ahead, not what is newly
    gathered at each unit); the trained parameters are identical either way. With prefetch,
    the first unit is on its way when the forward begins, and the last unit of forward, the
    first of backward, stays gathered between them (one all-gather fewer per step, as
    DeepSpeed's prefetcher keeps what its window reaches) even at reuse distance 0."""
    from stage3_tasks import prefetch_task
    off = pool.run(prefetch_task, 2, 0)
    one = pool.run(prefetch_task, 2, 256)          # one 16x16 unit ahead
    two = pool.run(prefetch_task, 2, 512)
    unit_bytes = off[0]["unit_bytes"]
    assert off[0]["units"] == 7 and off[0]["order"] == [1, 2, 3, 4, 5, 6]
    assert off[0]["peak"] == unit_bytes
    assert one[0]["peak"] == 2 * unit_bytes
    assert two[0]["peak"] == 3 * unit_bytes
    # a gathered unit's values live in its full buffer only: the own shard's storage is freed
    # meanwhile and refilled when the unit is released
    for res in (off, one, two):
        assert res[0]["shard_bytes_while_gathered"] == 0 and res[0]["shards_back"]
        # the first unit of backward runs at the step's activation peak: the units after it
        # are prefetched once it is done, not while it computes
        assert res[0]["gathered_in_first_backward_unit"] == 1
    for res in (one, two):
        for name, want in off[0]["params"].items():
            assert torch.equal(res[0]["params"][name], want), name
    unit_allgather = 256 * 4 / 2                       # one 16x16 unit, fp32, ring count at world 2
    assert off[0]["all_gather"] == pytest.approx(12 * unit_allgather, abs=4)
    assert off[0]["first_unit_at_start"] == [False] * 3
    for res in (one, two):
        assert res[0]["all_gather"] == pytest.approx(11 * unit_allgather, abs=4)
        # the order is recorded by the first forward; the later ones prefetch from their start
        assert res[0]["first_unit_at_start"] == [False, True, True]


def test_backward_gathers_the_next_unit_before_reducing_the_last(pool):
    """When backward leaves a unit, the next unit's all-gather is issued before the unit's
    reduce-scatter: backward waits for the gather, not for the reduction."""
    from stage3_tasks import collective_order_task
    events = pool.run(collective_order_task, 2)[0]
    forward = [("ag", u) for u in range(1, 7)]          # the first at the start, each next one ahead
    assert events[:6] == forward, events
    assert events[6:] == [("ag", 5), ("rs", 6), ("ag", 4), ("rs", 5), ("ag", 3), ("rs", 4),
                          ("ag", 2), ("rs", 3), ("ag", 1), ("rs", 2), ("rs", 1)], events


def test_reuse_distance_keeps_units_gathered(pool):
    """stage3_max_reuse_distance: a unit used again soon stays gathered after its forward.
    With room for one other unit, only the last unit of forward is kept for backward (one
    all-gather saved); with room for all, no unit is gathered again in backward. The
    numbers stay the same."""
    from stage3_tasks import prefetch_task
    world = 2
    unit_allgather = 256 * 4 * (world - 1) / world      # one 16x16 unit, fp32, ring count
    none = pool.run(prefetch_task, world, 0, 0)
    last = pool.run(prefetch_task, world, 0, 1)
    all_ = pool.run(prefetch_task, world, 0, 10**6)
    assert none[0]["all_gather"] == pytest.approx(12 * unit_allgather, abs=4)
    assert last[0]["all_gather"] == pytest.approx(11 * unit_allgather, abs=4)
    assert all_[0]["all_gather"] == pytest.approx(6 * unit_allgather, abs=4)
    assert all_[0]["peak"] == 6 * all_[0]["unit_bytes"]
    for res in (last, all_):
        for name, want in none[0]["params"].items():
            assert torch.equal(res[0]["params"][name], want), name


@pytest.mark.parametrize("world", [1, 2])
def test_changed_unit_order_is_recorded_again(pool, world):
    """A forward that runs the units in another order stops the prefetch for that pass and
    records the order again; the numbers stay those of single-process training."""
    from stage3_tasks import reorder_reference, reorder_task
    results = pool.run(reorder_task, world, 4, timeout=60)
    ref = reorder_reference(world, 4)
    for res in results:
        assert res["rerecords"] == 1                # the flipped step
        for name, want in ref.items():
            assert (res["params"][name] - want).abs().max().item() < 2e-6, name


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_running_different_units_fail_clearly(pool, world):
    """Data-dependent branches that differ between ranks give an error on every rank, within
    seconds, naming which rank ran which unit, instead of a hang in mismatched collectives
    (here in the first step: the order of units is being recorded, the ranks agree at every unit)."""
    from stage3_tasks import divergent_task
    errors = pool.run(divergent_task, world, timeout=60)
    for err in errors:
        assert "rank 0 ran unit" in err and "(branch, a Linear)" in err, err
        assert "rank 1 ran unit" in err, err
    assert len(set(errors)) == 1


def test_ranks_agree_once_per_forward_while_prefetching(pool):
    """The check that every rank runs the same unit waits at every unit while the order is
    recorded (first step) and without prefetching (each unit's gather waits for the ranks
    anyway), but only at the end of the forward once units are prefetched from the recorded
    order: the ranks do not wait for each other at every unit."""
    from stage3_tasks import agreement_task
    assert pool.run(agreement_task, 2, 0)[0] == [7, 7, 7]       # six units and the end of forward
    assert pool.run(agreement_task, 2, 256)[0] == [7, 1, 1]     # one unit ahead
    assert pool.run(agreement_task, 1, 256)[0] == [0, 0, 0]     # alone: nothing to agree on


def test_gathered_parameters_inside_a_forward_wait_for_a_prefetch(pool):
    """A forward that reads a later unit's weight with ``GatheredParameters`` while that unit's
    all-gather is a prefetch in flight sees the full weight, not a half-filled buffer."""
    from stage3_tasks import peek_task
    for res in pool.run(peek_task, 2):
        assert len(res["seen"]) == len(res["outside"]) == 4
        for step, (inside, outside) in enumerate(zip(res["seen"], res["outside"])):
            assert torch.equal(inside, outside), f"step {step}: differs in {(inside != outside).sum()} places"


def _run_diverge_script(out_dir, *args):
    """``diverge_script.py`` under torchrun on 2 ranks: the finished process and its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).parent / "diverge_script.py"), str(out_dir), *args]
    src = str(Path(__file__).parent.parent / "src")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    return proc, proc.stdout + proc.stderr


@pytest.mark.parametrize("then", ["unit", "gathered"])
def test_ranks_diverging_while_prefetching_fail_and_the_job_ends(tmp_path, then):
    """Once the order is recorded the ranks agree lazily (no wait at every unit): a branch taken
    by rank 0 alone in the third step still gives every rank the same error, and the job ends
    (torchrun, ``diverge_script.py``) although the rank that kept to the plan has collectives
    in flight that its peer never joins. Where the other rank's next step is a
    ``GatheredParameters`` in the forward, the error names that instead of a unit."""
    proc, out = _run_diverge_script(tmp_path, then)
    assert proc.returncode != 0 and "no error" not in out, out[-3000:]
    errors = {f.stem: f.read_text().split(": ", 1) for f in tmp_path.glob("rank*.txt")}
    assert sorted(errors) == ["rank0", "rank1"], out[-3000:]
    assert all(step == "step 2" for step, _ in errors.values()), errors
    assert len({message for _, message in errors.values()}) == 1, errors
    message = errors["rank0"][1]
    rank1_did = "ran unit" if then == "unit" else "entered GatheredParameters"
    assert "rank 0 ran unit" in message and f"(branch, a Linear); rank 1 {rank1_did}" in message, message
    assert ("(norm, a LayerNorm)" in message) == (then == "unit"), message


def test_a_forward_that_raises_on_one_rank_ends_with_its_own_error(tmp_path):
    """A forward that raises on one rank (in the third step, while units are prefetched) ends
    the job with that error: the end of the forward does not wait for the other ranks to agree
    on units (they no longer can), which would add a second error that torch silences."""
    proc, out = _run_diverge_script(tmp_path, "raises")
    assert proc.returncode != 0 and "no error" not in out, out[-3000:]
    assert (tmp_path / "rank0.txt").read_text() == "step 2: rank 0 fails in its forward"
    assert "ValueError: rank 0 fails in its forward" in out, out[-3000:]
    assert "silenced" not in out, out[-3000:]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_built_on_meta_device_never_fully_held(pool, precision):
    """A cap of 85% of the model's full size per rank: the model is built on the meta
    device, each unit initialized in turn and sharded, and training stays under the cap.
    In bf16 the parameters are 16-bit and each rank's fp32 master is a quarter of the model."""
    from stage3_tasks import meta_init_task
    results = pool.run(meta_init_task, 4, precision, timeout=180)
    for res in results:
        cap = 0.85 * res["full_bytes"]
        assert res["init_peak"] <= res["unit_bytes"] < cap
        assert res["held"] - res["master_bytes"] < cap, (res["held"], cap)
        if precision == "bf16":
            assert res["dtypes"] == {"torch.bfloat16"}
            numel = res["full_bytes"] // 2
            assert 4 * numel / 4 <= res["master_bytes"] < 4 * numel / 4 + 4096
        else:
            assert res["master_bytes"] == 0
        assert 0.015 < res["std"] < 0.025                   # GPT init: normal(0, 0.02)
        assert (res["ln"] - 1).abs().max() < 0.05          # LayerNorm reset to 1 (then trained)
        assert res["tied"]
        assert res["losses"][-1] < res["losses"][0] - 0.1  # it trains
    assert len({round(r["checksum"], 6) for r in results}) == 1  # every rank: the same model


def test_parameter_read_outside_its_unit(pool):
    """A parent reading a child unit's weight directly: gathered when read and registered as external
    from then on (``core/access.py``), registered by hand with register_external_parameter, or with
    the child not a unit of its own: the numbers of single-process training each time."""
    from stage3_tasks import reads_child_weight_reference, reads_child_weight_task
    ref = reads_child_weight_reference(2, 3)
    for results in (pool.run(reads_child_weight_task, 2, 1, timeout=60),
                    pool.run(reads_child_weight_task, 2, 1, True, timeout=60),
                    pool.run(reads_child_weight_task, 2, 10**6, timeout=60)):
        for res in results:
            assert isinstance(res, dict), res
            for name, want in ref.items():
                assert (res[name] - want).abs().max().item() < 2e-6, name


def test_empty_partition_cache_releases_what_an_abandoned_forward_gathered(pool):
    from stage3_tasks import empty_partition_cache_task
    for r in pool.run(empty_partition_cache_task, 2):
        assert r["gathered_before"] > 0
        assert r["gathered_after"] == 0 == r["buffers_after"]
        assert r["again"] == r["first"]
        assert r["after_step"] != r["first"]


def test_a_step_takes_units_and_the_plan_through_their_states(pool):
    """A unit is in forward while its forward runs, in backward while its backward runs, idle after
    either (the last unit of forward too, kept gathered for backward), held through
    ``parameters_held``; the plan records in the first forward, follows from the second, and
    records again after ``invalidate``."""
    from stage3_tasks import unit_states_through_a_step
    for r in pool.run(unit_states_through_a_step, 2):
        n = r["units"] - 1
        assert r["in_forward"] == ["forward"] * 2 * n, r
        assert r["in_backward"] == ["backward"] * 2 * n, r["in_backward"]
        assert r["after_forward_0"] == ["idle"] * n
        assert r["after_backward_0"] == [("idle", 0)] * (n + 1) == r["after_backward_1"]
        assert r["plans"] == ["recording", "following"]
        assert r["held"] == (["held"] * (n + 1), "suspended")
        assert r["held_after_backward"] == ["held"] * (n + 1)
        assert r["after_held"] == (["idle"] * (n + 1), "following")
        assert r["invalidated"] == "departed" and r["rerecorded"] == "recording"
        assert r["one_pool"]  # GatheredParameters, checkpoints and the reducer share the units' scratch


def test_a_unit_changes_state_only_as_its_transitions_allow():
    from torch import nn

    from zerodp.core.axes import DATA, ShardAxes
    from zerodp.core.gather import Unit, UnitState
    unit = Unit(1, "block", nn.Linear(2, 2), [], ShardAxes({DATA: None}))
    assert unit.state is UnitState.IDLE
    unit.enter_forward()
    assert unit.state is UnitState.FORWARD
    unit.enter_backward()  # backward reached it; a forward recomputed there leaves it in backward
    unit.enter_forward()
    unit.leave_forward()
    assert unit.state is UnitState.BACKWARD and unit.in_backward
    unit.release()
    assert unit.state is UnitState.IDLE
    unit.hold()
    for change in (unit.enter_forward, unit.enter_backward, unit.release, unit.leave_forward):
        change()
        assert unit.state is UnitState.HELD and unit.held
    unit.pin()
    unit.expect_backward()
    unit.expect_backward()
    unit.forget_uses()  # a held unit keeps its counts
    assert (unit.pins, unit.pending_backward) == (1, 2)
    assert unit.backward_came() is False and unit.backward_came() is True
    unit.unhold()
    unit.forget_uses()
    assert unit.state is UnitState.IDLE and unit.pins == 0

"""Pipeline parallelism with ZeRO at every stage: parity with one process.

PP2 x DP2 on the pool's 4 ranks: a ``PipelineModule`` whose embedding is tied to the output
layer across the first and last stage, ``gradient_accumulation_steps`` micro-batches per
``train_batch``, clipping that binds; the reference trains the same module as one stage on the
whole global batch (``pp_tasks.reference``). SGD with momentum carries gradient errors into the
parameters linearly: held to 1e-6.
"""
from __future__ import annotations

import pytest
from pp_tasks import reference, train

STEPS, GAS = 3, 4


def assert_matches(results, ref, atol=1e-6, rtol=1e-6):
    for rank, res in enumerate(results):
        for name, value in res["params"].items():  # each stage holds its own layers, by the model's names
            err = (value - ref["params"][name]).abs().max().item()
            assert err <= atol, f"rank {rank} (stage {res['stage']}) {name}: max |diff| {err:.3g}"
        assert res["norms"] == pytest.approx(ref["norms"], rel=rtol), f"rank {rank}"
        assert res["losses"] == pytest.approx(ref["losses"], rel=rtol), f"rank {rank}"
    held = {n for r in results for n in r["params"]}
    assert held == set(ref["params"])  # the stages hold the whole model between them
    assert min(ref["norms"]) > 0.5  # clipping binds


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pp2_dp2_every_zero_stage_and_schedule(pool, stage, schedule):
    virtual = 2 if schedule == "Interleaved1F1B" else 1
    results = pool.run(train, 4, 2, stage, STEPS, GAS, schedule=schedule, virtual=virtual)
    assert [(r["stage"], r["first"], r["last"]) for r in results] == \
        [(0, True, False), (0, True, False), (1, False, True), (1, False, True)]
    assert_matches(results, reference(2, STEPS, GAS))
    pipe = results[0]["comm"]["pipe"]
    assert pipe["p2p"] > 0 and pipe["all_reduce"] > 0  # activations sent; the tied embedding's gradient summed
    assert results[0]["bubble"] == pytest.approx(1 / (virtual * GAS + 1))


def test_pp4_dp1_adamw(pool):
    """Four stages of one rank each (the tied embedding on the first and the last), AdamW."""
    results = pool.run(train, 4, 4, 1, STEPS, GAS, optimizer="AdamW")
    assert [r["stage"] for r in results] == [0, 1, 2, 3]
    assert_matches(results, reference(1, STEPS, GAS, optimizer="AdamW"), atol=3e-5, rtol=1e-5)


def test_one_stage_pipeline_at_zero_stage_3(pool):
    """A pipeline of one stage over four data-parallel ranks at stage 3: its micro-batches run one
    after another with the stage's parameters held gathered (no order of units is recorded then)."""
    results = pool.run(train, 4, 1, 3, STEPS, GAS)
    assert [r["stage"] for r in results] == [0, 0, 0, 0]
    assert_matches(results, reference(4, STEPS, GAS))


def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(pool):
    from pp_tasks import fp16_overflow_on_one_stage
    results = pool.run(fp16_overflow_on_one_stage, 4)
    for r in results:
        assert r["overflow"] and r["unchanged"] and r["skipped"] == 1 and r["scale_halved"], r
        assert r["changed_after"] and r["global_steps"] == 2, r


def test_pp2_dp2_bf16_follows_fp32(pool):
    """bf16 parameters with fp32 masters: the fp32 reference within bf16 precision."""
    results = pool.run(train, 4, 2, 2, STEPS, GAS, dtype="bf16")
    assert_matches(results, reference(2, STEPS, GAS), atol=2e-2, rtol=3e-3)


def test_world_8_pp2_tp2_dp2(pool, tmp_path):
    """Eight processes, the full 3-D grid (``grid3d_script.py``) at ZeRO stages 1 and 3: every rank's
    slices put together match one process. Its checkpoint then loads at PP1 x DP4 (stage 1) and at
    PP4 x DP1 (stage 2) on the pool's 4 ranks, which go on as one process would."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    here = Path(__file__).parent
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(here.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                           str(here / "grid3d_script.py"), str(out), str(tmp_path / "ckpt"), "1", "3"],
                          env=env, capture_output=True,
                          text=True, timeout=300)
    assert out.exists(), (proc.stdout + proc.stderr)[-4000:]
    rows = json.loads(out.read_text())
    for rank, found in enumerate(rows):
        for stage, got in found.items():
            assert got["max_err"] <= 1e-6, (rank, stage, got["max_err"])
            assert got["norms"] == pytest.approx(got["ref_norms"], rel=1e-6)
            assert got["losses"] == pytest.approx(got["ref_losses"], rel=1e-6)
            assert got["tensor_bytes"] > 0
    assert rows[0]["1"]["names"] != rows[4]["1"]["names"]  # ranks 0-3 stage 0, ranks 4-7 stage 1
    from pp_tasks import round_trip
    results = pool.run(round_trip, 4, str(tmp_path / "ckpt"), [(1, 0, 1, 1), (4, 0, 2, 1)], GAS, first_step=2,
                       load_first=True)
    ref = reference([2, 2, 4, 1], 4, GAS)
    assert all(r["global_steps"] == 4 for r in results)
    for rank, res in enumerate(results):
        for name, value in res["params"].items():
            assert (value - ref["params"][name]).abs().max().item() <= 1e-6, (rank, name)
        assert res["norms"] == pytest.approx(ref["norms"][2:], rel=1e-6)


def test_a_stage_starting_with_an_in_place_layer(pool):
    from pp_tasks import inplace_first_layer
    assert all(r["err"] <= 1e-6 for r in pool.run(inplace_first_layer, 4))


def test_checkpoints_move_between_pipelines(pool, tmp_path):
    """PP2 x DP2 stage 3 -> PP1 x DP4 stage 1 -> PP4 x DP1 stage 2 -> PP2 x TP2 x DP1 stage 1, each leg
    loading the last one's checkpoint with no conversion, going on as one process would; the
    checkpoint consolidates into the whole model."""
    from pp_tasks import round_trip

    from zerodp.checkpoint import get_fp32_state_dict_from_zero_checkpoint
    legs = [(2, 0, 3, 2), (1, 0, 1, 1), (4, 0, 2, 1), (2, 2, 1, 1)]
    results = pool.run(round_trip, 4, str(tmp_path), legs, GAS)
    ref = reference([2, 2, 4, 1, 1], 5, GAS)
    assert all(r["global_steps"] == 5 for r in results)
    assert_matches(results, ref)
    full = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert sorted(full) == sorted(ref["params"])
    for name, value in ref["params"].items():
        assert (full[name] - value).abs().max().item() <= 1e-6, name
    # save_16bit_model: the whole model from rank 0, after the PP2 x DP2 stage-3 leg and the PP2 x TP2 one
    import torch
    for leg, want in ((0, reference(2, 2, GAS)["params"]), (3, ref["params"])):
        got = torch.load(tmp_path / f"16bit-{leg}" / "pytorch_model.bin", weights_only=True)
        assert sorted(got) == sorted(want), leg
        for name, value in want.items():
            assert (got[name] - value).abs().max().item() <= 1e-6, (leg, name)


@pytest.mark.parametrize("stage", [1, 3])
def test_activation_checkpointing_every_layer(pool, stage):
    """``activation_checkpoint_interval=1``: every layer recomputed in backward, the same numbers."""
    results = pool.run(train, 4, 2, stage, STEPS, GAS, checkpoint_every=1)
    assert_matches(results, reference(2, STEPS, GAS))
    for r in results:  # each block's forward started again in backward (torch stops a recompute early)
        # (and torch's first step runs a stage's forward once or twice more, learning its shapes)
        assert r["blocks"] > 0 and 2 * r["blocks"] * GAS * STEPS <= r["block_forwards"] <= \
            2 * r["blocks"] * (GAS * STEPS + 1)


def test_eval_batch_gives_the_mean_loss_on_every_stage(pool):
    from pp_tasks import eval_batches
    results = pool.run(eval_batches, 4, 2, 3)
    want = sum(r["want"] for r in results[:2]) / 2  # the data-parallel ranks' mean
    assert all(r["got"] == pytest.approx(want, rel=1e-6) for r in results)


def test_metrics_rows_have_the_bubble_and_the_point_to_point_bytes(pool, tmp_path):
    from pp_tasks import with_metrics
    results = pool.run(with_metrics, 4, str(tmp_path))
    rows = results[0]["rows"]
    assert [int(r["step"]) for r in rows] == [1, 2]
    for row, loss in zip(rows, results[0]["losses"]):
        assert float(row["bubble_fraction"]) == pytest.approx(1 / 5)  # GPipe, 2 stages, 4 micro-batches
        assert int(row["comm_p2p"]) > 0 and float(row["loss"]) == pytest.approx(loss, rel=1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_model_states_per_rank_and_the_estimate(pool, stage):
    """Each rank holds its stage's share of the model, sharded over the stage's data-parallel ranks;
    ``zerodp.estimate(..., pp=2)`` gives the same (within the flat groups' padding)."""
    from pp_tasks import equal_stages_memory

    import zerodp
    results = pool.run(equal_stages_memory, 4, stage)
    total = results[0]["total_params"]
    row = zerodp.estimate(total, ranks_per_node=4, pp=2, precision="fp32").row(stage)
    for r in results:
        assert r["memory"]["model_states"] == pytest.approx(row.model_states, rel=0.01), (r["memory"], row)
        # stage 3 holds the stage's parameters gathered for the whole step: the ledger's peak sees them
        stage_bytes = total // 2 * 4
        assert r["memory"]["gathered_parameters_peak"] >= (stage_bytes if stage == 3 else 0), r["memory"]
        # at stage 3 the micro-batches' gradients are held whole until the step's one reduction
        held = r["memory"]["accumulated_gradients_peak"]
        assert (held == stage_bytes) if stage == 3 else (held == 0), r["memory"]


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_offload_under_a_pipeline(pool, stage):
    """Optimizer states and fp32 masters on the host (``offload_optimizer: cpu``), the step walked there."""
    results = pool.run(train, 4, 2, stage, STEPS, GAS, offload=True)
    assert_matches(results, reference(2, STEPS, GAS))


def test_activations_in_flight_follow_the_schedule(pool):
    """The first stage keeps every micro-batch's activations under GPipe (all forwards before any
    backward) and at most 2 under 1F1B (2 stages): doubling the micro-batches from 4 to 8 adds 4
    micro-batches' worth to GPipe's measured peak and nothing to 1F1B's."""
    from pp_tasks import activations_by_schedule
    first = pool.run(activations_by_schedule, 4)[0]
    assert first["stage"] == 0 and first["1F1B-4"] > 0
    assert first["1F1B-8"] == pytest.approx(first["1F1B-4"], rel=0.02), first  # (the ids batch doubles)
    per_micro = (first["GPipe-8"] - first["GPipe-4"]) / 4
    assert per_micro > 0 and first["GPipe-4"] - first["1F1B-4"] == pytest.approx(2 * per_micro, rel=0.05), first


@pytest.mark.parametrize("option", ["loss_parallel", "sequence_parallel"])
def test_loss_and_sequence_parallelism_are_refused_under_a_pipeline(option):
    import torch

    from zerodp.config import load_config
    from zerodp.parallel import GridError, grid_for
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2, option: True}})
    with pytest.raises(GridError, match=f"tensor_parallel.{option}: not implemented under a pipeline"):
        grid_for(torch.nn.Linear(2, 2), cfg, pp=2)

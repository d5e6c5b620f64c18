"""Mixed precision: bf16 and fp16 parity, casting, and the fp16 loss scaler.

Why the parity tolerances are what they are: the engine and the reference
(``precision_tasks.reference_mixed``) run the same 16-bit kernels on the same chunks of data
(one thread each, so the kernels' accumulation order is the same too) and update fp32
masters with the same AdamW. What can differ is only how the chunk gradients are summed.

* With ``communication_data_type`` and ``data_types.grad_accum_dtype`` fp32, chunk gradients
  are summed in fp32, where a sum of a few 16-bit values is almost always exact; what is
  left is the fp32 order of the norm and clipping arithmetic (~1e-7 relative), so masters
  agree to 1e-6 at every stage and world size.
* With the default 16-bit reduction, a sum of two 16-bit values is one rounding whatever the
  order, so with two ranks the engine is matched exactly by a reference that adds in 16 bits
  in the engine's order (per rank over micro-batches, then over ranks at stages 0-1; per
  micro-batch over ranks, then over micro-batches at stages 2-3). With more ranks gloo's
  reduction order is its own; the test then bounds the difference by what 16-bit rounding of
  the sums can do (see ``test_default_reduction_more_ranks_within_16bit_rounding``).
"""
import math

import pytest
import torch
from precision_tasks import (
    casting_task,
    gpt_losses_task,
    modify_gathered_task,
    overflow_at_minimum_task,
    overflow_task,
    reference_mixed,
    train_mixed,
)

from zerodp.core.precision import LossScaleAtMinimumError, LossScaler

STEPS = 4


@pytest.fixture
def one_thread():
    """The reference runs its 16-bit kernels single-threaded, as the workers do: 16-bit GEMM
    results depend on how the work is split across threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def max_diff(a: dict, b: dict) -> float:
    return max((a[n].float() - b[n].float()).abs().max().item() for n in b)


def check(results, ref, atol: float, norm_rtol: float):
    masters, norms, params16 = ref
    for rank, res in enumerate(results):
        err = max_diff(res["masters"], masters)
        assert err <= atol, f"rank {rank}: fp32 masters differ by {err:.3g} > {atol}"
        for step, (got, want) in enumerate(zip(res["norms"], norms)):
            assert got == pytest.approx(want, rel=norm_rtol), f"rank {rank} step {step} grad norm"
        assert res["skipped"] == 0
    return max_diff(results[0]["params"], params16)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parity_with_fp32_reduction(pool, one_thread, stage, world, dtype):
    """16-bit forward/backward, fp32 accumulation and reduction, fp32 master AdamW, with
    accumulation 2, clipping that bites, 60-element buckets, tied weights, a frozen layer, two
    param groups and a branch some ranks skip."""
    results = pool.run(train_mixed, world, stage, STEPS, dtype, gas=2, clip=0.5, bucket=60,
                       comm="fp32", accum="fp32")
    ref = reference_mixed(world, STEPS, dtype, gas=2, clip=0.5, order="fp32",
                          branch_on_all_ranks=stage == 3)
    assert min(ref[1]) > 0.5  # clipping bites
    check(results, ref, atol=1e-6, norm_rtol=1e-6)
    assert results[0]["loss_dtypes"] == [f"torch.{'bfloat16' if dtype == 'bf16' else 'float16'}"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parity_default_16bit_reduction_two_ranks(pool, one_thread, stage, dtype):
    """Gradients kept and reduced in 16 bits (the default): exact against the reference that
    rounds its sums in the same order."""
    results = pool.run(train_mixed, 2, stage, STEPS, dtype, gas=2, clip=0.5, bucket=60)
    order = "micro_then_rank" if stage < 2 else "rank_then_micro"
    ref = reference_mixed(2, STEPS, dtype, gas=2, clip=0.5, order=order, branch_on_all_ranks=stage == 3)
    check(results, ref, atol=1e-6, norm_rtol=1e-6)
    # and the 16-bit order matters: an fp32-summing reference is measurably different
    other = reference_mixed(2, STEPS, dtype, gas=2, clip=0.5, order="fp32", branch_on_all_ranks=stage == 3)
    assert max_diff(results[0]["masters"], other[0]) > 1e-5


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_default_reduction_more_ranks_within_16bit_rounding(pool, one_thread, stage):
    """Four ranks, bf16 reduction in gloo's own order: every summation order is a valid
    answer, so the engine must be as close to the reference as two references that only
    differ in summation order are to each other (a factor 4 of slack for four steps of
    divergence), and the gradient norm within bf16 precision (2^-8)."""
    results = pool.run(train_mixed, 4, stage, STEPS, "bf16", gas=2, clip=0.5, bucket=60)
    order = "micro_then_rank" if stage < 2 else "rank_then_micro"
    ref = reference_mixed(4, STEPS, "bf16", gas=2, clip=0.5, order=order, branch_on_all_ranks=stage == 3)
    spread = max_diff(reference_mixed(4, STEPS, "bf16", gas=2, clip=0.5, order="fp32",
                                      branch_on_all_ranks=stage == 3)[0], ref[0])
    assert 0 < spread < 0.02 * 0.5  # well below one step's update (lr 0.02)
    err = max_diff(results[0]["masters"], ref[0])
    assert err <= 4 * spread, f"masters differ by {err:.3g}; summation-order spread {spread:.3g}"
    for got, want in zip(results[0]["norms"], ref[1]):
        assert got == pytest.approx(want, rel=2 ** -8)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_example_gpt_16bit_stays_close_to_fp32(pool, dtype):
    """40 steps of the tiny example GPT at stage 2 on two ranks: the 16-bit loss curve follows
    the fp32 one (within 3% of the loss at every step), and both learn."""
    steps = 40
    fp32 = pool.run(gpt_losses_task, 2, 2, "fp32", steps)[0]
    low = pool.run(gpt_losses_task, 2, 2, dtype, steps)[0]
    assert fp32[-1] < fp32[0] - 1.0
    worst = max(abs(a - b) / b for a, b in zip(low, fp32))
    assert worst < 0.03, f"{dtype} loss strays {worst:.1%} from fp32"


# -- casting ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_casting_policy(pool, stage, dtype):
    """Parameters and float buffers in the compute dtype, batch norm in fp32 with its running
    statistics updated, float inputs cast and integer inputs left alone, outputs in the compute
    dtype, fp32 masters."""
    low = "torch.bfloat16" if dtype == "bf16" else "torch.float16"
    res = pool.run(casting_task, 2, stage, dtype)[0]
    assert res["param_dtypes"] == {"emb.weight": low, "lin.weight": low, "lin.bias": low,
                                   "bn.weight": "torch.float32", "bn.bias": "torch.float32"}
    assert res["buffer_dtypes"]["offset"] == low
    assert res["buffer_dtypes"]["bn.running_mean"] == "torch.float32"
    assert res["bn_stats_moved"]
    assert res["out_dtype"] == low
    assert set(res["masters"]) == {"torch.float32"}
    # the fp32 batch-norm group is updated in place, with no separate master
    assert len(res["masters"]) < res["memory"]["master_weights"]


@pytest.mark.parametrize("stage", [1, 3])
def test_modified_parameters_reach_the_master(pool, stage):
    res = pool.run(modify_gathered_task, 2, stage)
    assert all(r["max_dev_from_half"] < 0.05 for r in res)  # one lr-sized step away from 0.5


@pytest.mark.parametrize("stage", [0, 2])
def test_fp32_gradient_accumulation_doubles_gradient_memory(pool, stage):
    """data_types.grad_accum_dtype fp32 keeps 16-bit gradients in 4 bytes per element."""
    fp32 = pool.run(train_mixed, 2, stage, 1, "bf16", accum="fp32")[0]["memory"]
    bf16 = pool.run(train_mixed, 2, stage, 1, "bf16")[0]["memory"]
    assert fp32["gradients"] == 2 * bf16["gradients"] > 0
    assert fp32["parameters"] == bf16["parameters"]


# -- loss scaler -----------------------------------------------------------------------------------

def run_scaler(events, **kw):
    s = LossScaler(**kw)
    scales = []
    for overflow in events:
        s.update(overflow)
        scales.append(s.scale)
    return scales


def test_scaler_hysteresis_and_window():
    # hysteresis 2: the first overflow only spends hysteresis, the second halves
    assert run_scaler([True, True, True], initial_scale_power=10, hysteresis=2) == [1024, 512, 256]
    # window 3: doubles after three clean steps in a row, counting again after an overflow
    assert run_scaler([False, False, False, True, False, False, False],
                      initial_scale_power=10, window=3, hysteresis=1) == [1024, 1024, 2048, 1024, 1024, 1024, 2048]
    # hysteresis is restored when the scale rises
    assert run_scaler([True, False, False, True, True], initial_scale_power=10, window=2,
                      hysteresis=2) == [1024, 1024, 2048, 2048, 1024]
    # with consecutive_hysteresis, after every clean step
    assert run_scaler([True, False, True, True], initial_scale_power=10, hysteresis=2,
                      consecutive_hysteresis=True) == [1024, 1024, 1024, 512]


def test_scaler_static_and_minimum():
    assert run_scaler([True, False, True], static_scale=128.0) == [128, 128, 128]
    s = LossScaler(initial_scale_power=2, hysteresis=1, min_scale=1.0)
    s.update(True)
    s.update(True)
    assert s.scale == 1.0
    with pytest.raises(LossScaleAtMinimumError, match="min_loss_scale"):
        s.update(True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_inf_on_one_rank_skips_the_step_everywhere(pool, stage):
    """Rank 0 alone turns a gradient into inf in step 1: every rank skips that step (no
    parameter, optimizer-state or LR change), the scale halves, training goes on, and the
    scale doubles again after the window of clean steps."""
    window = 3
    results = pool.run(overflow_task, 2, stage, [1], window)
    for res in results:
        assert res["error"] is None, res["error"]
        rows = res["rows"]
        assert [r["scale"] for r in rows] == [16, 8, 8, 8, 16, 16]
        assert [r["changed"] for r in rows] == [True, False, True, True, True, True]
        assert [r["skipped"] for r in rows] == [0, 1, 1, 1, 1, 1]
        assert not math.isfinite(rows[1]["norm"]) and all(math.isfinite(r["norm"]) for r in rows if r is not rows[1])
        lrs = [r["lr"] for r in rows]
        assert lrs[1] == lrs[0] and lrs[2] > lrs[1]  # the scheduler did not advance on the skip
    same = [{k: r[k] for k in ("scale", "changed", "skipped", "lr")} for r in results[0]["rows"]]
    assert same == [{k: r[k] for k in ("scale", "changed", "skipped", "lr")} for r in results[1]["rows"]]


def test_overflow_at_minimum_scale_raises_on_every_rank(pool):
    results = pool.run(overflow_task, 2, 2, [0, 1, 2, 3, 4, 5], 100, steps=6, min_scale=4.0)
    for res in results:
        assert res["error"] is not None and "LossScaleAtMinimumError" in res["error"]
        assert "min_loss_scale" in res["error"] and "bf16" in res["error"]
        assert [r["scale"] for r in res["rows"]] == [8, 4]  # 16 -> 8 -> 4, then the error


@pytest.mark.parametrize("stage, gas", [(0, 1), (2, 1), (2, 2), (3, 1)])
def test_overflow_at_minimum_scale_drops_the_step_and_training_goes_on(pool, stage, gas):
    """The overflow at the minimum scale raises on every rank, with the step skipped and its
    gradients dropped: the next clean step trains, with no zero_grad() from the caller."""
    for rows in pool.run(overflow_at_minimum_task, 2, stage, gas):
        assert rows[0]["error"] is None and rows[0]["changed"]
        error = rows[1]["error"]
        assert error is not None and "min_loss_scale" in error, rows[1]
        assert "skipped" in error and "dropped" in error
        assert not rows[1]["changed"] and rows[1]["skipped"] == 1 and not rows[1]["norm_finite"]
        for i in (2, 3):
            assert rows[i]["error"] is None, rows[i]["error"]
            assert rows[i]["changed"] and rows[i]["norm_finite"] and rows[i]["skipped"] == 1
        assert [r["global_steps"] for r in rows] == [1, 2, 3, 4]
        assert [r["micro_steps"] for r in rows] == [gas, 2 * gas, 3 * gas, 4 * gas]
        assert {r["scale"] for r in rows} == {16}


def test_global_norm_is_accurate_for_large_flat_groups():
    """The engine's sum of squares stays accurate on a 10M-element buffer, where a single fp32
    vector_norm drifts (its error grows with the length)."""
    from zerodp.core.norm import squared_l2
    torch.manual_seed(0)
    x = torch.randn(10_000_003)
    exact = x.double().pow(2).sum().item()
    assert abs(squared_l2(x).item() - exact) / exact < 2e-6
    half = x.to(torch.bfloat16)
    assert abs(squared_l2(half).item() - half.double().pow(2).sum().item()) / exact < 2e-6
    naive = torch.linalg.vector_norm(x, dtype=torch.float32).double().item() ** 2
    assert abs(naive - exact) / exact > 2e-5  # why rows are needed (on this CPU kernel)

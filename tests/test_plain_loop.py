"""The plain PyTorch loop on what ``zerodp.initialize`` returns: parity with single-process
PyTorch at stages 0-3, with gradient accumulation the loop does itself."""
from __future__ import annotations

import plain_tasks as pt
import pytest
from parity_model import reference
from test_parity import assert_matches

STEPS = 4


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_plain_loop_matches_pytorch(pool, stage, world):
    """(loss / 2).backward() twice, optimizer.step(), optimizer.zero_grad(): the parameters and
    global norms of one process training on the whole global batch, whatever the config's
    gradient_accumulation_steps (1 here); clipping from the config."""
    results = pool.run(pt.plain_train, world, stage, STEPS, gas=2, clip=0.5)
    assert all(r["global_steps"] == STEPS and r["applied"] for r in results)
    assert_matches(results, reference(world, STEPS, gas=2, clip=0.5, branch_on_all_ranks=stage == 3))


@pytest.mark.parametrize("stage", [0, 2])
def test_plain_loop_no_sync_and_sgd(pool, stage):
    """engine.no_sync() around the first micro-batch's backward, and SGD, which is not
    scale-invariant, so averaging over ranks twice or not at all would show."""
    results = pool.run(pt.plain_train, 2, stage, STEPS, gas=2, no_sync=True, optimizer="SGD")
    assert_matches(results, reference(2, STEPS, gas=2, optimizer="SGD", branch_on_all_ranks=stage == 3))


def test_scheduler_built_on_the_returned_optimizer(pool):
    """A torch LRScheduler on the returned optimizer steps its learning rates as usual."""
    r = pool.run(pt.plain_train, 2, 2, 3, scheduler=True)[0]
    assert [lrs[0] for lrs in r["lrs"]] == pytest.approx([0.02, 0.01, 0.02 / 3])


def test_fp16_needs_a_scaled_loss(pool):
    unscaled = pool.run(pt.fp16_plain, 2, False)
    assert all("engine.scale(loss).backward()" in r["error"] for r in unscaled)
    scaled = pool.run(pt.fp16_plain, 2, True)
    assert all(r["error"] is None and r["steps"] == 1 for r in scaled)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_model_trains_with_parity(pool, stage):
    """A model compiled with torch.compile before initialize (inductor on the CPU)."""
    results = pool.run(pt.compiled_train, 2, stage, STEPS, timeout=600)
    assert all(r["error"] is None for r in results)
    ref = reference(2, STEPS, gas=2, clip=0.5, branch_on_all_ranks=stage == 3)  # stage 3: the same units on every rank
    assert_matches([dict(r, norms=ref[1]) for r in results], ref, atol=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_grads_are_none_after_a_step(pool, stage):
    """``.grad`` is None after ``engine.step()`` at every stage, as in DeepSpeed (the Hugging Face
    Trainer reads it after the step); ``zero_grad(set_to_none=False)`` leaves zeros where the stage
    keeps a full gradient buffer (0-1) and None where it keeps a shard (2)."""
    r = pool.run(pt.grads_after_step, 2, stage)[0]
    assert r["after_backward"] == (r["params"] if stage < 2 else 0)  # stage 2 keeps only the reduced shard
    assert r["after_step"] == 0
    assert r["kept"] == (r["params"] if stage < 2 else 0) and r["kept_zero"]


def test_one_rule_says_whether_a_backward_reduces_for_the_engine_and_the_plain_loop():
    """``Backward.reduces`` (``core/backward.py``): never inside ``no_sync()``; at stages 2-3 every
    backward; at stages 0-1 only at a boundary, which a plain backward never is."""
    from zerodp.core.backward import Backward
    from zerodp.core.stages import policy_for
    for stage in range(4):
        for no_sync in (False, True):
            b = Backward(None, None, policy_for(stage), lambda no_sync=no_sync: no_sync, None)
            every = stage >= 2
            assert b.reduces(boundary=True) is (not no_sync), (stage, no_sync)
            assert b.reduces(boundary=False) is (every and not no_sync), (stage, no_sync)

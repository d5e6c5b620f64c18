"""The DeepSpeed-style API surface: optimizer / lr_scheduler arguments, the config scheduler,
no_sync, accumulation boundaries, training_data, initialize errors, the global grad norm,
degenerate models, zero_grad and train/eval.

Training numbers are compared with a single process running plain torch on the whole global
batch (``api_tasks.reference``); the workers run ``api_tasks`` tasks (see its docstring for
the ``spec`` keys).
"""

import pytest
import torch
from api_tasks import (
    GROUP_LRS,
    WARMUP,
    boundary_task,
    build_model,
    dataloader_task,
    error_task,
    lr_lambda,
    named_parameters_task,
    no_sync_boundary_error_task,
    reference,
    train_many,
    train_task,
    warmup_lrs,
    zero_grad_and_modes_task,
)

TIMEOUT = 120


def flat(rows):
    """Nested lr lists, flattened for pytest.approx (which takes no nesting)."""
    return [x for row in rows for x in row]


def assert_params_match(results, ref, atol=2e-6, label=""):
    for rank, res in enumerate(results):
        assert res["params"].keys() == ref["params"].keys()
        for name, want in ref["params"].items():
            err = (res["params"][name] - want).abs().max().item()
            assert err <= atol, f"{label} rank {rank} param {name}: max |diff| {err:.3g} > {atol}"


def assert_trained(ref, model="net", min_change=1e-3, frozen=()):
    """Guard: the reference really moved the trained parameters (and only those)."""
    init = dict(build_model(model).named_parameters())
    for name, p in ref["params"].items():
        change = (p - init[name]).abs().max().item()
        if name in frozen:
            assert change == 0, f"frozen {name} changed in the reference"
        else:
            assert change > min_change, f"reference did not train {name} (max change {change:.3g})"


# -- 1. optimizer= an instance, lr_scheduler= a LambdaLR on it ---------------------------------

@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_instance_with_lambda_scheduler(pool, stage):
    spec = {"stage": stage, "opt_mode": "instance", "sched": "lambda", "steps": 4, "bucket": 20}
    results = pool.run(train_task, 2, spec, timeout=TIMEOUT)
    ref = reference(2, spec)
    assert_trained(ref)
    for res in results:
        assert res["opt_is_passed"], "initialize must return the optimizer object passed in"
        assert res["sched_is_passed"], "initialize must return the lr_scheduler object passed in"
        assert res["opt_type"] == "AdamW" and res["global_steps"] == 4
        assert res["loader_is_none"], "no training_data, no dataloader"
        # the group lrs of the instance, scaled by the lambda after each step
        want = [[lr * lr_lambda(s) for lr in GROUP_LRS] for s in range(5)]
        assert flat(res["lrs"]) == pytest.approx(flat(want), rel=1e-12)
        assert flat(res["lrs"]) == pytest.approx(flat(ref["lrs"]), rel=1e-12)
    assert_params_match(results, ref)


def test_optimizer_instance_on_named_parameters(pool):
    """An optimizer built on (name, param) pairs has 'param_names' in its group."""
    spec = {"stage": 2, "opt_mode": "instance", "groups": "named", "sched": "lambda", "steps": 3,
            "bucket": 20}
    results = pool.run(train_task, 2, spec, timeout=TIMEOUT)
    ref = reference(2, spec)
    for res in results:
        assert res["opt_is_passed"] and res["sched_is_passed"]
    assert_params_match(results, ref)


def test_lr_scheduler_callable(pool):
    """lr_scheduler= a callable taking the engine's optimizer (config optimizer block)."""
    spec = {"stage": 2, "sched": "lambda_callable", "steps": 3, "bucket": 20}
    results = pool.run(train_task, 2, spec, timeout=TIMEOUT)
    ref = reference(2, spec)
    for res in results:
        assert res["sched_type"] == "LambdaLR" and res["sched_bound"]
        assert flat(res["lrs"]) == pytest.approx(flat(ref["lrs"]), rel=1e-12)
        assert res["lrs"][-1] == pytest.approx([lr * lr_lambda(3) for lr in GROUP_LRS], rel=1e-12)
    assert_params_match(results, ref)


# -- 2. optimizer= a callable taking param groups --------------------------------------------

def test_optimizer_callable_sgd_stage2_world3(pool):
    spec = {"stage": 2, "opt": "sgd", "opt_mode": "callable", "steps": 4, "bucket": 20, "gas": 2}
    results = pool.run(train_task, 3, spec, timeout=TIMEOUT)
    ref = reference(3, spec)
    assert_trained(ref)
    for res in results:
        assert res["opt_type"] == "SGD"
        assert res["lrs"][0] == list(GROUP_LRS), "per-group lr of model_parameters must reach the callable"
    assert_params_match(results, ref)


# -- 3. the config's scheduler block ----------------------------------------------------------

def test_warmup_formula_written_out():
    """The schedule the next test expects, by hand: iteration -1 for the first step."""
    lo, hi = WARMUP["warmup_min_lr"], WARMUP["warmup_max_lr"]
    assert warmup_lrs(0) == [lo, lo] and warmup_lrs(1) == [lo, lo]
    assert warmup_lrs(2) == pytest.approx([lo + (h - lo) / 3 for h in hi])
    assert warmup_lrs(3) == pytest.approx([lo + (h - lo) * 2 / 3 for h in hi])
    assert warmup_lrs(4) == pytest.approx(hi) and warmup_lrs(9) == pytest.approx(hi)


@pytest.mark.parametrize("stage", [1, 2])
def test_config_warmup_scheduler(pool, stage):
    steps = 6
    spec = {"stage": stage, "sched": "warmup", "steps": steps, "bucket": 20}
    results = pool.run(train_task, 2, spec, timeout=TIMEOUT)
    ref = reference(2, spec)
    assert_trained(ref)
    want = [warmup_lrs(s) for s in range(steps + 1)]
    for res in results:
        assert flat(res["lrs"]) == pytest.approx(flat(want), rel=1e-12), "engine.get_lr() sequence"
        assert not res["sched_is_passed"] and res["opt_type"] == "AdamW"
    assert_params_match(results, ref)


# -- 4. no_sync -------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2])
def test_no_sync_accumulation_matches(pool, stage):
    base = {"stage": stage, "gas": 3, "steps": 2, "bucket": 20}
    with_ns, without = zip(*pool.run(train_many, 2, [{**base, "no_sync": True}, base], timeout=TIMEOUT))
    ref = reference(2, base)
    assert_trained(ref)
    assert_params_match(with_ns, ref, label="no_sync")
    assert_params_match(without, ref, label="without no_sync")
    for a, b in zip(with_ns, without):
        for name in a["params"]:
            assert torch.allclose(a["params"][name], b["params"][name], rtol=0, atol=1e-6), name
        assert a["global_steps"] == b["global_steps"] == 2
        assert a["micro_steps"] == b["micro_steps"] == 6
        # no_sync must really skip communication: stage 2 reduces every micro-batch
        # outside it, stages 0-1 only the boundary's anyway
        kind = "all_reduce" if stage == 0 else "reduce_scatter"
        assert a["comm"][kind] > 0
        assert a["comm"][kind] * (3 if stage == 2 else 1) == b["comm"][kind]


def test_no_sync_on_boundary_then_step_raises(pool):
    for rank_msgs in zip(*pool.run(no_sync_boundary_error_task, 2, [0, 1, 2], timeout=TIMEOUT)):
        for msg in rank_msgs:
            assert msg.startswith("micro 2: RuntimeError"), msg
            assert "no_sync" in msg


# -- 5. accumulation boundaries and global_steps ---------------------------------------------

@pytest.mark.parametrize("stage", [0, 2])
def test_accumulation_boundary_and_global_steps(pool, stage):
    results = pool.run(boundary_task, 2, stage, 2, 6, timeout=TIMEOUT)
    want = [{"boundary": i % 2 == 1, "global_steps": i // 2, "micro_steps": i, "changed": i % 2 == 1,
             "global_steps_after": (i + 1) // 2} for i in range(6)]
    for res in results:
        assert res == want


# -- 6. training_data ---------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
def test_training_data_loader(pool, world):
    n = 6 * world
    # micro batch size derived: train_batch_size 4 * world = micro * gas 2 * world -> micro 2
    config = {"train_batch_size": 4 * world, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    results = pool.run(dataloader_task, world, n, config, timeout=TIMEOUT)
    seen = []
    for res in results:
        assert res["micro"] == 2
        assert res["len"] == 3 and len(res["batches"]) == 3
        for xs, ys in res["batches"]:
            assert len(xs) == 2, "the loader must yield train_micro_batch_size_per_gpu samples"
            assert ys == [10 * x for x in xs], "inputs and labels must stay paired"
            seen += xs
    assert sorted(seen) == list(range(n)), "ranks must get disjoint samples covering the dataset"
    for res in results:
        assert res["second_epoch"] != res["batches"], "every epoch must reshuffle"


# -- 7. errors at initialize ------------------------------------------------------------------

def test_initialize_errors(pool):
    per_rank = pool.run(error_task, 2, timeout=TIMEOUT)
    assert per_rank[0] == per_rank[1], "both ranks must fail the same way"
    got = per_rank[0]

    def check(name, kind, *fragments):
        etype, msg = got[name]
        assert etype == kind, f"{name}: got {etype}: {msg}"
        for f in fragments:
            assert f in msg, f"{name}: {f!r} not in {msg!r}"

    check("both_optimizers", "ConfigError", "optimizer", "one or the other")
    check("both_optimizers_callable", "ConfigError", "optimizer", "one or the other")
    check("optimizer_with_state", "ValueError", "already has state")
    check("lamb_instance", "ValueError", "MyLamb", "elementwise")
    check("lamb_callable", "ValueError", "MyLamb", "elementwise")
    check("lamb_config", "ConfigError", "Lamb", "elementwise")
    check("bad_stage", "ConfigError", "zero_optimization.stage", "0, 1, 2, 3")
    check("batch_not_divisible", "ConfigError", "train_batch_size 7",
          "train_micro_batch_size_per_gpu 2 x world_size 2 = 4")
    check("batch_inconsistent", "ConfigError", "train_batch_size 12",
          "gradient_accumulation_steps 2 x world_size 2 (= 8)")
    check("foreign_tensor", "ValueError", "(4, 9)", "not a parameter of the model")
    check("duplicate_param", "ValueError", "(3,)", "groups 0 and 1")
    check("scheduler_other_optimizer", "ValueError", "different optimizer")
    from zerodp import ConfigError
    assert issubclass(ConfigError, ValueError)


def test_param_group_with_bare_tensor(pool):
    spec = {"stage": 2, "groups": "bare", "steps": 3, "bucket": 20}
    results = pool.run(train_task, 2, spec, timeout=TIMEOUT)
    assert_params_match(results, reference(2, spec))


def test_model_parameters_named_pairs(pool):
    """model_parameters=model.named_parameters(): (name, param) pairs are accepted as torch
    optimizers accept them."""
    for kind, msg in pool.run(named_parameters_task, 2, timeout=TIMEOUT):
        assert kind == "ok", f"{kind}: {msg}"


# -- 8. the global gradient norm --------------------------------------------------------------

def test_global_grad_norm_stage2_world4(pool):
    spec = {"stage": 2, "steps": 3, "gas": 2, "clip": 0.05, "bucket": 20}
    results = pool.run(train_task, 4, spec, timeout=TIMEOUT)
    ref = reference(4, spec)
    assert min(ref["norms"]) > 0.05 * 2, "clipping must bite for the test to mean anything"
    assert_trained(ref)
    for rank, res in enumerate(results):
        assert res["norm_before"] is None, "no global grad norm before the first step"
        assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5), f"rank {rank}"
    assert_params_match(results, ref)


# -- 9. degenerate models ---------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2])
def test_tiny_trainable_sets_world4(pool, stage):
    specs = [{"model": "bias_only", "stage": stage, "groups": False, "steps": 3, "gas": 2},
             {"model": "scalar", "stage": stage, "groups": False, "steps": 3, "opt": "sgd"},
             {"model": "scalar", "stage": stage, "groups": False, "steps": 3, "bucket": 1}]
    per_rank = pool.run(train_many, 4, specs, timeout=TIMEOUT)
    for i, spec in enumerate(specs):
        results = [r[i] for r in per_rank]
        ref = reference(4, spec)
        frozen = ({n for n, _ in build_model("net").named_parameters()} - {"l2.bias"}
                  if spec["model"] == "bias_only" else ())
        assert_trained(ref, spec["model"], frozen=frozen)
        assert_params_match(results, ref, label=spec["model"])
        for res in results:
            assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        # the premise: at stages 1-2 rank 0 owns every trainable element, the rest only padding
        n = 3 if spec["model"] == "bias_only" else 1
        want = [n] * 4 if stage == 0 else [n, 0, 0, 0]
        assert [r["opt_numel"] for r in results] == want


# -- 10. zero_grad, module, train/eval ---------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_grad_discards_gradients(pool, stage):
    """A backward on a junk batch followed by engine.zero_grad() leaves no trace."""
    specs = [{"stage": stage, "gas": gas, "steps": 2, "bucket": 20, "garbage_zero_grad": how}
             for gas, how in ((1, "plain"), (2, "plain"), (2, "no_sync"))]
    per_rank = pool.run(train_many, 2, specs, timeout=TIMEOUT)
    for i, spec in enumerate(specs):
        ref = reference(2, {k: v for k, v in spec.items() if k != "garbage_zero_grad"})
        assert_params_match([r[i] for r in per_rank], ref, label=f"gas {spec['gas']} {spec['garbage_zero_grad']}")
        for r in per_rank:
            assert r[i]["module_is_model"]


def test_module_identity_and_train_eval(pool):
    for res in pool.run(zero_grad_and_modes_task, 2, timeout=TIMEOUT):
        assert res["module_is_model"] and res["initially_training"]
        assert res["eval_flags"] == [False, False, False]
        assert res["eval_deterministic"]
        assert res["train_flags"] == [True, True, True]
        assert res["train_dropout_active"]
        assert res["module_eval_used"]

"""Lightning's Trainer and Fabric on ``zerodp.lightning``'s strategies give what Lightning's DDP
strategy gives on the same module, seed and data: losses and final weights, at stages 1-3,
with offload, accumulation and clipping, in fp32 (bf16 within its precision); checkpoints saved
by 2 ranks at stage 3 resume 1 rank at stage 1 through ``Trainer.fit(ckpt_path="last")``, and
export to one file that ``load_from_checkpoint`` reads. Everything runs in an environment
without DeepSpeed (``no_deepspeed_python``), the runs in three torchrun jobs
(``lightning_tasks.py``); a fourth checks Lightning's own ``DeepSpeedStrategy`` under
``ZERODP_AS_DEEPSPEED=1``, and a fifth the standalone ``pytorch_lightning`` and ``lightning_fabric``
with ``zerodp.pytorch_lightning``, where ``lightning`` is not installed."""
from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_cases import run_cases

pytest.importorskip("lightning")

HERE = Path(__file__).parent
TOL = 1e-5

TRAINER = ["ddp", "z1", "z2", "z3", "z2-off", "z3-off", "ddp-gas2-sgd", "z2-gas2-sgd", "z3-gas2-sgd",
           "ddp-clip", "z3-clip", "z1-clip", "ddp-gas2-sgd-clip", "z3-gas2-sgd-clip",
           "ddp-sgd", "ddp-bf16-sgd", "z3-bf16-sgd", "ddp-fp16-sgd", "z3-fp16-sgd",
           "ddp-cfg", "z3-cfg-name", "z2-off-name", "ddp-eval", "z3-eval", "z3-log", "z3-summary", "z3-save", "z3-full",
           "ddp-4ep"]
FABRIC = ["fabric-ddp", "fabric-z1", "fabric-z2", "fabric-z3", "fabric-z3-off", "fabric-z3-init",
          "fabric-ddp-gas2-sgd-clip", "fabric-z2-gas2-sgd-clip", "fabric-z3-gas2-sgd-clip", "fabric-z3-resume",
          "fabric-z2-off-resume"]
ALIAS = ["ddp", "z3-ds", "z2-ds", "z3-dscpu", "ddp-docs", "z3-off-name-docs", "fabric-ddp", "fabric-z3-ds-resume"]


def run(python: str, work: Path, cases: list[str], ranks: int, alias: bool = False, name: str = "out") -> dict:
    return run_cases(python, HERE / "lightning_tasks.py", work / f"{name}.json", [str(work)], cases, ranks,
                     ZERODP_AS_DEEPSPEED="1" if alias else "0")


@pytest.fixture(scope="module")
def results(no_deepspeed_python, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("lightning")
    found = run(no_deepspeed_python, work, TRAINER + FABRIC, 2)
    found.update(run(no_deepspeed_python, work, ["z1-resume"], 1, name="resume"))
    return found


@pytest.fixture(scope="module")
def alias_results(no_deepspeed_python, tmp_path_factory) -> dict:
    return run(no_deepspeed_python, tmp_path_factory.mktemp("lightning_alias"), ALIAS, 2, alias=True)


def max_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for name in b for x, y in zip(a[name], b[name], strict=True))


def assert_same_run(run: dict, ref: dict, tol: float = TOL) -> None:
    assert len(run["losses"]) == len(ref["losses"]) > 0
    assert max(abs(x - y) for x, y in zip(run["losses"], ref["losses"])) <= tol
    assert max_diff(run["weights"], ref["weights"]) <= tol
    assert run.get("lrs") == ref.get("lrs")
    if ref.get("init"):  # training moved the weights: the comparison is not of two untouched models
        assert max_diff(ref["weights"], ref["init"]) > 1e-3


@pytest.mark.parametrize("case,ref", [
    ("z1", "ddp"), ("z2", "ddp"), ("z3", "ddp"), ("z2-off", "ddp"), ("z3-off", "ddp"), ("z2-off-name", "ddp"),
    ("z2-gas2-sgd", "ddp-gas2-sgd"), ("z3-gas2-sgd", "ddp-gas2-sgd"), ("z1-clip", "ddp-clip"),
    ("z3-clip", "ddp-clip"), ("z3-gas2-sgd-clip", "ddp-gas2-sgd-clip"), ("z3-cfg-name", "ddp-cfg"),
    ("z3-eval", "ddp-eval"), ("z3-summary", "ddp")])
def test_trainer_equals_lightning_ddp(results, case, ref):
    assert results[case]["strategy"] == "ZeroStrategy" and results[ref]["strategy"] == "DDPStrategy"
    assert results[case]["is_deepspeed_strategy"]  # Lightning treats it as its DeepSpeed strategy
    assert_same_run(results[case], results[ref])


def test_the_cases_differ_where_they_should(results):
    """Accumulation and clipping change the run (so their parity tests test something)."""
    assert max_diff(results["ddp-gas2-sgd-clip"]["weights"], results["ddp-gas2-sgd"]["weights"]) > 1e-3
    assert max_diff(results["ddp-clip"]["weights"], results["ddp"]["weights"]) > 1e-3


def test_bf16_within_its_precision(results):
    fp32, ours, theirs = results["ddp-sgd"], results["z3-bf16-sgd"], results["ddp-bf16-sgd"]
    assert ours["param_dtype"] == "torch.bfloat16" and theirs["param_dtype"] == "torch.float32"  # autocast
    assert max(abs(x - y) for x, y in zip(ours["losses"], theirs["losses"])) < 2e-2
    # zerodp computes with bf16 parameters (as DeepSpeed), Lightning's DDP under autocast: as far from fp32,
    # give or take the rounding of the final weights to bf16 (2^-8 below 1)
    assert max_diff(ours["weights"], fp32["weights"]) <= 3 * max_diff(theirs["weights"], fp32["weights"]) + 2 ** -8


def test_fp16_within_its_precision(results):
    """``16-mixed``: fp16 parameters with the strategy's loss scaling (a scale that overflows none of
    this model's gradients, so every step is taken), as far from fp32 as DDP's autocast with GradScaler."""
    fp32, ours, theirs = results["ddp-sgd"], results["z3-fp16-sgd"], results["ddp-fp16-sgd"]
    assert ours["param_dtype"] == "torch.float16" and theirs["param_dtype"] == "torch.float32"
    assert max(abs(x - y) for x, y in zip(ours["losses"], theirs["losses"])) < 1e-2
    assert max_diff(ours["weights"], fp32["weights"]) <= 3 * max_diff(theirs["weights"], fp32["weights"]) + 2 ** -10


def test_configure_model_builds_the_layers_sharded_at_stage_3(results):
    assert results["z3-cfg-name"]["built_sharded"] == [True]
    assert results["ddp-cfg"]["built_sharded"] == [False]


def test_validate_test_predict_after_fit(results):
    ours, ref = results["z3-eval"], results["ddp-eval"]
    assert abs(ours["validate"] - ref["validate"]) <= TOL and abs(ours["test"] - ref["test"]) <= TOL
    assert max(abs(x - y) for x, y in zip(ours["predict"], ref["predict"], strict=True)) <= TOL


def test_the_loggers_get_zerodps_measurements(results):
    values = results["z3-log"]["logged_values"]
    for key in ("zerodp/mem_parameters", "zerodp/mem_optimizer_states", "zerodp/comm_reduce_scatter",
                "zerodp/comm_all_gather", "zerodp/comm_total"):
        assert key in values, sorted(values)
    full = sum(len(w) for w in results["z3"]["weights"].values()) * 4
    assert 0 < values["zerodp/mem_parameters"] < full  # stage 3 over 2 ranks holds a shard
    assert values["zerodp/comm_total"] > 0


def test_checkpoint_exports_to_one_file_load_from_checkpoint_reads(results):
    saved = results["z3-save"]
    assert "last.ckpt" in saved["saved"]
    assert max_diff(saved["reloaded"], saved["weights"]) == 0.0


def test_the_one_file_loads_back_sharded_with_load_full_weights(results):
    assert max_diff(results["z3-full"]["weights"], results["z3-save"]["weights"]) == 0.0
    assert results["z3-full"]["validate"] > 0


def test_saved_at_2_ranks_stage_3_resumes_at_1_rank_stage_1(results):
    """``fit(ckpt_path="last")`` with one rank and twice the batch (the same global batches)
    ends where two ranks training four epochs straight end."""
    resumed, straight = results["z1-resume"], results["ddp-4ep"]
    assert max_diff(resumed["weights"], straight["weights"]) <= TOL
    assert resumed["lrs"] == straight["lrs"][len(straight["lrs"]) // 2:]  # the schedule went on, not over


@pytest.mark.parametrize("case,ref", [
    ("fabric-z1", "fabric-ddp"), ("fabric-z2", "fabric-ddp"), ("fabric-z3", "fabric-ddp"),
    ("fabric-z3-off", "fabric-ddp"), ("fabric-z3-init", "fabric-ddp"),
    ("fabric-z2-gas2-sgd-clip", "fabric-ddp-gas2-sgd-clip"), ("fabric-z3-gas2-sgd-clip", "fabric-ddp-gas2-sgd-clip"),
    ("fabric-z3-resume", "fabric-ddp"), ("fabric-z2-off-resume", "fabric-ddp")])
def test_fabric_equals_lightning_ddp(results, case, ref):
    assert_same_run(results[case], results[ref])
    assert "zerodp/comm_total" in results[case]["metrics"]


def test_fabric_init_module_builds_sharded_at_stage_3(results):
    assert results["fabric-z3-init"]["built_sharded"] == [True]
    assert results["fabric-z3"]["built_sharded"] == [False]


def test_lightnings_own_deepspeed_strategy_runs_on_zerodp_under_the_alias(alias_results):
    """``ZERODP_AS_DEEPSPEED=1``: Lightning's ``DeepSpeedStrategy`` code, with only its CUDA-only
    checks lifted (what runs on CUDA), trains as DDP does; with the checks, on CPU, its error
    names the zerodp strategy to use."""
    for case in ("z3-ds", "z2-ds"):
        assert alias_results[case]["strategy"] == "CPUDeepSpeed"
        assert_same_run(alias_results[case], alias_results["ddp"])
    assert_same_run(alias_results["fabric-z3-ds-resume"], alias_results["fabric-ddp"])  # Fabric's, through a save
    error = alias_results["z3-dscpu"]["error"]
    assert "only supported on CUDA" in error and 'strategy="zerodp_stage_3"' in error


def test_a_module_written_for_lightnings_deepspeed_guide_runs_with_the_name_changed(alias_results):
    ours, ref = alias_results["z3-off-name-docs"], alias_results["ddp-docs"]
    assert ours["strategy"] == "ZeroStrategy" and ours["built_sharded"] == [True]
    assert_same_run(ours, ref)


# -- without processes ------------------------------------------------------------------------


def test_registered_under_deepspeeds_names():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    import zerodp.lightning as zl
    names = ["zerodp", "zerodp_stage_1", "zerodp_stage_2", "zerodp_stage_2_offload", "zerodp_stage_3",
             "zerodp_stage_3_offload", "zerodp_stage_3_offload_nvme"]
    for name in names:
        assert StrategyRegistry[name]["strategy"] is zl.ZeroStrategy
        assert STRATEGY_REGISTRY[name]["strategy"] is zl.ZeroFabricStrategy
    assert StrategyRegistry["zerodp_stage_3_offload"]["init_params"] == {
        "stage": 3, "offload_optimizer": True, "offload_parameters": True}
    strategy = StrategyRegistry.get("zerodp_stage_2_offload")
    assert strategy.config["zero_optimization"]["stage"] == 2
    assert strategy.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_takes_deepspeed_strategys_arguments(tmp_path):
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from zerodp.lightning import ZeroFabricStrategy, ZeroStrategy
    assert inspect.signature(ZeroStrategy) == inspect.signature(DeepSpeedStrategy)
    s = ZeroStrategy(stage=3, offload_parameters=True, reduce_bucket_size=1000, logging_batch_size_per_gpu=4)
    zero = s.config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu" and zero["reduce_bucket_size"] == 1000
    assert s.config["train_micro_batch_size_per_gpu"] == 4 and s.zero_stage_3
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert ZeroFabricStrategy(config=str(path)).config == {"zero_optimization": {"stage": 1}}
    with pytest.raises(TypeError, match="DeepSpeedStrategy"):
        ZeroStrategy(stages=3)


# -- the standalone pytorch_lightning and lightning_fabric ------------------------------------------

STANDALONE = ["ddp", "z2", "z3", "z3-summary", "z3-off", "ddp-cfg", "z3-cfg-name", "fabric-ddp", "fabric-z3",
              "fabric-z3-init"]


@pytest.fixture(scope="module")
def standalone_results(tmp_path_factory) -> dict:
    """The cases with ``import pytorch_lightning`` / ``lightning_fabric`` and
    ``zerodp.pytorch_lightning``, in a Python where the unified ``lightning`` package is absent."""
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    from _common import python_without_deepspeed
    work = tmp_path_factory.mktemp("standalone")
    python = python_without_deepspeed(str(work / "env"), also=("lightning",))
    probe = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('lightning') is None, "
                            "u.find_spec('pytorch_lightning') is not None)"], capture_output=True, text=True)
    assert probe.stdout.split() == ["True", "True"], probe.stdout + probe.stderr
    return run_cases(python, HERE / "lightning_tasks.py", work / "out.json", [str(work)], STANDALONE, 2,
                     ZERODP_LIGHTNING_FLAVOR="standalone", ZERODP_AS_DEEPSPEED="0")


@pytest.mark.parametrize("case,ref", [("z2", "ddp"), ("z3", "ddp"), ("z3-summary", "ddp"), ("z3-off", "ddp"),
                                      ("z3-cfg-name", "ddp-cfg"), ("fabric-z3", "fabric-ddp"),
                                      ("fabric-z3-init", "fabric-ddp")])
def test_pytorch_lightning_standalone_equals_its_ddp(standalone_results, case, ref):
    """``pytorch_lightning.Trainer(strategy=zerodp.pytorch_lightning.ZeroStrategy(...))`` (or a
    registered name) and ``lightning_fabric.Fabric`` train as their DDP does, without ``lightning``."""
    assert_same_run(standalone_results[case], standalone_results[ref])
    if not case.startswith("fabric"):
        assert standalone_results[case]["is_deepspeed_strategy"]
        assert standalone_results[case]["strategy"] == "ZeroStrategy"
    if case.endswith(("cfg-name", "init")):
        assert standalone_results[case]["built_sharded"] == [True]

"""Lightning on CUDA: ``ZeroStrategy`` and ``ZeroFabricStrategy`` on one GPU (NCCL) equal Lightning's
DDP on the same GPU; and under ``ZERODP_AS_DEEPSPEED=1`` Lightning's own ``DeepSpeedStrategy``, as
it is (it runs only on CUDA), trains on zerodp as DDP does (``lightning_tasks.py``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from test_lightning import assert_same_run, max_diff, run  # noqa: E402

CASES = ["ddp", "z2", "z3", "z3-off", "ddp-gas2-sgd", "z3-gas2-sgd", "ddp-sgd", "ddp-bf16-sgd", "z3-bf16-sgd",
         "z3-cfg-name", "ddp-cfg",
         "fabric-ddp", "fabric-z3", "fabric-z3-init", "fabric-ddp-init"]
ALIAS = ["ddp", "z3-ds", "z2-ds"]


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def results(hf_python, device, tmp_path_factory, monkeypatch_module) -> dict:
    monkeypatch_module.setenv("ZERODP_LIGHTNING_TASKS_DEVICE", device.type)
    work = tmp_path_factory.mktemp("lightning_cuda")
    found = run(hf_python, work, CASES, 1)
    found.update({f"alias-{k}": v for k, v in run(hf_python, work, ALIAS, 1, alias=True, name="alias").items()})
    return found


@pytest.mark.parametrize("case,ref", [("z2", "ddp"), ("z3", "ddp"), ("z3-off", "ddp"), ("z3-gas2-sgd", "ddp-gas2-sgd"),
                                      ("z3-cfg-name", "ddp-cfg"), ("fabric-z3", "fabric-ddp"),
                                      ("fabric-z3-init", "fabric-ddp-init"), ("alias-z3-ds", "alias-ddp"),
                                      ("alias-z2-ds", "alias-ddp")])
def test_lightning_on_the_gpu_equals_ddp(results, case, ref):
    """A model made in ``configure_model`` or ``init_module`` is built on the GPU by DDP's context and
    by ``zero.Init`` alike (DeepSpeed's too), so its seeded values come from the GPU's generator."""
    assert_same_run(results[case], results[ref])


def test_bf16_on_the_gpu(results):
    fp32, ours, theirs = results["ddp-sgd"], results["z3-bf16-sgd"], results["ddp-bf16-sgd"]
    assert ours["param_dtype"] == "torch.bfloat16" and theirs["param_dtype"] == "torch.float32"  # autocast
    assert ours["param_dtype"] == "torch.bfloat16"
    assert max_diff(ours["weights"], fp32["weights"]) <= 3 * max_diff(theirs["weights"], fp32["weights"]) + 2 ** -8


def test_the_alias_ran_lightnings_strategy_unchanged(results, device):
    expected = "DeepSpeedStrategy" if device.type == "cuda" else "CPUDeepSpeed"  # on the CPU its checks are lifted
    assert results["alias-z3-ds"]["strategy"] == expected

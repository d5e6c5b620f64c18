"""TRL's trainers with a DeepSpeed config train on zerodp (``ZERODP_AS_DEEPSPEED=1``) exactly as
without DeepSpeed: ``SFTTrainer`` and ``DPOTrainer`` (its reference model in an engine without
optimizer) at stages 2 and 3, ``SFTTrainer`` with a ``peft_config`` on a model it loads by path (at
stage 3 built in ``zero.Init``, then given LoRA adapters) at stages 2 and 3, and ``GRPOTrainer`` at
stage 3, which generates with the model it trains through TRL's ``unwrap_model_for_generation``
(``GatheredParameters`` over the engine's parameters, ``optimizer.parameter_offload``'s hooks,
``ds_status``, ``ds_active_sub_modules``, ``ds_external_parameters``). One 2-rank torchrun job runs
every case (``trl_tasks.py``) in the environment without DeepSpeed."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SRC = str(HERE.parent / "src")

CASES = {"sft": ["2", "3"], "sftlora": ["2", "3"], "dpo": ["2", "3"], "grpo": ["3"]}
# 4 ranks: AutoTP over pairs against the reference with one sample per device (the same samples a step)
TP_CASES = {"sft": ["2-tp2"], "dpo": ["2-tp2"]}


def run_cases(python: str, tmp: Path, cases: list[str], ranks: int) -> dict:
    out = tmp / "results.json"
    env = dict(os.environ, ZERODP_AS_DEEPSPEED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (SRC, str(HERE), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                           str(HERE / "trl_tasks.py"), str(out), *cases],
                          env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), (proc.stdout + proc.stderr)[-5000:]  # judged by what rank 0 reported
    found = json.loads(out.read_text())
    assert sorted(found) == sorted(cases)
    assert "zerodp ignores" not in proc.stderr  # TRL's dotted config keys are ignored silently
    return found


@pytest.fixture(scope="module")
def results(no_deepspeed_python, tmp_path_factory) -> dict:
    cases = [f"{kind}-{stage}" for kind, stages in CASES.items() for stage in ["plain", *stages]]
    return run_cases(no_deepspeed_python, tmp_path_factory.mktemp("trl"), cases, 2)


@pytest.fixture(scope="module")
def tp_results(no_deepspeed_python, tmp_path_factory) -> dict:
    cases = [f"{kind}-{stage}" for kind, stages in TP_CASES.items() for stage in ["plain-half", *stages]]
    return run_cases(no_deepspeed_python, tmp_path_factory.mktemp("trl_tp"), cases, 4)


@pytest.mark.parametrize("case", [f"{k}-{s}" for k, stages in TP_CASES.items() for s in stages])
def test_trl_trainer_with_autotp_equals_it_without_deepspeed(tp_results, case):
    """SFT, and DPO (whose reference model TRL puts in an engine of its own, which splits it) with
    ``autotp_size`` 2 on 4 ranks: TRL's losses equal its own without DeepSpeed on the same samples.
    (At stage 3 under AutoTP, TRL's DPO fails in its own code: its fused log-probabilities gather
    a ``DTensor`` head with ``full_tensor()`` and then read ``ds_status`` on the result.)"""
    got, want = tp_results[case], tp_results[case.split("-")[0] + "-plain-half"]
    assert len(got) == 3 and len(want) == 3
    assert all(abs(a - b) <= 1e-5 * max(abs(a), abs(b), 1e-3) for a, b in zip(got, want)), (got, want)


@pytest.mark.parametrize("case", [f"{k}-{s}" for k, stages in CASES.items() for s in stages])
def test_trl_trainer_on_zerodp_equals_it_without_deepspeed(results, case):
    got, want = results[case], results[case.split("-")[0] + "-plain"]
    assert len(got) == 3 and len(want) == 3
    assert all(abs(a - b) <= 1e-5 * max(abs(a), abs(b), 1e-3) for a, b in zip(got, want)), (got, want)

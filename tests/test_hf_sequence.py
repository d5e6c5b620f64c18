"""The Hugging Face Trainer and TRL's SFTTrainer with DeepSpeed's sequence parallelism
(``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N))``, as
the Hugging Face guide writes it) on zerodp under ``ZERODP_AS_DEEPSPEED=1``: Accelerate registers
Ulysses with transformers, wraps the data loader and initializes with the mpu, exactly as with
DeepSpeed. Each run trains a small Llama (2 key/value heads, sdpa) three steps and is compared with
the plain Trainer on one process, which draws the same samples in the same order.

N is the number of processes (2 and 4): the Trainer's loss all-gathers over the sequence group
with ``torch.distributed.nn.functional.all_gather``, whose backward on gloo works only for a group
holding rank 0 (``docs/parallel.md``)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torchrun_cases

HERE = Path(__file__).parent
SP2 = ["z1-sp2", "z2-sp2", "z3-sp2", "sft-z2-sp2"]
SP4 = ["z2-sp4", "z3-sp4", "sft-z3-sp4"]


def run(python: str, tmp: Path, cases: list[str], ranks: int, deepspeed: bool = True) -> dict:
    env = {"ZERODP_AS_DEEPSPEED": "1"} if deepspeed else {}
    return torchrun_cases.run_cases(python, HERE / "hf_sp_tasks.py", tmp / f"results{ranks}.json", [], cases, ranks,
                                    TOKENIZERS_PARALLELISM="false", **env)


@pytest.fixture(scope="module")
def results(no_deepspeed_python, tmp_path_factory) -> dict:
    pytest.importorskip("accelerate")
    pytest.importorskip("trl")
    tmp = tmp_path_factory.mktemp("hf_sp")
    out = run(no_deepspeed_python, tmp, ["plain", "sft-plain"], 1, deepspeed=False)
    out.update(run(no_deepspeed_python, tmp, SP2, 2))
    out.update(run(no_deepspeed_python, tmp, SP4, 4))
    return out


def close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) == 3 and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", [c for c in SP2 + SP4 if not c.startswith("sft")])
def test_the_trainer_with_sequence_parallelism_trains_as_one_process(results, case):
    got, ref = results[case], results["plain"]
    assert close(got["loss"], ref["loss"], 1e-5), (got, ref)
    assert close(got["grad_norm"], ref["grad_norm"], 1e-5), (got, ref)  # DeepSpeed's would be N times larger


@pytest.mark.parametrize("case", [c for c in SP2 + SP4 if c.startswith("sft")])
def test_trls_sft_trainer_with_sequence_parallelism_runs_on_the_same_samples(results, case):
    """TRL's SFTTrainer under sequence parallelism: the same samples (the first step's loss agrees
    with one process within 1e-4 and its gradient norm within 1e-3)."""
    got, ref = results[case], results["sft-plain"]
    assert len(got["loss"]) == 3
    assert abs(got["loss"][0] - ref["loss"][0]) <= 1e-4 * ref["loss"][0], (got, ref)
    assert abs(got["grad_norm"][0] - ref["grad_norm"][0]) <= 1e-3 * ref["grad_norm"][0], (got, ref)


@pytest.mark.xfail(strict=True, reason="TRL's SFT loss under sequence parallelism (its fused LM head on the "
                   "slices) differs from its loss without it: 4e-5 in the first step's loss, 6e-4 in its gradient "
                   "norm, 1% by the third step; the Trainer's own loss agrees to 1e-6. Cause not found yet.")
def test_trls_sft_trainer_with_sequence_parallelism_trains_as_one_process(results):
    got, ref = results["sft-z2-sp2"], results["sft-plain"]
    assert close(got["loss"], ref["loss"], 1e-5) and close(got["grad_norm"], ref["grad_norm"], 1e-5), (got, ref)

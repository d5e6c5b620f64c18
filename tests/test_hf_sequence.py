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
SP2 = ["z1-sp2", "z2-sp2", "z3-sp2", "sft-z2-sp2", "z3-sp2-ckoff"]
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


@pytest.mark.parametrize("case", SP2 + SP4)
def test_the_trainer_with_sequence_parallelism_trains_as_one_process(results, case):
    """The Trainer, and TRL's SFTTrainer (``sft-``, fp32: ``bf16=False``), against the same trainer on
    one process without sequence parallelism."""
    got, ref = results[case], results["sft-plain" if case.startswith("sft") else "plain"]
    assert close(got["loss"], ref["loss"], 1e-5), (got, ref)
    assert close(got["grad_norm"], ref["grad_norm"], 1e-5), (got, ref)  # DeepSpeed's would be N times larger


def test_the_trainers_checkpointed_layers_wait_in_host_memory(results):
    """``-ckoff``: the Trainer's gradient checkpointing with ``cpu_checkpointing``: the engine marked
    both decoder layers' hidden states in each of the 3 steps (and trained as one process, above)."""
    assert results["z3-sp2-ckoff"]["offload_marked"] == 2 * 3
    assert results["z3-sp2"]["offload_marked"] == 0

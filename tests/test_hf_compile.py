"""The Hugging Face ``Trainer`` with ``torch_compile=True`` on zerodp (``ZERODP_AS_DEEPSPEED=1``): a
transformers Llama trains five steps with the plain, uncompiled Trainer's losses (to 1e-5 relative) at
stages 0-3 compiled by inductor through ``engine.compile`` (Accelerate's call), and at stage 3 through
Accelerate's regional compilation (each decoder layer compiled in place after ``initialize``). One
2-rank torchrun job runs every case (``hf_compile_tasks.py``)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torchrun_cases

HERE = Path(__file__).parent
COMPILED = ["z0-c", "z1-c", "z2-c", "z3-c", "z3-c-reg"]
HOOKS = "Skip calling `torch.compiler.disable()`d function"


@pytest.fixture(scope="module")
def results(no_deepspeed_python, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("hf_compile")
    return torchrun_cases.run_cases(no_deepspeed_python, HERE / "hf_compile_tasks.py", tmp / "results.json", [],
                                    ["plain", *COMPILED], 2, ZERODP_AS_DEEPSPEED="1",
                                    TOKENIZERS_PARALLELISM="false")


@pytest.mark.parametrize("case", COMPILED)
def test_trainer_torch_compile_equals_the_uncompiled_trainer(results, case):
    got, ref = results[case], results["plain"]
    assert len(got["loss"]) == len(ref["loss"]) == 5
    assert all(abs(a - b) <= 1e-5 * max(abs(a), abs(b)) for a, b in zip(got["loss"], ref["loss"])), (got, ref)
    assert got["graphs"] > 0
    if case.endswith("-reg"):  # Accelerate compiled the decoder layers in place
        assert got["layers_compiled"] and not got["engine_compiled"]
    else:
        assert got["engine_compiled"]
    assert set(got["breaks"]) <= {HOOKS}, got["breaks"]
    if not case.startswith("z3"):  # no units' hooks: the whole model one graph
        assert got["graphs"] == 1 and not got["breaks"]

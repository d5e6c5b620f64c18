"""The Hugging Face ``Trainer`` with a DeepSpeed Muon config on zerodp (``ZERODP_AS_DEEPSPEED=1``): a
transformers Llama trains five steps at stages 0-3, on 2 and on 3 ranks, to the parameters of the Trainer's own DDP loop
running the same math on whole parameters (to 1e-5 relative). One torchrun job per world size runs
every case (``hf_muon_tasks.py``)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchrun_cases

HERE = Path(__file__).parent
STAGES = ["z0", "z1", "z2", "z3"]


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def results(request, no_deepspeed_python, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("hf_muon")
    return torchrun_cases.run_cases(no_deepspeed_python, HERE / "hf_muon_tasks.py", tmp / "results.json", [],
                                    ["plain", *STAGES], request.param, ZERODP_AS_DEEPSPEED="1",
                                    TOKENIZERS_PARALLELISM="false")


@pytest.mark.parametrize("case", STAGES)
def test_trainer_muon_equals_the_same_math_on_whole_parameters(results, case):
    got, ref = results[case], results["plain"]
    assert got["optimizer"] == "MuonWithAuxAdam"
    assert [g[:4] for g in got["groups"]] == [["muon-params", True, 0.02, 0.1], ["adam-params", False, 3e-3, 0.1]]
    assert len(got["loss"]) == len(ref["loss"]) == 5
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    ours, theirs = torch.load(got["params"]), torch.load(ref["params"])
    assert sorted(ours) == sorted(theirs)
    worst = max(((ours[n] - p).norm() / p.norm()).item() for n, p in theirs.items())
    assert worst <= 1e-5

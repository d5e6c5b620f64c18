"""DeepSpeed's MoE layer (``zerodp.moe``): the same numbers as DeepSpeed's own layer on the same seed,
for every gate (top-1 with Random Token Selection or without, RSample and Jitter noise, top-2 with
and without the sampled second expert, top-3), with capacity drops and without, residual MoE, eval
mode; and the param-group helpers DeepSpeed's scripts call."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).resolve().parent


def test_moe_layer_equals_deepspeeds_own_on_the_same_seed():
    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(HERE))
    from ds_moe_layer_check import CASES
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(HERE / "ds_moe_layer_check.py")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in rows] == list(CASES)
    for r in rows:
        assert r["out_norm"] > 0.1, r  # the layer computed something
        for key in ("init", "out", "l_aux", "counts", "x_grad", "grads"):
            assert r[key] <= 1e-6, (r["case"], key, r[key])


def _marked(n: int, group: str = "ep_size_2") -> list[nn.Parameter]:
    ps = [nn.Parameter(torch.zeros(3)) for _ in range(n)]
    for p in ps:
        p.allreduce, p.group_name = False, group
    return ps


def test_moe_param_group_helpers_split_as_deepspeed_does():
    from zerodp.moe import utils
    dense = [nn.Parameter(torch.zeros(2)) for _ in range(2)]
    experts = _marked(3)
    groups = utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": dense + experts, "name": "parameters", "lr": 0.1}, max_group_size=7)
    assert groups[0]["params"] == dense and groups[0]["name"] == "parameters" and "moe" not in groups[0]
    # 3 + 3 elements fit in 7, the third starts a new group; every expert group keeps the options
    assert [[id(p) for p in g["params"]] for g in groups[1:]] == [[id(experts[0]), id(experts[1])], [id(experts[2])]]
    assert all(g["moe"] and g["name"] == "ep_size_2" and g["lr"] == 0.1 for g in groups[1:])
    assert utils.is_moe_param(experts[0]) and not utils.is_moe_param(dense[0])
    assert utils.split_params_into_shared_and_expert_params(dense + experts) == (dense, experts)
    made = utils.configure_moe_param_groups(dense + experts)
    assert [g.get("name") for g in made] == ["dense-params", "ep_size_2"]
    assert utils.configure_moe_param_groups(made) is made  # already split
    with pytest.raises(ValueError, match="unknown param group type"):
        utils.split_params_into_different_moe_groups_for_optimizer("params")
    from zerodp.moe.layer import MoE
    model = nn.Sequential(nn.Linear(4, 4), MoE(4, nn.Linear(4, 4), num_experts=2, min_capacity=0))
    assert utils.has_moe_layers(model) == (True, 2) and utils.has_moe_layers(nn.Linear(2, 2)) == (False, 0)
    assert all(utils.is_moe_param(p) == (".experts." in n) for n, p in model.named_parameters())


def test_moe_layer_refusals():
    from zerodp.moe.layer import MoE
    with pytest.raises(ValueError, match="expert-parallel size 3 does not divide the 4 experts"):
        MoE(4, nn.Linear(4, 4), num_experts=4, ep_size=3)
    with pytest.raises(ValueError, match="noisy_gate_policy 'Gaussian'"):
        MoE(4, nn.Linear(4, 4), num_experts=4, noisy_gate_policy="Gaussian")
    with pytest.raises(ValueError, match="k=5 is not between 1 and the 4 experts"):
        MoE(4, nn.Linear(4, 4), num_experts=4, k=5)
    layer = MoE(4, nn.Linear(4, 4), num_experts=4, min_capacity=8)
    with pytest.raises(ValueError, match="6 tokens, fewer than min_capacity=8"):
        layer(torch.randn(6, 4))


@pytest.mark.parametrize("stage,ep,gate,extra", [
    (0, 2, "top2", {}), (1, 4, "top2", {"param_groups": True}), (2, 2, "top1", {}),
    (3, 4, "top1-nodrop", {}), (3, 2, "top2", {"deferred": True}), (2, 4, "residual", {}), (1, 2, "top3", {}),
    (3, 4, "top2", {"init": True})])
def test_moe_layer_split_over_ranks_trains_as_with_every_expert_everywhere(pool, stage, ep, gate, extra):
    """4 ranks, ZeRO ``stage``: experts over groups of ``ep`` ranks against ``ep_size=1``, the same
    losses, clipped gradient norms and (whole, by global expert index) parameters within 1e-5.
    ``param_groups``: the optimizer groups of DeepSpeed's ``--moe-param-group``; ``deferred``: the
    layer made before torch.distributed was up, its groups joined by ``initialize``; ``init``: made in
    ``zero.Init`` (the expert's copies from its gathered values)."""
    from moe_layer_tasks import train_against_ep1
    results = pool.run(train_against_ep1, 4, stage, ep, gate, **extra)
    experts_seen = set()
    for r in results:
        split, whole = r["split"], r["whole"]
        for got, want in zip(split["losses"] + split["norms"], whole["losses"] + whole["norms"]):
            assert abs(got - want) <= 1e-5 * abs(want), (split["losses"], whole["losses"], split["norms"],
                                                          whole["norms"])
        for name, value in split["params"].items():
            torch.testing.assert_close(value, whole["params"][name], rtol=1e-5, atol=1e-6, msg=name)
        experts_seen |= {n.split(".")[4] for n in split["params"] if "deepspeed_experts" in n}
        assert "expert" in split["groups"], split["groups"]  # the token exchanges, counted
    assert experts_seen == {str(e) for e in range(4)}
    assert results[0]["whole"]["losses"] != results[1]["whole"]["losses"]  # the ranks saw different tokens

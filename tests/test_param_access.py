"""DeepSpeed's parameter-access functions (``deepspeed.utils.safe_get_full_grad`` and its family, in
``zerodp.utils``) at every stage with two ranks: between backward and step the full gradient of
every trainable parameter is the single-process gradient of the global batch; the full fp32 value
is the master; after the step the full AdamW states are torch's; the local variants are this
rank's part of the same; setting a parameter changes what the next forward computes (and the
16-bit parameter under bf16). Optimizer offload reads and writes the masters and states where
they live."""
from __future__ import annotations

import pytest
import torch
from param_access_tasks import access_task, bf16_set_task, probe_loss, reference_pieces

WORLD = 2
CASES = [(0, None), (1, None), (2, None), (3, None), (3, "cpu"), (2, "nvme")]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-6) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("stage,offload", CASES, ids=[f"z{s}" + (f"-{o}" if o else "") for s, o in CASES])
def test_full_and_local_values_equal_the_single_process_ones(pool, stage, offload):
    ref = reference_pieces(WORLD, branch_on_all_ranks=stage == 3)
    ranks = pool.run(access_task, WORLD, stage, offload)
    for r in ranks:
        assert r["none_before"] and r["none_after"]
        assert r["frozen"] == [None, None, None]
        assert sorted(r["grad"]) == sorted(ref["before"])
        for name, want in ref["grad"].items():
            assert close(r["grad"][name], want), (name, r["grad"][name], want)
            assert r["grad"][name].dtype == torch.float32
        for name in ref["before"]:
            assert close(r["before"][name], ref["before"][name], 1e-6), name
            assert close(r["after"][name], ref["after"][name], 1e-5), name
            assert torch.equal(r["after"][name], r["gathered_masters"][name])
            for key in ("exp_avg", "exp_avg_sq"):
                assert close(r[key][name], ref[key][name], 1e-5), (key, name)
        # the local variants: this rank's part, each element held once over the ranks
        for name, full in r["after"].items():
            lo, hi = r["pieces"].get(name, (0, 0))
            assert torch.equal(r["local_param"][name], full.reshape(-1)[lo:hi])
            assert torch.equal(r["local_exp_avg"][name], r["exp_avg"][name].reshape(-1)[lo:hi])
            assert torch.equal(r["local_grad"][name], r["grad"][name].reshape(-1)[lo:hi])
    for name, full in ranks[0]["after"].items():
        held = sum(r["pieces"].get(name, (0, 0))[1] - r["pieces"].get(name, (0, 0))[0] for r in ranks)
        assert held == full.numel() * (WORLD if stage == 0 else 1), name


@pytest.mark.parametrize("stage,offload", CASES, ids=[f"z{s}" + (f"-{o}" if o else "") for s, o in CASES])
def test_setting_values(pool, stage, offload):
    ref = reference_pieces(WORLD, branch_on_all_ranks=stage == 3)
    ranks = pool.run(access_task, WORLD, stage, offload)
    name = ranks[0]["set_name"]
    want_loss = probe_loss(ref["all_after"], {name: ranks[0]["set_value"]})
    unchanged_loss = probe_loss(ref["all_after"], {})
    for r in ranks:
        assert torch.equal(r["after_set"], r["set_value"])
        assert abs(r["probe_loss"] - want_loss) < 1e-5 and abs(want_loss - unchanged_loss) > 1e-3
        assert torch.equal(r["state_after_set"], torch.full_like(r["set_value"], 0.5))
    for rank, r in enumerate(ranks):
        # each rank set its own part to rank + 1: the full value shows who holds what (at stage 0
        # every rank holds it all)
        owner = torch.zeros(r["set_value"].numel())
        for k, other in enumerate(ranks):
            a, b = other["pieces"].get(name, (0, 0))
            owner[a:b] = k + 1
        expect = owner.view(r["set_value"].shape) if stage > 0 else torch.full_like(r["set_value"], rank + 1.0)
        assert torch.equal(r["local_state_set"], expect) and torch.equal(r["local_param_set"], expect)
        # the model's parameter: this rank's part at once; at stages 1-2 the others' parts of this
        # rank's full copy arrive with the all-gather after the next step
        lo, hi = r["pieces"][name]
        model = r["model_param_after_local_set"].reshape(-1)
        assert torch.equal(model[lo:hi], expect.reshape(-1)[lo:hi])
        if stage in (0, 3):
            assert torch.equal(model, expect.reshape(-1))
        assert "not elementwise" in r["scalar_state"]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_set_fp32_param_sets_the_16bit_parameter(pool, stage):
    for r in pool.run(bf16_set_task, WORLD, stage):
        assert r["grad_dtype"] == torch.float32
        assert torch.equal(r["master"], r["new"]) and torch.equal(r["fp32"], r["new"])
        assert r["param16"].dtype == torch.bfloat16 and torch.equal(r["param16"], r["new"].to(torch.bfloat16))


def test_deepspeed_names():
    import zerodp.utils as utils
    import zerodp.utils.tensor_fragment as fragment  # deepspeed.utils.tensor_fragment under the switch
    for name in ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
                 "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_set_full_grad",
                 "safe_update_full_grad_vectorized", "safe_get_local_fp32_param", "safe_get_local_grad",
                 "safe_get_local_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_optimizer_state"):
        assert callable(getattr(utils, name)) and name in utils.__all__
        assert getattr(fragment, name) is getattr(utils, name)
    assert utils.safe_get_full_grad(torch.nn.Parameter(torch.ones(2))) is None

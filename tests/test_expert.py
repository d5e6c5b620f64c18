"""Expert parallelism (``parallel/expert.py``): experts split over expert-parallel groups of 2 and 4
ranks, ZeRO stages 0-3, the same losses, gradient norms and parameters as one process holding every
expert; the last expert is never routed to and others sit idle on some ranks."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_trains_as_one_process(pool, stage, ep):
    from expert_tasks import EXPERTS, train_expert_parallel
    results = pool.run(train_expert_parallel, 4, stage, ep)
    for r in results:
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["ref_losses"])
        for got, want in zip(r["norms"], r["ref_norms"]):  # over dense and expert gradients alike
            assert abs(got - want) <= 1e-5 * abs(want), (r["norms"], r["ref_norms"])
        for name, want in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)
        assert len(r["local"]) == EXPERTS // ep  # each rank holds its share of the experts, whole
        assert sum(n.startswith("moe.experts.") for n in r["params"]) == 4 * EXPERTS // ep
    assert sorted(e for r in results[:ep] for e in r["local"]) == list(range(EXPERTS))
    # the token exchanges count with the engine's bytes, on their own group; with 2 groups of
    # experts, their parameters reduce over the expert-data ranks
    assert "expert" in results[0]["groups"] and ("expert_data" in results[0]["groups"]) == (ep < 4), \
        results[0]["groups"]
    # the 16-bit model saves gather every expert from its rank (rank 0 holds the result)
    whole, want = results[0]["whole"], results[0]["ref_whole"]
    assert set(whole) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(whole[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert all(r["whole"] == {} for r in results[1:])


@pytest.mark.parametrize("stage,params", [(2, False), (3, False), (3, True)])
def test_expert_parallel_with_offload_and_accumulation_trains_as_one_process(pool, stage, params):
    """ep 2 on 4 ranks, optimizer states (and at stage 3 also parameter shards) in host memory, 2
    micro-batches per step."""
    from expert_tasks import train_expert_parallel
    for r in pool.run(train_expert_parallel, 4, stage, 2, gas=2, offload=True, offload_params=params):
        assert len(r["losses"]) == 6 and len(r["norms"]) == 3
        for got, want in zip(r["losses"] + r["norms"], r["ref_losses"] + r["ref_norms"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["ref_losses"], r["norms"], r["ref_norms"])
        for name, want in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (3, "bf16"), (2, "fp16")])
def test_expert_parallel_in_16_bits_follows_the_same_model_without_it(pool, stage, precision):
    """bf16 or fp16 (16-bit parameters, fp32 masters; fp16 with its loss scale): ep 2 against the same
    engine with every expert on every rank; the losses agree to 16-bit precision (the reductions add
    in another order)."""
    from expert_tasks import train_expert_parallel
    flag = {precision: True}
    split = pool.run(train_expert_parallel, 4, stage, 2, **flag)
    whole = pool.run(train_expert_parallel, 4, stage, 1, **flag)
    for a, b in zip(split, whole):
        for got, want in zip(a["losses"], b["losses"]):
            assert abs(got - want) <= 5e-3 * abs(want), (a["losses"], b["losses"])
        for got, want in zip(a["norms"], b["norms"]):
            assert abs(got - want) <= 5e-3 * abs(want), (a["norms"], b["norms"])


def test_expert_parallel_refusals(pool):
    from expert_tasks import refusals
    r = pool.run(refusals, 4)[0]
    assert "expert-parallel size 3 does not divide the 4 experts" in r["experts"]
    assert "does not divide the world size 4" in r["world"]
    assert "top_k 5 is not between 1 and the 4 experts" in r["top_k"]
    assert "expert parallelism with hybrid sharding (MiCS) is not supported" in r["with_hybrid"]


@pytest.mark.parametrize("stage,ep,road,kind", [
    (1, 2, "api", "qwen3"), (3, 4, "api", "qwen3"), (2, 2, "config", "qwen3"), (3, 2, "config", "qwen3"),
    (1, 4, "config", "qwen3"), (3, 2, "init", "qwen3"),
    (1, 2, "api", "mixtral"), (2, 4, "config", "mixtral"), (3, 2, "config", "mixtral")])
def test_transformers_fused_experts_split_train_as_one_process(pool, stage, ep, road, kind):
    """transformers' Qwen3-MoE and Mixtral (fused 3-D experts, their own top-2 routers) split by ``expert_parallelize``
    or by the config's ``expert_parallel`` block (DeepSpeed's AutoEP keys; "init": the model built in
    ``zero.Init``, its experts' slices gathered to be split): each rank holds E/ep slices under the
    same names; losses, gradient norms and parameters equal one process holding every expert."""
    pytest.importorskip("transformers")
    from expert_tasks import train_hf_expert_parallel
    results = pool.run(train_hf_expert_parallel, 4, stage, ep, road, kind=kind)
    # the ranks' tokens leave experts idle (an expert no token of a rank chose, in some layer and step)
    assert any(len(c) < 4 for r in results for c in r["chosen"]), [r["chosen"] for r in results]
    for r in results:
        for got, want in zip(r["losses"] + r["norms"], r["ref_losses"] + r["ref_norms"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["ref_losses"], r["norms"], r["ref_norms"])
        for name, want in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)
        assert len(r["experts"]) == 4 // ep


def test_autoep_config_refusals(pool):
    pytest.importorskip("transformers")
    from expert_tasks import autoep_refusals
    r = pool.run(autoep_refusals, 4)[0]
    assert "preset_model: 'mixtral' is for mixtral models; this model is qwen3_moe" in r["preset"]
    assert "top_k: 3, but the model's router picks 2 experts" in r["top_k"]
    assert "expert-parallel size 3 does not divide the world size 4" in r["world"]
    assert "expert-parallel size 4 does not divide the 6 experts" in r["experts"]

"""Mixture-of-experts models: ranks route tokens to different experts, so at stage 3 a rank skips
experts its peers run. A leaf module (the MoE block gathered and reduced whole) makes every rank
issue the same collectives; declared any of DeepSpeed's ways, training equals one process on the
global batch (to 1e-6), at stage 2 without any declaration. Undeclared, stage 3 stops with an
error naming the experts, the block's class and the remedy, instead of hanging."""
from __future__ import annotations

import moe_tasks as mt
import pytest

WORLD = 2
ATOL = 1e-6


def _same_as_one_process(results: list[dict], top_k: int) -> None:
    want = mt.reference(top_k, WORLD)
    for rank, r in enumerate(results):
        assert "error" not in r, r["error"]
        assert set(r["params"]) == set(want)
        for name, value in want.items():
            err = (r["params"][name] - value).abs().max().item()
            assert err <= ATOL, f"rank {rank} {name}: {err:.3g}"
    calls = [set(map(tuple, (u for block in r["used"] for u in block))) for r in results]
    assert all(len(u) < mt.E for r in results for block in r["used"] for u in block)  # idle experts everywhere
    assert calls[0] != calls[1]  # and the ranks ran different experts


@pytest.mark.parametrize("top_k", [1, 2])
def test_stage2_trains_moe_exactly(pool, top_k):
    _same_as_one_process(pool.run(mt.train, WORLD, 2, top_k, "none"), top_k)


DECLARATIONS = ["api", "by_name", "by_suffix", "classes", "qualified", "names", "suffixes", "granularity"]


@pytest.mark.parametrize("declare", DECLARATIONS)
def test_stage3_moe_leaf_declared_any_way_trains_exactly(pool, declare):
    top_k = 2 if declare in ("api", "classes") else 1
    results = pool.run(mt.train, WORLD, 3, top_k, declare)
    _same_as_one_process(results, top_k)
    for r in results:
        assert r["leaves"] == ["blocks.0.moe", "blocks.1.moe"], r["leaves"]
        experts = [n for n in r["params"] if ".moe." in n]
        assert r["leaf_params"] == sorted(experts)  # z3_leaf_parameter: the leaves' parameters


def test_stage3_moe_without_a_leaf_names_the_block_and_the_remedy(pool):
    for r in pool.run(mt.train, WORLD, 3, 1, "none"):
        err = r.get("error", "no error")
        assert "stage 3 needs every rank to run the same modules" in err, err
        assert ".moe.experts." in err and "a Linear" in err, err
        assert "If blocks.0.moe (a MoEBlock) chooses which of its modules run" in err, err
        assert "zerodp.utils.set_z3_leaf_modules(model, [MoEBlock])" in err, err
        assert '"leaf_module": {"classes": ["MoEBlock"]}' in err, err

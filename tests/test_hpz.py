"""ZeRO++ hpZ (``zero_hpz_partition_size: k``) as DeepSpeed defines it: states, masters, gradients and
the parameters' own shards sharded over all N data-parallel ranks as at plain stage 3, plus a secondary
copy of the parameters sharded over groups of k consecutive ranks, made by a step's first gather and
read by backward's and later micro-batches' gathers within the group (``core/secondary.py``). World 4,
k = 2, the parity model (an embedding tied to the output layer, a frozen layer, a branch)."""
from __future__ import annotations

import hpz_tasks as ht
import parity_model as pm
import pytest

WORLD, K = 4, 2


def _close(got: dict, want: dict, tol: float = 2e-6) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        err = (got[name] - value).abs().max().item()
        assert err <= tol, f"{name}: {err:.3g}"


OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}


@pytest.mark.parametrize("gas,zero", [(1, {}), (2, {}), (2, OFFLOAD)])
def test_hpz_trains_like_one_process(pool, gas, zero):
    want, _ = pm.reference(WORLD, 3, gas, branch_on_all_ranks=True)
    for r in pool.run(ht.train, WORLD, K, 3, gas, "AdamW", zero):
        assert r["grid"] == "data 4 (hpZ groups of 2)"
        _close(r["params"], want)


_RUNS: dict = {}


@pytest.fixture
def runs(pool) -> dict:
    """Plain stage 3 and hpZ, 3 steps of 1 and of 2 micro-batches (rank 0's view), run once."""
    if not _RUNS:
        _RUNS.update({(hpz, gas): pool.run(ht.train, WORLD, hpz, 3, gas)[0] for hpz in (1, K) for gas in (1, 2)})
    return _RUNS


@pytest.mark.parametrize("gas", [1, 2])
def test_hpz_holds_plain_stage3_states_plus_the_secondary_copy(runs, gas):
    """Parameters, gradients and optimizer states per rank are plain stage 3's (sharded over all 4
    ranks); the secondary copy is its own category: 1/k of the full parameters once every unit was
    gathered (here less: the branch did not run in the first step), and after the update only the
    frozen layer's copy is left (a trained group's is dropped: its parameters changed)."""
    plain, hpz = runs[(1, gas)], runs[(K, gas)]
    for key in ("parameters", "gradients", "master_weights", "optimizer_states"):
        assert hpz["after_step"][key] == plain["after_step"][key] > 0 or key == "master_weights", key
    assert plain["before_step"]["secondary_parameters"] == 0 == plain["after_step"]["secondary_parameters"]
    copy = hpz["before_step"]["secondary_parameters"]
    assert hpz["full_bytes"] / K * 0.6 < copy <= hpz["full_bytes"] / K
    assert hpz["before_step"]["model_states"] == plain["before_step"]["model_states"] + copy
    assert hpz["after_step"]["secondary_parameters"] == hpz["frozen_copy"] > 0


@pytest.mark.parametrize("gas", [1, 2])
def test_secondary_gathers_come_after_the_first_forward(runs, gas):
    """In a step, the all-gathers over the whole data-parallel group happen in the first forward only;
    backward's and later micro-batches' gathers run within the hpZ group. In the very first step the
    first forward gathers nothing within it; in later ones only the frozen layer, whose copy stays.
    (With the default reuse distance a unit used again soon stays gathered from forward to backward,
    so a later phase may gather nothing.)"""
    for step, phases in enumerate(runs[(K, gas)]["phases"]):
        data = [p[2].get("data", 0) for p in phases]
        secondary = [p[2].get("secondary", 0) for p in phases]
        assert data[0] > 0 and all(d == data[0] for d in data), (step, data)
        assert secondary[0] == (0 if step == 0 else runs[(K, gas)]["frozen_gather"]), (step, secondary)
        assert secondary[-1] > secondary[0], (step, secondary)  # (a unit kept from forward is not gathered again)


@pytest.mark.parametrize("gas", [1, 2])
def test_hpz_sends_less_over_the_whole_group(runs, gas):
    """Bytes over the whole data-parallel group per step, every kind: fewer than plain stage 3's, since
    backward's re-gathers (and later micro-batches' gathers) stay inside the hpZ groups."""
    for step in (1, 2):
        plain = runs[(1, gas)]["by_group"][step]
        hpz = runs[(K, gas)]["by_group"][step]
        assert set(plain) == {"data"} and set(hpz) == {"data", "secondary"}
        assert hpz["data"]["total"] < plain["data"]["total"], (hpz, plain)
        assert hpz["data"]["reduce_scatter"] == plain["data"]["reduce_scatter"]
        assert hpz["secondary"]["all_gather"] > 0 and hpz["secondary"]["reduce_scatter"] == 0


def test_checkpoints_load_with_and_without_hpz(pool, tmp_path):
    """Saved with hpZ, a checkpoint loads into plain stage 3 and the other way round: one more step from
    it gives the same parameters either way (the shards are plain stage 3's; the secondary copies of a
    loading engine are dropped, not used stale)."""
    for saved_with in (1, K):
        where = str(tmp_path / f"hpz{saved_with}")
        pool.run(ht.train, WORLD, saved_with, 2, 1, "AdamW", None, where)
        after = {hpz: pool.run(ht.train, WORLD, hpz, 1, 1, "AdamW", None, "", where)[0]["params"] for hpz in (1, K)}
        _close(after[K], after[1], 1e-7)


@pytest.mark.parametrize("stage,zero,says", [
    (2, {"zero_hpz_partition_size": 2}, "zero_hpz_partition_size at stage 3 only"),
    (3, {"zero_hpz_partition_size": 2, "mics_shard_size": 2}, "not both"),
    (3, {"zero_hpz_partition_size": 3}, "3 does not divide the 4 data-parallel ranks"),
])
def test_hpz_where_it_does_not_apply_is_refused(pool, stage, zero, says):
    for e in pool.run(ht.refused, WORLD, stage, zero):
        assert says in e, e

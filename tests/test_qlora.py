"""QLoRA at stage 3: a LoRA adapter on a 4-bit base (bitsandbytes nf4, packed weights stored as
fp32) trains through zerodp as in one process, and the packed base is sharded: each rank holds 1/N
of every parameter."""
from __future__ import annotations

import pytest

pytest.importorskip("bitsandbytes", reason="QLoRA tests need bitsandbytes (in the test extra)")
pytest.importorskip("peft", reason="QLoRA tests need peft (in the test extra)")

import qlora_tasks as qt  # noqa: E402


def test_qlora_at_stage3_trains_like_one_process(pool, tmp_path):
    path = str(tmp_path / "base")
    qt.save_base(path)
    world = 2
    out = pool.run(qt.train, world, path)
    want = qt.reference(path, world)
    for rank, r in enumerate(out):
        assert r["packed"] > 0  # the base really is 4-bit
        assert set(r["trained"]) == set(want)
        for name, value in want.items():
            err = (r["trained"][name] - value).abs().max().item()
            assert err <= 2e-6, f"rank {rank} {name}: {err:.3g}"
        # this rank holds its shard of every parameter, the packed 4-bit base included
        assert r["params_bytes"] <= r["all_bytes"] / world + 65536, (r["params_bytes"], r["all_bytes"])

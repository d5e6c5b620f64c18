"""Checkpoints of expert-parallel models: each rank writes its experts' shards under the names the
experts have in the model without expert parallelism (transformers' fused experts as slices of
their whole tensors, DeepSpeed's MoE layer's experts renumbered globally), so a checkpoint loads at
another expert-parallel size, ZeRO stage or world size, and without expert parallelism; training
resumed from it equals training that never stopped, and consolidating it gives whole experts under
the model's own names (so does the 16-bit model save)."""
from __future__ import annotations

import pytest
import torch

STEPS, SAVE_AT = 3, 2


def _same(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), (what, sorted(set(a) ^ set(b)))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


@pytest.mark.parametrize("kind,saved,loaded", [
    ("qwen3", (2, 2), (3, 4)),      # fused experts: slices of 2 -> slices of 4
    ("qwen3", (3, 2), (1, 1)),      # -> no expert parallelism
    ("deepspeed", (1, 4), (3, 2)),  # DeepSpeed's layer: 1 expert a rank -> 2
    ("toy", (0, 1), (2, 2)),        # without expert parallelism -> split
])
def test_expert_checkpoint_resumes_at_another_ep_and_stage(pool, tmp_path, kind, saved, loaded):
    if kind == "qwen3":
        pytest.importorskip("transformers")
    from expert_ckpt_tasks import train
    path = str(tmp_path / "ckpt")
    whole = pool.run(train, 4, kind, *saved, STEPS, save=path, save_at=SAVE_AT)
    resumed = pool.run(train, 4, kind, *loaded, STEPS, load=path, start=SAVE_AT)
    for a, b in zip(whole, resumed):
        for got, want in zip(b["losses"], a["losses"][SAVE_AT:]):
            assert abs(got - want) <= 1e-5 * abs(want), (a["losses"], b["losses"])
    _same(resumed[0]["params"], whole[0]["params"], "resumed")
    for run in (whole, resumed):  # save_16bit_model's state dict: every expert whole, on rank 0
        if run[0]["whole16"]:
            _same(run[0]["whole16"], run[0]["params"], "16-bit state dict")


def test_expert_checkpoint_loads_at_another_world_size_and_consolidates(pool, tmp_path):
    """Qwen3-MoE saved at 4 ranks with experts over 2 loads on 2 ranks without expert parallelism,
    and consolidates (``get_fp32_state_dict_from_zero_checkpoint``; ``consolidate``, the files
    ``zerodp consolidate`` writes) into the model's own state dict, which ``from_pretrained`` reads."""
    pytest.importorskip("transformers")
    from expert_ckpt_tasks import train
    from expert_tasks import _qwen3_moe

    from zerodp.checkpoint import consolidate, get_fp32_state_dict_from_zero_checkpoint
    path = str(tmp_path / "ckpt")
    saved = pool.run(train, 4, "qwen3", 3, 2, SAVE_AT, save=path, save_at=SAVE_AT)[0]["params"]
    loaded = pool.run(train, 2, "qwen3", 2, 1, SAVE_AT, load=path, start=SAVE_AT)[0]["params"]
    _same(loaded, saved, "loaded at world 2")
    state = get_fp32_state_dict_from_zero_checkpoint(path, tag="t")
    _same(dict(state), saved, "consolidated")
    model = _qwen3_moe()
    model.load_state_dict(state, strict=True)  # whole experts under the model's own names
    out = tmp_path / "hf"
    consolidate(path, out, tag="t")
    model.config.save_pretrained(out)
    again = type(model).from_pretrained(out)
    _same({n: p.detach() for n, p in again.named_parameters()}, {n: saved[n] for n, _ in again.named_parameters()},
          "from_pretrained")

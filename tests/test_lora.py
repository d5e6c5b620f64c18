"""LoRA fine-tuning with ``peft`` at stages 2 and 3: parity with single-process PEFT, frozen base
weights without gradients or optimizer state (sharded at stage 3), and the adapter saved in
PEFT's own format."""
from __future__ import annotations

import lora_tasks as lt
import pytest
import torch

pytest.importorskip("peft", reason="LoRA tests need peft (in the test extra)")


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_trains_like_peft_alone(pool, tmp_path, stage):
    world = 2
    out = pool.run(lt.lora_train, world, stage, str(tmp_path / "adapter"))
    ref = lt.reference(world)
    r = out[0]
    for name, want in ref.items():
        err = (r["params"][name] - want).abs().max().item()
        assert err <= 2e-6, f"{name}: max |diff| {err:.3g}"
    moved = max((ref[n] - lt.build_lora().state_dict()[n]).abs().max().item()
                for n in ref if "lora_" in n)
    assert moved > 1e-3  # the adapters trained
    # frozen base weights: no gradients; optimizer state for the adapters only
    n_t, n_all = r["n_trainable"], r["n_all"]
    assert r["frozen_grads"] == []
    mem = r["memory"]
    assert n_t < n_all / 10
    assert mem["optimizer_states"] <= 8 * n_t / world + 4096  # Adam m, v for this rank's adapter shard
    assert mem["gradients"] <= 4 * n_t / world + 2048
    if stage == 3:  # the frozen base is sharded too
        assert mem["parameters"] <= 4 * n_all / world + 8192
    else:
        assert mem["parameters"] >= 4 * n_all
    compared = r["compared"]
    assert any(c == "optimizer_states" and est is not None for c, est, _, _ in compared)
    for category, estimated, measured, ok in compared:  # the estimator agrees with the ledger
        assert ok, (category, estimated, measured)


def test_lora_bf16_stage3_memory(pool):
    """bf16 at stage 3: the frozen base is held as 16-bit shards (2 bytes x params / N), and fp32
    masters, gradients and Adam states exist for this rank's share of the adapters only; the
    estimator agrees with the ledger."""
    world = 2
    r = pool.run(lt.lora_train, world, 3, None, "bf16")[0]
    n_t, n_all, mem = r["n_trainable"], r["n_all"], r["memory"]
    assert r["frozen_grads"] == []
    assert mem["parameters"] <= 2 * n_all / world + 8192
    assert mem["master_weights"] <= 4 * n_t / world + 2048
    assert mem["optimizer_states"] <= 8 * n_t / world + 4096
    assert mem["gradients"] <= 4 * n_t / world + 2048
    for category, estimated, measured, ok in r["compared"]:
        assert ok, (category, estimated, measured)


def test_adapter_saved_in_peft_format(pool, tmp_path):
    import hf_tasks
    from peft import PeftModel
    trained = pool.run(lt.lora_train, 2, 3, str(tmp_path / "adapter"))[0]["params"]
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    loaded = PeftModel.from_pretrained(hf_tasks.build_model("gpt2"), str(tmp_path / "adapter"))
    got = dict(loaded.named_parameters())
    lora = [n for n in trained if "lora_" in n]
    assert lora
    for name in lora:
        assert torch.equal(got[name].detach(), trained[name]), name


@pytest.mark.parametrize("init", [True, "gaussian"])
def test_adapters_on_a_meta_built_model_start_as_peft_starts_them(pool, init):
    """A model built wholly on the meta device gets its values from ``initialize``; its LoRA
    adapters must get PEFT's (``lora_B`` zero), not ``nn.Linear``'s, or training starts from a
    model the adapters perturb: the first loss equals the loss with the adapters off."""
    out = pool.run(lt.meta_lora_task, 2, init)
    a, b = ([v for n, v in out[0]["adapters"].items() if f"{part}." in n] for part in ("lora_A", "lora_B"))
    assert a and b
    assert all(torch.count_nonzero(v) == 0 for v in b)
    assert all(v.abs().max() > 0 for v in a)
    if init == "gaussian":  # PEFT: normal with std 1/r (r = 4)
        assert 0.15 < torch.cat([v.flatten() for v in a]).std() < 0.35
    else:  # nn.Linear's kaiming bound, 1/sqrt(fan_in) with fan_in 32
        assert all(v.abs().max() <= 32 ** -0.5 for v in a)
    for r in out:
        assert r["on"] == r["off"]
        assert all(torch.equal(r["adapters"][n], out[0]["adapters"][n]) for n in out[0]["adapters"])


def test_an_initialization_that_reads_the_base_weights_is_refused_on_a_meta_model():
    import hf_tasks
    from peft import LoraConfig, get_peft_model

    from zerodp.core.adapters import lora_initializer
    model = get_peft_model(hf_tasks.build_model("gpt2"), LoraConfig(r=4, target_modules=["c_attn"],
                                                                     fan_in_fan_out=True))
    model.peft_config["default"].init_lora_weights = "olora"
    with pytest.raises(ValueError, match="init_lora_weights='olora'.*meta device"):
        lora_initializer(model)(model, {id(p) for p in model.parameters()})
    assert lora_initializer(hf_tasks.build_model("gpt2")) is None


@pytest.mark.parametrize("stage,safe_merge", [(2, False), (3, False), (3, True)])
def test_merge_and_unmerge_inside_a_gather(pool, stage, safe_merge):
    """PEFT's ``merge_adapter``/``unmerge_adapter`` inside ``GatheredParameters``, with a forward of the
    merged model between them (TRL's generation with adapters): the merged logits and weights are
    one process's, the unmerge restores the base (the merged forward's unit hooks must not release
    what the context holds), and training goes on as in one process. ``safe_merge`` assigns the
    merged weight (``weight.data = merged``) instead of adding in place."""
    world = 2
    out = pool.run(lt.merge_in_engine, world, stage, safe_merge)
    ref = lt.merge_reference(world, safe_merge)
    for rank, r in enumerate(out):
        assert (r["logits"] - ref["logits"]).abs().max().item() <= 1e-5, rank
        for name, want in ref["merged"].items():
            assert (r["merged"][name] - want).abs().max().item() <= 1e-6, (rank, name)
        for name, want in ref["params"].items():
            err = (r["params"][name] - want).abs().max().item()
            assert err <= 2e-6, f"rank {rank} {name}: {err:.3g}"

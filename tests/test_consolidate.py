"""Full weights out of checkpoints (``zerodp consolidate``, DeepSpeed's zero_to_fp32 names),
``save_16bit_model``, and asynchronous saves."""
from __future__ import annotations

import json

import checkpoint_tasks as ct
import pytest
import torch
from safetensors.torch import load_file

import zerodp
from zerodp.checkpoint import consolidate, get_fp32_state_dict_from_zero_checkpoint
from zerodp.tools import cli
from zerodp.utils import load_state_dict_from_zero_checkpoint
from zerodp.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict


@pytest.fixture
def bf16_ckpt(pool, tmp_path):
    """A bf16 checkpoint saved by 3 ranks at stage 3, and the run's fp32 masters."""
    saved = pool.run(ct.save_task, 3, 3, "bf16", 2, str(tmp_path / "ckpt"))[0]
    return tmp_path / "ckpt", saved


def test_consolidated_weights_load_strictly_into_the_model(bf16_ckpt, tmp_path):
    ckpt, saved = bf16_ckpt
    files = consolidate(ckpt, tmp_path / "out")
    assert [f.name for f in files] == ["model.safetensors"]
    state = load_file(str(tmp_path / "out" / "model.safetensors"))
    model = ct.build_model(seed=5)
    model.load_state_dict(state, strict=True)  # both names of the tied weight are there
    for name, p in model.named_parameters():
        if name in saved["masters"]:
            assert p.dtype == torch.float32 and torch.equal(p.detach(), saved["masters"][name]), name
        else:  # frozen: stored in the compute dtype
            assert torch.equal(p.detach(), saved["params"][name].float()), name
    assert torch.equal(state["head.weight"], state["emb.weight"])


def test_cli_casts_and_shards_like_transformers(bf16_ckpt, tmp_path, capsys):
    ckpt, saved = bf16_ckpt
    out = tmp_path / "sharded"
    assert cli.main(["consolidate", str(ckpt), str(out), "--dtype", "bf16", "--max-shard-size", "300B"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    state = {}
    for f in files:
        part = load_file(str(out / f))
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 300
        state.update(part)
    assert set(state) == set(index["weight_map"]) == set(ct.build_model().state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    for name, value in saved["params"].items():  # bf16: the run's own 16-bit parameters
        assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], value), name
    assert "sharded" in capsys.readouterr().out


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["consolidate", str(tmp_path / "nothing"), str(tmp_path / "out"), "--tag", "x"]) == 1
    assert "no checkpoint tag 'x'" in capsys.readouterr().err
    assert cli.main(["consolidate", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", "lots"]) == 2


def test_deepspeed_names(bf16_ckpt, tmp_path):
    ckpt, saved = bf16_ckpt
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert state["head.weight"] is state["emb.weight"]
    model = load_state_dict_from_zero_checkpoint(ct.build_model(seed=9), ckpt, tag="global_step2")
    for name, value in saved["masters"].items():
        assert torch.equal(state[name], value) and torch.equal(dict(model.named_parameters())[name].detach(), value)
    convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "fp32")
    written = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    assert torch.equal(written["l1.weight"], saved["masters"]["l1.weight"])


def test_transformers_from_pretrained_loads_the_output(pool, tmp_path):
    """A Hugging Face GPT-2 trained at stage 3 on 2 ranks, its config.json saved beside the
    checkpoints: the consolidated directory loads with from_pretrained and holds the trained
    weights."""
    from transformers import AutoModelForCausalLM
    trained = pool.run(ct.hf_save_task, 2, 3, str(tmp_path / "ckpt"))[0]
    out = tmp_path / "hf"
    written = consolidate(tmp_path / "ckpt", out)
    assert out / "config.json" in written  # saved beside the checkpoints, copied along
    model = AutoModelForCausalLM.from_pretrained(out)
    got = dict(model.named_parameters())
    for name, value in trained.items():
        assert torch.equal(got[name].detach(), value), name


@pytest.mark.parametrize("stage,dtype", [(3, "bf16"), (1, "fp32")])
def test_save_16bit_model(pool, tmp_path, stage, dtype):
    params = pool.run(ct.save_16bit_task, 2, stage, dtype, str(tmp_path))[0]
    st = load_file(str(tmp_path / "model.safetensors"))
    pt = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert set(st) == set(pt) == set(ct.build_model().state_dict())
    for name, value in params.items():
        assert st[name].dtype == ct.DTYPES[dtype] and torch.equal(st[name], value), name
        assert torch.equal(pt[name], value), name


def test_async_save_writes_the_state_of_the_moment_it_was_called(pool, tmp_path):
    out = pool.run(ct.async_save_task, 2, 2, str(tmp_path))
    assert out[0]["error"] is None
    moved = max((out[0]["after"][n] - out[0]["at_save"][n]).abs().max().item() for n in out[0]["at_save"])
    assert moved > 1e-3  # training went on while the checkpoint was written
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert (tmp_path / "latest").read_text() == "global_step2"
    for name, value in out[0]["at_save"].items():
        assert torch.equal(state[name], value), name


def test_async_save_failure_reaches_every_rank(pool, tmp_path):
    out = pool.run(ct.async_save_task, 2, 3, str(tmp_path), 1)
    for r in out:
        assert "asynchronous save" in r["error"] and "rank 1" in r["error"] and "No space left" in r["error"]
    assert (tmp_path / "latest").read_text() == "first"
    assert not any(tmp_path.glob(".*.partial"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "latest"]


def test_async_save_is_on_in_the_config():
    cfg = zerodp.load_config({"checkpoint": {"async_save": True}})
    assert cfg.checkpoint.async_save
    with pytest.raises(zerodp.ConfigError, match="use_node_local_storage"):
        zerodp.load_config({"checkpoint": {"use_node_local_storage": True}})

"""Streamed inference (``zerodp.inference``, ``zerodp generate``): the outputs of the model held
whole, with at most two streamed modules' weights on the device at once."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

import zerodp
from zerodp.examples.gpt import build_gpt
from zerodp.inference import stream
from zerodp.tools import cli


def save_weights(model: torch.nn.Module, path: str) -> None:
    """The model's state dict as safetensors, a tied weight once (as transformers writes it)."""
    seen, out = set(), {}
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out[name] = p.detach().contiguous()
    for name, b in model.named_buffers():
        out[name] = b.contiguous()
    save_file(out, path)


def module_bytes(m: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m._parameters.values() if p is not None)


def test_streamed_gpt_matches_the_whole_model_with_two_modules_resident(tmp_path):
    """A 16-block GPT streamed from a safetensors file gives the whole model's logits exactly, in
    the first forward (which records the order) and the next ones (which read ahead); at most two
    streamed modules' weights are on the device at once, a small part of the model."""
    torch.manual_seed(0)
    ref = build_gpt("small", n_layer=16).eval()
    save_weights(ref, str(tmp_path / "model.safetensors"))
    with zerodp.zero.Init(meta=True):
        meta = build_gpt("small", n_layer=16).eval()
    model = stream(meta, tmp_path, threshold=10_000)
    x = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        want, _ = ref(x)
    for _ in range(3):
        got, _ = model(x)
        assert torch.equal(got, want)
    largest = max(module_bytes(ref_mod) for ref_mod in model.streamed)
    total = sum(module_bytes(m) for m in model.streamed)
    assert 0 < model.peak_streamed_bytes <= 2 * largest
    assert total >= 20 * model.peak_streamed_bytes  # the model is many times what is held
    assert all(p.is_meta for m in model.streamed for p in m._parameters.values() if p is not None)


@pytest.mark.parametrize("meta", [True, False])
def test_streamed_transformers_causal_lm_generates_like_the_whole_model(tmp_path, meta):
    """A transformers GPT-2 (tied lm_head) built in zerodp.zero.Init(meta=True) and streamed from its
    save_pretrained directory generates the whole model's tokens (greedy); built in zero.Init keeping
    slices (meta=False), the slices are dropped for the files' weights."""
    import hf_tasks
    ref = hf_tasks.build_model("gpt2").eval()
    ref.save_pretrained(tmp_path)
    with zerodp.zero.Init(meta=meta):
        meta = hf_tasks.build_model("gpt2").eval()
    model = stream(meta, tmp_path, threshold=500)
    ids = torch.tensor([[1, 5, 9, 2]])
    want = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    assert model.peak_streamed_bytes <= 2 * max(module_bytes(m) for m in model.streamed)


def test_refuses_weights_held_in_memory(tmp_path):
    save_weights(build_gpt("tiny"), str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="meta device"):
        stream(build_gpt("tiny"), tmp_path)
    with zerodp.zero.Init(meta=True):
        other = build_gpt("tiny", n_embd=32)
    with pytest.raises(ValueError, match="shape"):
        stream(other, tmp_path, threshold=1)


def _generate_cli(capsys, weights, *extra) -> str:
    assert cli.main(["generate", str(weights), "--model", "tiny", "--prompt", "def f",
                     "--max-new-tokens", "12", "--seed", "3", "--threshold", "1000", *extra]) == 0
    out = capsys.readouterr()
    assert "streamed" in out.err
    return out.out


def test_generate_command_from_weights_and_from_a_checkpoint(tmp_path, capsys):
    """``zerodp generate`` prints what the whole model's generate samples with the same seed, from a
    safetensors file and from a checkpoint directory (consolidated on the fly)."""
    torch.manual_seed(0)
    ref = build_gpt("tiny").eval()
    save_weights(ref, str(tmp_path / "model.safetensors"))
    idx = torch.tensor([list(b"def f")])
    want = ref.generate(idx, 12, temperature=0.8, top_k=40, generator=torch.Generator().manual_seed(3))
    text = bytes(want[0].tolist()).decode("utf-8", errors="replace")
    assert _generate_cli(capsys, tmp_path / "model.safetensors").rstrip("\n") == text

    engine, *_ = zerodp.initialize(model=ref, config={"train_batch_size": 1, "zero_optimization": {"stage": 2},
                                                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.destroy()
    assert _generate_cli(capsys, tmp_path / "ckpt").rstrip("\n") == text
    assert os.path.isdir(tmp_path / "ckpt")

"""The Hugging Face road and streamed inference on CUDA: the Trainer at stage 3 (``TrainingArguments
(deepspeed=...)`` under ``ZERODP_AS_DEEPSPEED=1``, one rank on NCCL) equals the plain Trainer on the
same GPU, with offload, from ``from_pretrained`` under ``zero.Init``, with a LoRA adapter made after
loading, and through a checkpoint; a model streamed from its safetensors file computes the whole
model's logits on the GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Trainer cases need transformers")

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from test_hf_trainer import close, run_cases, same_run  # noqa: E402

CASES = ["plain", "z3", "z3-off", "z0-bf16", "z3-bf16-pre", "plain-pre-lora", "z3-pre-lora", "z3-ckpt"]


@pytest.fixture(scope="module")
def results(hf_python, device, tmp_path_factory, monkeypatch_module) -> dict:
    monkeypatch_module.setenv("ZERODP_HF_TASKS_DEVICE", device.type)
    return run_cases(hf_python, tmp_path_factory.mktemp("hf_cuda"), CASES, 1)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("case", ["z3", "z3-off"])
def test_trainer_at_stage3_equals_the_plain_trainer(results, case):
    same_run(results[case], results["plain"], rel=1e-5)


def test_from_pretrained_under_zero_init_in_bf16(results):
    """Built in ``zero.Init`` on the GPU (empty data on ``cuda:0``, ``ds_shape``), loaded through
    ``GatheredParameters``, trained in bf16: the stage-0 run's numbers."""
    assert results["z3-bf16-pre"]["built_in_init"]
    same_run(results["z3-bf16-pre"], results["z0-bf16"], rel=1e-5)


def test_lora_after_from_pretrained(results, device):
    """peft puts each adapter on its base layer's device: the real GPU, so the adapters keep their
    values (``lora_B`` zero) and the run equals the plain Trainer's from the first loss on."""
    got, want = results["z3-pre-lora"], results["plain-pre-lora"]
    where = "cuda:0" if device.type == "cuda" else "cpu"
    assert got["adapters"] == {"devices": [where], "lora_B_max": 0.0}, got["adapters"]
    assert close(got["loss"], want["loss"], 1e-5) and close(got["grad_norm"], want["grad_norm"], 1e-5)
    assert close([got["saved_eval"]], [got["eval_after"]], 1e-5)


def test_checkpoint_resume_save_and_generate(results):
    r = results["z3-ckpt"]
    assert close(r["loss"], results["plain"]["loss"], 1e-5)
    assert close(r["resumed_loss"], r["loss"], 1e-5)
    assert close([r["saved_eval"]], [r["eval_after"]], 1e-5)
    assert r["generated"] == r["saved_generated"] and len(r["generated"][0]) == 9


def test_streamed_inference_on_the_gpu(device, tmp_path):
    """A 16-block GPT streamed from safetensors (weights read ahead to the GPU) gives the logits of
    the whole model on the GPU; at most two streamed modules' weights are on the device at once."""
    import zerodp
    from zerodp.examples.gpt import build_gpt
    from zerodp.inference import stream
    sys.path.insert(0, str(TESTS))
    from test_inference import module_bytes, save_weights
    torch.manual_seed(0)
    ref = build_gpt("small", n_layer=16).eval()
    save_weights(ref, str(tmp_path / "model.safetensors"))
    ref = ref.to(device)
    with zerodp.zero.Init(meta=True):
        meta = build_gpt("small", n_layer=16).eval()
    model = stream(meta, tmp_path, threshold=10_000, device=device)
    x = torch.randint(0, 256, (2, 48), device=device)
    with torch.no_grad():
        want, _ = ref(x)
        for _ in range(3):
            got, _ = model(x)
            assert got.device == device
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    largest = max(module_bytes(m) for m in model.streamed)
    assert 0 < model.peak_streamed_bytes <= 2 * largest

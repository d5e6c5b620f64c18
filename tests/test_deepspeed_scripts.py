"""Scripts written for DeepSpeed run on zerodp with only their imports changed.

``tests/ds_scripts/`` holds three scripts in DeepSpeed's style (its getting-started loop, its
CIFAR tutorial, a Hugging Face causal-LM fine-tune with ``zero.Init``). Each test ports one by
the README's rule (``import deepspeed`` -> ``import zerodp as deepspeed``, ``from deepspeed.X
import Y`` -> ``from zerodp.X import Y``, nothing else), runs it under ``torchrun`` with 2 ranks
at ZeRO stages 0-3 in fp32 and bf16 (and fp16 where the script casts for it), and checks the
results against single-process PyTorch (fp32) and across stages.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
SCRIPTS = HERE / "ds_scripts"
STAGES = (0, 1, 2, 3)
WORLD = 2


def port(text: str) -> str:
    """The README's rule: only the deepspeed imports change."""
    text = re.sub(r"^(\s*)import deepspeed$", r"\1import zerodp as deepspeed", text, flags=re.M)
    return re.sub(r"^(\s*)from deepspeed((?:\.\w+)*) import ", r"\1from zerodp\2 import ", text, flags=re.M)


def ported(name: str, folder: Path) -> Path:
    original = (SCRIPTS / name).read_text()
    text = port(original)
    changed = [(a, b) for a, b in zip(original.splitlines(), text.splitlines()) if a != b]
    assert changed and all(a.lstrip().startswith(("import deepspeed", "from deepspeed")) for a, _ in changed)
    assert "zerodp" not in original
    path = folder / name
    path.write_text(text)
    return path


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ds_config(stage: int, precision: str, micro: int, gas: int, lr: float) -> dict:
    cfg = {"train_batch_size": micro * gas * WORLD, "train_micro_batch_size_per_gpu": micro,
           "gradient_accumulation_steps": gas, "steps_per_print": 1000,
           "gradient_clipping": 0.0,  # the single-process references do not clip
           "optimizer": {"type": "Adam", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                     "weight_decay": 0.0}},
           "zero_optimization": {"stage": stage}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    return cfg


def launch(script: Path, runs: list[list[str]], folder: Path, timeout: float = 900, world: int = WORLD,
           **env: str) -> None:
    """One torchrun launch of ``script`` on ``world`` ranks per argument list in ``runs`` (via
    ds_script_runner), with ``env`` added to the environment."""
    runs_path = folder / "runs.json"
    runs_path.write_text(json.dumps(runs))
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env, "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-port", str(_free_port()), str(HERE / "ds_script_runner.py"), str(script), str(runs_path)]
    proc = subprocess.run(cmd, cwd=folder, env=full_env, capture_output=True, text=True, timeout=timeout)
    done = [(folder / f"runs.json.rank{r}.done") for r in range(world)]
    finished = all(p.exists() and len(p.read_text().split()) == len(runs) for p in done)
    if not finished:  # a run failed (a teardown abort after every run finished is tolerated)
        raise AssertionError(f"{script.name} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")


def run_matrix(script: Path, folder: Path, precisions, micro: int, gas: int, lr: float, args) -> dict:
    """Run ``script`` at every (precision, stage) with a DeepSpeed config of its own;
    ``args(key, config_path)`` gives the command line. Returns each run's ``--out`` JSON."""
    runs, keys = [], []
    for precision in precisions:
        for stage in STAGES:
            key = f"{precision}-z{stage}"
            cfg = folder / f"{key}.json"
            cfg.write_text(json.dumps(ds_config(stage, precision, micro, gas, lr)))
            runs.append([*args(key, str(cfg)), "--out", str(folder / f"{key}.out.json")])
            keys.append(key)
    launch(script, runs, folder)
    return {k: json.loads((folder / f"{k}.out.json").read_text()) for k in keys}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def close(a: list[float], b: list[float], rtol: float, atol: float = 0.0) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rtol, abs_tol=atol) for x, y in zip(a, b))


# -- the getting-started loop ------------------------------------------------------------------

GS_PRECISIONS = ("fp32", "bf16", "fp16")
GS_STEPS, GS_MICRO, GS_GAS, GS_LR = 6, 4, 2, 1e-3


@pytest.fixture(scope="module")
def getting_started(tmp_path_factory):
    folder = tmp_path_factory.mktemp("getting_started")
    script = ported("getting_started.py", folder)
    out = run_matrix(script, folder, GS_PRECISIONS, GS_MICRO, GS_GAS, GS_LR, lambda key, cfg: [
        "--deepspeed", "--deepspeed_config", cfg, "--steps", str(GS_STEPS), "--save_dir", str(folder / f"ckpt-{key}")])
    return script, out


def _getting_started_reference(script: Path) -> list[float]:
    """Single-process PyTorch on the same global batches: rank 0's loss at every step."""
    mod = load_module(script, "gs_reference")
    torch.manual_seed(42)
    net = mod.Net()
    opt = torch.optim.Adam(net.parameters(), lr=GS_LR, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    for step in range(GS_STEPS):
        opt.zero_grad()
        total, rank0 = 0.0, []
        for rank in range(WORLD):
            for micro in range(GS_GAS):
                x, y = mod.batch(step, micro, rank, GS_MICRO)
                loss = torch.nn.functional.mse_loss(net(x), y)
                total = total + loss / (WORLD * GS_GAS)
                if rank == 0:
                    rank0.append(loss.item())
        total.backward()
        opt.step()
        losses.append(sum(rank0) / len(rank0))
    return losses


def test_getting_started_matches_pytorch(getting_started):
    script, out = getting_started
    ref = _getting_started_reference(script)
    for stage in STAGES:
        got = out[f"fp32-z{stage}"]
        assert got["stage"] == stage and got["world_size"] == WORLD and got["global_steps"] == GS_STEPS
        assert close(got["losses"], ref, rtol=1e-5), (stage, got["losses"], ref)
        for precision in ("bf16", "fp16"):
            low = out[f"{precision}-z{stage}"]["losses"]
            assert close(low, ref, rtol=0.05, atol=0.01), (precision, stage, low, ref)


def test_getting_started_checkpoint_resumes_exactly(getting_started):
    """save_checkpoint(client_state=...) then load_checkpoint: the client state comes back and
    training from it repeats the same losses bit for bit, at every stage and precision."""
    _, out = getting_started
    for key, got in out.items():
        assert got["resumed"] == got["losses"], key


# -- the CIFAR tutorial ------------------------------------------------------------------------

CNN_PRECISIONS = ("fp32", "bf16", "fp16")


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cifar")
    script = ported("cifar_cnn.py", folder)
    return run_matrix(script, folder, CNN_PRECISIONS, 16, 1, 1e-2,
                      lambda key, cfg: ["--deepspeed_config", cfg, "--epochs", "3"])


def test_cifar_trains_alike_at_every_stage(cifar):
    base = cifar["fp32-z0"]
    assert len(base["losses"]) == 3 * 256 // (16 * WORLD)
    assert base["device"] == "cpu" and base["accuracy"] > 0.3  # 10 classes: chance is 0.1
    for stage in STAGES:
        got = cifar[f"fp32-z{stage}"]
        assert close(got["losses"], base["losses"], rtol=1e-5), stage
        assert (got["fp16"], got["bf16"]) == (False, False)
        for precision in ("bf16", "fp16"):
            low = cifar[f"{precision}-z{stage}"]
            assert (low["fp16"], low["bf16"]) == (precision == "fp16", precision == "bf16")
            assert close(low["losses"], base["losses"], rtol=0.1, atol=0.05), (precision, stage)
            assert low["accuracy"] > 0.3


# -- the Hugging Face fine-tune ----------------------------------------------------------------

HF_STEPS, HF_SEQ, HF_MICRO = 5, 16, 2


@pytest.fixture(scope="module")
def hf_finetune(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    pretrained = folder / "pretrained"
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(pretrained)
    script = ported("hf_causal_lm.py", folder)
    out = run_matrix(script, folder, ("fp32", "bf16"), HF_MICRO, 1, 1e-3, lambda key, cfg: [
        "--deepspeed", "--deepspeed_config", cfg, "--model_name_or_path", str(pretrained),
        "--output_dir", str(folder / f"model-{key}"), "--steps", str(HF_STEPS), "--seq_len", str(HF_SEQ)])
    return folder, script, out


def test_hf_finetune_starts_from_the_pretrained_weights(hf_finetune):
    """The first loss equals the pretrained model's on rank 0's batch at every stage: at stage 3
    the weights loaded inside zero.Init were kept, not re-initialized."""
    from transformers import AutoModelForCausalLM
    folder, script, out = hf_finetune
    mod = load_module(script, "hf_reference")
    model = AutoModelForCausalLM.from_pretrained(folder / "pretrained")
    ids = mod.get_batch(0, 0, HF_MICRO, HF_SEQ, model.config.vocab_size)
    with torch.no_grad():
        first = model(input_ids=ids, labels=ids).loss.item()
    for stage in STAGES:
        assert math.isclose(out[f"fp32-z{stage}"]["losses"][0], first, rel_tol=1e-5), stage
        assert math.isclose(out[f"bf16-z{stage}"]["losses"][0], first, rel_tol=0.02), stage


def test_hf_finetune_trains_alike_at_every_stage(hf_finetune):
    _, _, out = hf_finetune
    base = out["fp32-z0"]["losses"]
    assert base[-1] < base[0]
    for stage in STAGES:
        assert close(out[f"fp32-z{stage}"]["losses"], base, rtol=1e-5), stage
        assert close(out[f"bf16-z{stage}"]["losses"], base, rtol=0.03), stage


def test_hf_save_16bit_model_loads_with_from_pretrained(hf_finetune):
    """save_16bit_model wrote the full weights (gathered at stage 3) in the compute dtype beside
    the config; from_pretrained opens the folder, and the embedding is the one GatheredParameters
    showed at the end of training."""
    from transformers import AutoModelForCausalLM
    folder, _, out = hf_finetune
    for key, got in out.items():
        assert "pytorch_model.bin" in got["files"] and "config.json" in got["files"], key
        sd = torch.load(folder / f"model-{key}" / "pytorch_model.bin", weights_only=True)
        dtype = torch.bfloat16 if key.startswith("bf16") else torch.float32
        assert all(t.dtype == dtype for t in sd.values()), key
        model = AutoModelForCausalLM.from_pretrained(folder / f"model-{key}", torch_dtype=torch.float32)
        emb = model.get_input_embeddings().weight
        assert list(emb.shape) == got["embedding_shape"]
        assert math.isclose(emb.float().norm().item(), got["embedding_norm"], rel_tol=1e-6), key


# -- the pipeline tutorial ---------------------------------------------------------------------

PIPE_STEPS, PIPE_MICRO, PIPE_GAS, PIPE_LR = 6, 8, 4, 1e-3


def _pipe_config(stage: int) -> dict:
    """2 pipeline stages of one data-parallel rank each."""
    return {"train_batch_size": PIPE_MICRO * PIPE_GAS, "train_micro_batch_size_per_gpu": PIPE_MICRO,
            "steps_per_print": 1000, "optimizer": {"type": "Adam", "params": {"lr": PIPE_LR}},
            "zero_optimization": {"stage": stage}}


@pytest.fixture(scope="module")
def pipeline_tutorial(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline_tutorial")
    script = ported("pipeline_tutorial.py", folder)
    runs = []
    for stage in STAGES:
        cfg = folder / f"z{stage}.json"
        cfg.write_text(json.dumps(_pipe_config(stage)))
        runs.append(["--deepspeed_config", str(cfg), "-p", "2", "--steps", str(PIPE_STEPS),
                     "--out", str(folder / f"z{stage}.out.json")])
    launch(script, runs, folder)
    return script, {s: json.loads((folder / f"z{s}.out.json").read_text()) for s in STAGES}


def _pipeline_reference(script: Path) -> list[float]:
    """One process, plain PyTorch: the same network, the batches the engine's loader gives one
    data-parallel rank, the mean loss of each step's micro-batches, Adam."""
    from zerodp.core.data import DataLoader
    mod = load_module(script, "pipe_reference")
    torch.manual_seed(1138)
    net = mod.SmallAlexNet(num_classes=10)
    opt = torch.optim.Adam(net.parameters(), lr=PIPE_LR)
    batches = iter(DataLoader(mod.SyntheticCifar(), batch_size=PIPE_MICRO, num_replicas=1, rank=0))
    losses = []
    for _ in range(PIPE_STEPS):
        opt.zero_grad()
        parts = [torch.nn.functional.cross_entropy(net(x), y) for x, y in (next(batches) for _ in range(PIPE_GAS))]
        loss = sum(parts) / PIPE_GAS
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_pipeline_tutorial_ported_by_its_imports(pipeline_tutorial):
    """``PipelineModule`` of the joined layers (a lambda among them), ``training_data``,
    ``train_batch()``: on 2 pipeline stages at every ZeRO stage, the single-process losses."""
    script, out = pipeline_tutorial
    ref = _pipeline_reference(script)
    for stage in STAGES:
        got = out[stage]
        assert (got["stages"], got["first"], got["zero_stage"], got["global_steps"]) == (2, True, stage, PIPE_STEPS)
        assert close(got["losses"], ref, rtol=1e-5), (stage, got["losses"], ref)

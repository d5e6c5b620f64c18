"""A published Hugging Face example script, unchanged, on zerodp: TRL's ``trl/scripts/sft.py``
(installed with TRL) started as a fine-tuning README says, ``deepspeed --num_gpus 2 sft.py ...
--deepspeed ds_z3_config.json``, here ``ZERODP_AS_DEEPSPEED=1 zerodp launch --num_gpus 2 ...``,
with the ZeRO-3 config fine-tuning tools ship (``hf_configs/ds_z3_config.json``: ``"auto"``
values, optimizer and parameters offloaded to the CPU), on a tiny GPT-2 and a JSON-lines dataset
saved locally. The weights it saves equal those of the same command at stage 0 (no sharding, no
offload): ZeRO-3 with offload changes where the numbers live, not what they are."""
from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
SRC = str(HERE.parent / "src")


def run_sft(python: str, work: Path, config: Path, out: str, ranks: int = 2) -> subprocess.CompletedProcess:
    import trl
    script = Path(trl.__file__).parent / "scripts" / "sft.py"
    env = dict(os.environ, ZERODP_AS_DEEPSPEED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    cmd = [python, "-c", "from zerodp.tools.cli import main; raise SystemExit(main())",
           "launch", "--num_gpus", str(ranks), str(script),
           "--model_name_or_path", "model", "--dataset_name", "data", "--output_dir", out, "--max_steps", "3",
           "--per_device_train_batch_size", "2", "--logging_steps", "1", "--learning_rate", "1e-3",
           "--bf16", "False", "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--max_length", "16",
           "--deepspeed", str(config)]
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(no_deepspeed_python, tmp_path_factory) -> Path:
    from trl_tasks import model, sentences, tokenizer
    work = tmp_path_factory.mktemp("hf_example")
    model().save_pretrained(work / "model")
    tokenizer().save_pretrained(work / "model")
    (work / "data").mkdir()
    (work / "data" / "train.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(32, 12, 1)))
    shipped = json.loads((HERE / "hf_configs" / "ds_z3_config.json").read_text())
    stage0 = copy.deepcopy(shipped)
    stage0["zero_optimization"] = {"stage": 0}
    (work / "ds_z0_config.json").write_text(json.dumps(stage0))
    for name, config in (("z3", HERE / "hf_configs" / "ds_z3_config.json"), ("z0", work / "ds_z0_config.json")):
        proc = run_sft(no_deepspeed_python, work, config, f"out_{name}")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-5000:]
        assert out.count("'loss'") >= 3, out[-3000:]  # three steps logged (rank 0)
    return work


def test_trl_sft_script_runs_unchanged_with_a_shipped_zero3_config(runs):
    from safetensors.torch import load_file
    z3 = load_file(runs / "out_z3" / "model.safetensors")
    z0 = load_file(runs / "out_z0" / "model.safetensors")
    start = load_file(runs / "model" / "model.safetensors")
    # (at stage 0 the Trainer's save clones every tensor, so the tied lm_head is written too, as with DeepSpeed)
    assert sorted(z3) == sorted(start) and set(z3) <= set(z0)
    assert all(torch.allclose(z3[k], z0[k], rtol=1e-5, atol=1e-6) for k in z3)
    assert any(not torch.equal(z3[k], start[k]) for k in z3)  # it trained


@pytest.mark.slow  # 40-55 s; AutoTP through TRL's trainer is checked in CI by test_trl.py's AutoTP parity
def test_trl_sft_script_with_autotp_equals_stage_0(no_deepspeed_python, tmp_path):
    """The same script with the shipped config at stage 2 (optimizer offloaded) and
    ``"tensor_parallel": {"autotp_size": 2}`` on 4 ranks (transformers splits the model, Accelerate
    gives each pair the same batches: the same 4 samples a step as 2 ranks without it) saves the
    weights of the script at stage 0 on 2 ranks, put together from the slices. Dropout is off in
    this model: split layers draw other dropout masks. (At stage 3 transformers itself refuses
    ``from_pretrained`` under AutoTP, "Weight conversions ... with DeepSpeed Tensor Parallelism".)"""
    from safetensors.torch import load_file
    from trl_tasks import model, sentences, tokenizer
    built = model()
    built.config.update({"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})
    built.save_pretrained(tmp_path / "model")
    tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(
        "".join(json.dumps({"text": s}) + "\n" for s in sentences(32, 12, 1)))
    shipped = json.loads((HERE / "hf_configs" / "ds_z3_config.json").read_text())
    configs = {"z0": {"stage": 0}, "z2tp": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                            "stage3_gather_16bit_weights_on_model_save": True}}
    for name, zero in configs.items():
        config = copy.deepcopy(shipped)
        config["zero_optimization"] = zero
        if name == "z2tp":
            config["tensor_parallel"] = {"autotp_size": 2}
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
        proc = run_sft(no_deepspeed_python, tmp_path, tmp_path / f"{name}.json", f"out_{name}",
                       ranks=4 if name == "z2tp" else 2)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    z0, tp = (load_file(tmp_path / f"out_{name}" / "model.safetensors") for name in ("z0", "z2tp"))
    start = load_file(tmp_path / "model" / "model.safetensors")
    assert sorted(tp) == sorted(start)
    assert all(tp[k].shape == z0[k].shape and torch.allclose(tp[k], z0[k], rtol=1e-5, atol=1e-6) for k in tp)
    assert any(not torch.equal(tp[k], start[k]) for k in tp)  # it trained


@pytest.mark.parametrize("kind", [pytest.param("gpt2", marks=pytest.mark.slow), "qwen3moe"])  # the same road
def test_accelerate_launch_with_a_deepspeed_config(no_deepspeed_python, tmp_path, kind):
    """``accelerate launch --use_deepspeed --deepspeed_config_file ...`` (Accelerate's launcher reads
    ``deepspeed.launcher.runner``) runs a Trainer script on zerodp at stage 3, with the losses of
    the same script under plain torchrun (DDP). With transformers' Qwen3-MoE, Accelerate's
    ``--deepspeed_moe_layer_cls_names`` makes the decoder layers leaves (through
    ``deepspeed.utils.set_z3_leaf_modules``), beside the sparse MoE blocks DeepSpeed's defaults make
    leaves, with every module with parameters a unit otherwise."""
    moe = kind != "gpt2"
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, **({"stage3_param_persistence_threshold": 1} if moe else {})},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}}}))
    env = dict(os.environ, ZERODP_AS_DEEPSPEED="1", OMP_NUM_THREADS="1", TEST_MODEL_KIND=kind,
               PYTHONPATH=os.pathsep.join(p for p in (SRC, str(HERE), os.environ.get("PYTHONPATH")) if p))
    script = str(HERE / "accelerate_script.py")
    moe_layers = ["--deepspeed_moe_layer_cls_names", "Qwen3MoeDecoderLayer"] if moe else []
    runs = {"accelerate": [no_deepspeed_python, "-m", "accelerate.commands.launch", "--use_deepspeed",
                           "--deepspeed_config_file", str(config), *moe_layers, "--num_processes", "2",
                           "--num_machines", "1", script, str(tmp_path / "accelerate.json")],
            "plain": [no_deepspeed_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      script, str(tmp_path / "plain.json")]}
    found = {}
    for name, cmd in runs.items():
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert (tmp_path / f"{name}.json").exists(), (proc.stdout + proc.stderr)[-5000:]
        found[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert found["accelerate"]["engine"] == "zerodp.engine.engine" and "DEEPSPEED" in found["accelerate"]["distributed"]
    got, want = found["accelerate"]["loss"], found["plain"]["loss"]
    assert len(got) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)
    assert found["accelerate"]["leaves"] == (["Qwen3MoeDecoderLayer", "Qwen3MoeSparseMoeBlock"] if moe else [])

"""ms-swift's own ``swift sft`` on zerodp (``ZERODP_AS_DEEPSPEED=1``), against the same command without
``--deepspeed`` (plain DDP): a check run by hand, outside CI, because ms-swift is a heavy install.

    python -m venv /tmp/swift && /tmp/swift/bin/pip install torch==2.13.0 ms-swift -e .
    /tmp/swift/bin/python benchmarks/swift_check.py [--work DIR] [--cases CASE ...]

It builds a tiny Qwen3 and a tiny Qwen3-MoE (from configs, seeded, with a word-level tokenizer that
knows Qwen's chat tokens) and a JSON-lines chat dataset in ``--work``, then runs ``swift sft`` on 2
CPU ranks for each case and prints the first logged loss and gradient norm and the largest relative
difference over every step's, against ``--deepspeed zero0`` (zerodp's engine sharding nothing: the
same code path in ms-swift and the Trainer) and against the plain run (DDP) of the same model and
tuner. A case passes when it equals the ``zero0`` run to 1e-5. A case is ``MODEL-TUNER-PRESET``:
``qwen3`` or ``qwen3moe``, ``lora`` or ``full``, and one of ms-swift's DeepSpeed presets (``zero2``,
``zero3``, ``zero3_offload``, ...), or ``plain``. The environment must not hold DeepSpeed itself
(``ZERODP_AS_DEEPSPEED=1`` refuses beside it). The same paths (``from_pretrained`` under a
stage-3 config, then peft) run in CI through transformers and peft (``tests/test_hf_trainer.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

DEFAULT = ["qwen3-full-zero2", "qwen3-full-zero3", "qwen3-full-zero3_offload", "qwen3-lora-zero2",
           "qwen3-lora-zero3", "qwen3-lora-zero3_offload", "qwen3moe-lora-zero2", "qwen3moe-full-zero3"]
EXTRA = os.environ.get("SWIFT_EXTRA", "").split()
WORDS = [f"w{i}" for i in range(200)]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<unk>"]


def build(work: Path) -> None:
    """The models, their tokenizer and the dataset (rank-independent, seeded)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    vocab = {w: i for i, w in enumerate(WORDS + ["system", "user", "assistant", "\n"] + SPECIAL)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", additional_special_tokens=SPECIAL[1:5])
    common = dict(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                  eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"])
    for name, model in (("qwen3", lambda: Qwen3ForCausalLM(Qwen3Config(intermediate_size=64, **common))),
                        ("qwen3moe", lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
                            intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                            output_router_logits=True, **common)))):
        torch.manual_seed(0)
        model().save_pretrained(work / name)
        tokenizer.save_pretrained(work / name)
    g = torch.Generator().manual_seed(1)

    def words(n: int) -> str:
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))
    rows = [{"messages": [{"role": "user", "content": words(6)}, {"role": "assistant", "content": words(8)}]}
            for _ in range(64)]
    (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def run(work: Path, case: str) -> tuple[list[float], list[float], str]:
    model, tuner, preset = case.split("-")
    env = dict(os.environ, ZERODP_AS_DEEPSPEED="1", OMP_NUM_THREADS="1", NPROC_PER_NODE="2",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", MODELSCOPE_OFFLINE="1")
    model_type = {"qwen3": "qwen3", "qwen3moe": "qwen3_moe"}[model]
    cmd = ["swift", "sft", "--model", str(work / model), "--model_type", model_type, "--template", "qwen3",
           "--dataset", str(work / "data.jsonl"),
           "--tuner_type", tuner, "--torch_dtype", "float32", "--max_steps", "4", "--logging_steps", "1",
           "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--learning_rate", "1e-3",
           "--max_length", "64", "--split_dataset_ratio", "0", "--save_strategy", "no", "--report_to", "none",
           "--output_dir", str(work / "out" / case), "--dataset_num_proc", "1", "--dataloader_num_workers", "0",
           "--seed", "0", "--data_seed", "0", "--use_cpu", "true", "--lora_rank", "4", "--lora_alpha", "8",
           "--target_modules", "all-linear", "--warmup_ratio", "0", "--lr_scheduler_type", "constant",
           *EXTRA]
    if preset != "plain":
        cmd += ["--deepspeed", preset]
    out_dir = work / "out" / case
    shutil.rmtree(out_dir, ignore_errors=True)
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    logs = sorted(out_dir.glob("*/logging.jsonl"))  # what swift logs at every step (rank 0)
    rows = [json.loads(line) for line in logs[-1].read_text().splitlines()] if logs else []
    rows = [r for r in rows if "loss" in r and "grad_norm" in r]
    if proc.returncode != 0 or not rows:
        return [], [], (proc.stdout + proc.stderr)[-3000:]
    return [float(r["loss"]) for r in rows], [float(r["grad_norm"]) for r in rows], ""


def _worst(got: list[float], want: list[float]) -> float:
    """The largest relative difference between two runs' logged values (inf if they logged unlike steps)."""
    if len(got) != len(want):
        return float("inf")
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/swift_check")
    parser.add_argument("--cases", nargs="+", default=DEFAULT)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    build(work)
    seen: dict[str, tuple] = {}

    def get(case: str) -> tuple:
        if case not in seen:
            seen[case] = run(work, case)
        return seen[case]
    print(f"{'case':26} {'loss 1':>10} {'zero0':>10} {'plain':>10} {'norm 1':>10} {'zero0':>10} {'plain':>10} "
          f"{'vs zero0':>9} {'vs plain':>9}")
    failed = 0
    for case in args.cases:
        model, tuner, _ = case.split("-")
        runs = [get(case), get(f"{model}-{tuner}-zero0"), get(f"{model}-{tuner}-plain")]
        errors = [r[2] for r in runs if r[2]]
        if errors:
            print(f"{case:26} failed\n{errors[0]}")
            failed += 1
            continue
        (loss, norm, _), (l0, n0, _), (lp, np_, _) = runs

        vs0, vsp = _worst(loss + norm, l0 + n0), _worst(loss + norm, lp + np_)
        print(f"{case:26} {loss[0]:10.6f} {l0[0]:10.6f} {lp[0]:10.6f} {norm[0]:10.6f} {n0[0]:10.6f} {np_[0]:10.6f} "
              f"{vs0:9.1e} {vsp:9.1e}")
        failed += not vs0 <= 1e-5
    print(f"{len(args.cases) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

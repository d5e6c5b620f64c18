"""TRL trainers with a DeepSpeed config, under ``ZERODP_AS_DEEPSPEED=1``:

    ZERODP_AS_DEEPSPEED=1 torchrun --nproc-per-node 2 trl_tasks.py OUT.json CASE [CASE ...]

CASE is ``<trainer>-<stage>``: trainer ``sft`` (``SFTTrainer``), ``dpo`` (``DPOTrainer`` with a
reference model, which TRL puts in an engine without optimizer: at stage 3 sharded, below it at
stage 0) or ``grpo`` (``GRPOTrainer``, which generates completions with the model being trained);
stage ``plain`` (no DeepSpeed: the reference) or 0-3; then optionally ``-tp2`` (the config's
``tensor_parallel.autotp_size`` 2; dropout off, as split layers draw other masks) or ``-half`` (one
sample per device, dropout off: a 4-rank run's reference for ``-tp2``). A tiny GPT-2 and a
word-level tokenizer are built locally; every case trains three steps in fp32 on fixed text. Rank 0 writes the logged
loss of every step, per case, to OUT.json.
"""
from __future__ import annotations

import json
import os
import sys

import torch
from datasets import Dataset
from hf_trainer_tasks import reset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(96)]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(WORDS + ["<pad>", "<eos>", "<unk>", "<bos>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   bos_token="<bos>")


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                      pad_token_id=96, eos_token_id=97, bos_token_id=99))


def model_without_dropout() -> GPT2LMHeadModel:
    built = model()
    built.config.update({"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})
    for m in built.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return built


def sentences(n: int, length: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, 96, (length,), generator=g)) for _ in range(n)]


def ds_config(stage: str, tp: bool = False) -> dict | None:
    if stage == "plain":
        return None
    return {**({"tensor_parallel": {"autotp_size": 2}} if tp else {}),
            "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "zero_optimization": {"stage": int(stage)}, "bf16": {"enabled": "auto"}}


def reward_length(completions, **kwargs) -> list[float]:
    return [float(len(c.split())) for c in completions]


def run_case(case: str, out_dir: str) -> list[float]:
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    kind, stage, *flags = case.split("-")
    tp, half = "tp2" in flags, "half" in flags
    common = dict(output_dir=os.path.join(out_dir, case), per_device_train_batch_size=1 if half else 2,
                  max_steps=3, logging_steps=1, learning_rate=1e-3, lr_scheduler_type="constant", use_cpu=True,
                  bf16=False, save_strategy="no", report_to=[], disable_tqdm=True, deepspeed=ds_config(stage, tp))
    build = model_without_dropout if tp or half else model
    if kind == "sft":
        data = Dataset.from_dict({"text": sentences(16, 12, 1)})
        trainer = SFTTrainer(model=build(), args=SFTConfig(max_length=16, **common), train_dataset=data,
                             processing_class=tokenizer())
    elif kind == "sftlora":  # by path with a peft_config: at stage 3 built in zero.Init, then get_peft_model
        from peft import LoraConfig
        saved = os.path.join(out_dir, "sftlora_model")
        if int(os.environ.get("RANK", "0")) == 0:
            build().save_pretrained(saved)
        args = SFTConfig(max_length=16, **common)
        torch.distributed.barrier()  # (the group the arguments started) rank 0 has saved the model
        trainer = SFTTrainer(model=saved, args=args, train_dataset=Dataset.from_dict({"text": sentences(16, 12, 1)}),
                             processing_class=tokenizer(),
                             peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                    target_modules=["c_attn", "c_fc"]))
    elif kind == "dpo":
        data = Dataset.from_dict({"prompt": sentences(16, 4, 2), "chosen": sentences(16, 4, 3),
                                  "rejected": sentences(16, 4, 4)})
        trainer = DPOTrainer(model=build(), ref_model=build(), args=DPOConfig(max_length=16, **common),
                             train_dataset=data, processing_class=tokenizer())
    elif kind == "grpo":
        data = Dataset.from_dict({"prompt": sentences(16, 4, 5)})
        saved = os.path.join(out_dir, "grpo_model")  # GRPOTrainer loads its model by name or path
        if int(os.environ.get("RANK", "0")) == 0:
            build().save_pretrained(saved)
        args = GRPOConfig(num_generations=2, max_completion_length=6, generation_batch_size=4, beta=0.1,
                          seed=0, **common)
        torch.distributed.barrier()  # (the group the arguments started) rank 0 has saved the model
        trainer = GRPOTrainer(model=saved, reward_funcs=reward_length, args=args, train_dataset=data,
                              processing_class=tokenizer())
    else:
        raise SystemExit(f"bad case {case!r}")
    trainer.train()
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    reset()
    return loss


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    results = {}
    for case in cases:
        print(f"case {case}", file=sys.stderr, flush=True)
        results[case] = run_case(case, os.path.dirname(out))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()

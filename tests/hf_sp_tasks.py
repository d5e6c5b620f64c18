"""The Hugging Face Trainer with DeepSpeed's sequence parallelism, as the Hugging Face guide writes
it (``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N))``
and a DeepSpeed config), under ``ZERODP_AS_DEEPSPEED=1``:

    ZERODP_AS_DEEPSPEED=1 torchrun --nproc-per-node N hf_sp_tasks.py OUT.json CASE [CASE ...]

A case is ``plain`` (no DeepSpeed, no sequence parallelism: run it on one process) or ``zS-spN``
(ZeRO stage S, sequence-parallel size N = the number of processes); ``sft-`` before either runs
TRL's ``SFTTrainer`` on text instead. Every case trains a small
Llama (sdpa) for 3 steps on the same samples in the same order (the sequence-parallel ranks take
turns serving their batch, which is the order one process draws them in) and reports the logged
losses and gradient norms."""
from __future__ import annotations

import os

import torch
import torchrun_cases

SEQ, VOCAB, MICRO = 16, 64, 2


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(torch.float32)


def dataset(n: int = 24):
    from datasets import Dataset
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist(),
                              "position_ids": [list(range(SEQ))] * n})


def sp_kwargs(case: str) -> dict:
    """The Trainer arguments of a sequence-parallel case (none for ``plain``); ``-ckoff``: the Trainer's
    gradient checkpointing with ``activation_checkpointing.cpu_checkpointing``."""
    if case.endswith("plain"):
        return {}
    stage, sp = int(case.split("z")[-1][0]), int(case.split("-sp")[1][0])
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "train_batch_size": "auto", "zero_optimization": {"stage": stage}}
    extra = {}
    if case.endswith("-ckoff"):
        config["activation_checkpointing"] = {"cpu_checkpointing": True}
        extra = {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": False}}
    return {"parallelism_config": ParallelismConfig(
        sp_backend="deepspeed", sp_size=sp,
        sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")),
        "deepspeed": config, **extra}


COMMON = dict(per_device_train_batch_size=MICRO, max_steps=3, learning_rate=1e-2, weight_decay=0.0, warmup_steps=0,
              lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], seed=0,
              max_grad_norm=1.0, use_cpu=True, dataloader_num_workers=0)


def run_sft_case(case: str, out_dir: str) -> dict:
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer
    from trl_tasks import sentences, tokenizer
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         pad_token_id=96, eos_token_id=97, bos_token_id=99))
    model.config._attn_implementation = "sdpa"
    # fp32: SFTConfig turns bf16 on by default, which the plain run takes as autocast over fp32 weights and a
    # DeepSpeed config (zerodp's or DeepSpeed's) as bf16 weights, two trainings that part within steps
    args = SFTConfig(output_dir=os.path.join(out_dir, case), max_length=16, bf16=False, **COMMON, **sp_kwargs(case))
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer(),
                         train_dataset=Dataset.from_dict({"text": sentences(24, 15, 5)}))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in logs], "grad_norm": [float(h["grad_norm"]) for h in logs]}


def run_case(case: str, out_dir: str) -> dict:
    from transformers import Trainer, TrainingArguments, default_data_collator
    if case.startswith("sft-"):
        return run_sft_case(case, out_dir)
    model = build_model()
    model.config._attn_implementation = "sdpa"
    args = TrainingArguments(output_dir=os.path.join(out_dir, case), **COMMON, **sp_kwargs(case))
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), data_collator=default_data_collator)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    offload = getattr(trainer.model_wrapped, "activation_offload", None)  # the engine's (activation_checkpointing)
    return {"loss": [h["loss"] for h in logs], "grad_norm": [float(h["grad_norm"]) for h in logs],
            "offload_marked": offload.stats.marked if offload is not None else 0}


if __name__ == "__main__":
    torchrun_cases.serve(run_case)

"""QLoRA through the roads users take, under ``ZERODP_AS_DEEPSPEED=1``:

    ZERODP_AS_DEEPSPEED=1 torchrun --nproc-per-node 2 qlora_roads_tasks.py OUT.json CASE [CASE ...]

A tiny Qwen3 (built from a config, saved once by rank 0) is loaded in 4 bits by transformers
(``BitsAndBytesConfig``: nf4, fp32 compute, the packed codes stored in ``uint8``, ``float32`` or
``bfloat16``), given LoRA adapters on every linear layer by peft, and trained 4 AdamW steps. The
model is left in the mode ``from_pretrained`` leaves it, eval, as a script that never calls
``.train()`` trains it: on a CPU with AVX512-BF16, bitsandbytes then repacks the weights of the
layers whose input needs no gradient for its CPU kernels in their first forward (it assigns the
weight new data), which stage 3 must keep.

CASE is ``<road>-<storage>`` with road one of:

* ``ref``: one process (rank 0 alone) on the global batch: the reference;
* ``hf-z2``, ``hf-z3``: an ``HfDeepSpeedConfig`` of that stage alive while ``from_pretrained`` loads
  the model (transformers' own ZeRO-3 road, the one LLaMA-Factory, axolotl and ms-swift take), then
  ``deepspeed.initialize``;
* ``sharded-z2``, ``sharded-z3``: ``from_pretrained`` inside ``deepspeed.zero.ShardedLoad``;
* ``trainer-plain``, ``trainer-z2``, ``trainer-z3``: the Transformers ``Trainer`` (its own DDP loop
  without a DeepSpeed config: the reference), evaluating after every step, so that the repacking
  happens in an evaluation between training steps;
* ``int8-ref``, ``int8-hf-z2``, ``int8-hf-z3`` (storage ``int8``): an 8-bit base (LLM.int8).

Rank 0 writes each case's per-step losses (and, for 8-bit at stage 3, what the engine said) to
OUT.json.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import sys

import torch
import torch.distributed as dist

VOCAB, SEQ, MICRO, STEPS, LR = 128, 16, 2, 4, 1e-2
# The Trainer evaluates between steps, after which every 4-bit layer runs bitsandbytes' CPU kernel,
# which computes in bf16: rounding differences of fp32 updates (1e-7, from the flat layout) then flip
# bf16 roundings, at 2e-5 of the loss with lr 1e-2 and 1e-6 with 3e-3 (measured, DDP against stage 3)
TRAINER_LR = 3e-3


def save_base(path: str) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)  # every out_features a multiple of 32, as bitsandbytes' CPU repacking needs
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=64, tie_word_embeddings=True)).save_pretrained(path)


def quantization(storage: str):
    from transformers import BitsAndBytesConfig
    if storage == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                              bnb_4bit_quant_storage=getattr(torch, storage))


def load(path: str, storage: str, sharded: bool = False):
    """The base in 4 (or 8) bits with LoRA on every linear layer, in the mode from_pretrained leaves."""
    import deepspeed  # zerodp under ZERODP_AS_DEEPSPEED=1
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    kwargs = {"quantization_config": quantization(storage), "dtype": torch.float32}
    if sharded:
        with deepspeed.zero.ShardedLoad():
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def reference(path: str, storage: str, out_dir: str) -> dict:
    if dist.get_rank() != 0:
        return {}
    model = load(path, storage)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        ids = torch.cat([batch(step, r) for r in range(dist.get_world_size())])
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # the trained 4-bit base as bitsandbytes' own state_dict() writes it (it undoes the CPU repacking first)
    torch.save({k: v for k, v in model.state_dict().items() if "base_layer" in k}, os.path.join(out_dir, "ref.pt"))
    return {"loss": losses}


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def engine_run(path: str, storage: str, stage: int, sharded: bool, out_dir: str) -> dict:
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig
    config = ds_config(stage)
    keep = None if sharded else HfDeepSpeedConfig(config)  # alive while from_pretrained loads
    model = load(path, storage, sharded)
    said = _Said()
    logging.getLogger("zerodp").addHandler(said)
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    finally:
        logging.getLogger("zerodp").removeHandler(said)
    losses = []
    for step in range(STEPS):
        ids = batch(step, dist.get_rank())
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    repacked = sum(bool(getattr(getattr(p, "quant_state", None), "packing_format_for_cpu", False))
                   for p in model.parameters())
    saved = None
    if storage != "int8":  # the checkpoint, consolidated, against one process's state_dict()
        ckpt = os.path.join(out_dir, f"ckpt-{stage}-{storage}-{sharded}")
        engine.save_checkpoint(ckpt)
        saved = consolidated_like_reference(ckpt, os.path.join(out_dir, "ref.pt"))
    engine.destroy()
    del keep
    from bitsandbytes.functional import has_avx512bf16
    return {"loss": losses, "said": said.lines, "repacked": repacked, "cpu_repacks": bool(has_avx512bf16()),
            "saved": saved}


def consolidated_like_reference(ckpt: str, reference: str):
    """On rank 0: the checkpoint consolidated, its 4-bit codes and quantization state against what
    one process's ``state_dict()`` holds after the same training: the names missing on either side
    and the largest difference (None on the other ranks)."""
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    from safetensors.torch import load_file

    from zerodp.checkpoint.consolidate import consolidate
    out = ckpt + "-full"
    consolidate(ckpt, out)
    got, want = load_file(os.path.join(out, "model.safetensors")), torch.load(reference)
    common = sorted(set(got) & set(want))
    worst = max((got[k].float() - want[k].float()).abs().max().item() for k in common if want[k].numel())
    return {"missing": sorted(set(want) - set(got)), "compared": len(common), "max_diff": worst}


def trainer_run(path: str, storage: str, stage: int | None, out_dir: str) -> dict:
    from accelerate.state import AcceleratorState
    from hf_trainer_tasks import Tokens  # token ids below this vocabulary's size
    from transformers import Trainer, TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    ds = None
    if stage is not None:
        ds = ds_config(stage)
        ds.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
        ds["optimizer"]["params"] = {"lr": "auto", "weight_decay": "auto"}
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=MICRO, per_device_eval_batch_size=MICRO, max_steps=STEPS,
        logging_steps=1, learning_rate=TRAINER_LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        eval_strategy="steps", eval_steps=1, deepspeed=ds, use_cpu=True, save_strategy="no", report_to=[],
        disable_tqdm=True)
    model = load(path, storage)  # after the arguments: under a stage-3 config, transformers' ZeRO-3 road
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(MICRO * 2 * STEPS),
                      eval_dataset=Tokens(4, offset=1000))
    trainer.train()
    out = {"loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "eval": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]}
    AcceleratorState._reset_state()
    unset_hf_deepspeed_config()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    return out


def run_case(case: str, path: str, out_dir: str) -> dict:
    print(f"case {case}", file=sys.stderr, flush=True)
    road, storage = case.rsplit("-", 1)
    road = road.removeprefix("int8-")
    try:
        if road == "ref":
            return reference(path, storage, out_dir)
        if road.startswith("trainer-"):
            kind = road.removeprefix("trainer-")
            return trainer_run(path, storage, None if kind == "plain" else int(kind[1:]), os.path.join(out_dir, case))
        kind, stage = road.split("-")
        return engine_run(path, storage, int(stage[1:]), kind == "sharded", out_dir)
    finally:
        gc.collect()


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    import deepspeed
    deepspeed.init_distributed()
    path = os.path.join(os.path.dirname(out), "base")
    if dist.get_rank() == 0:
        save_base(path)
    dist.barrier()
    results = {case: run_case(case, path, os.path.dirname(out)) for case in cases}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()

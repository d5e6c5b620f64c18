"""Hugging Face ``Trainer`` runs with a DeepSpeed config, under ``ZERODP_AS_DEEPSPEED=1``:

    ZERODP_AS_DEEPSPEED=1 torchrun --nproc-per-node 2 hf_trainer_tasks.py OUT.json CASE [CASE ...]

Each CASE trains a tiny GPT-2 (built from a config, seeded) for three optimizer steps on the
same fixed token batches, with a fresh ``Trainer`` whose ``TrainingArguments(deepspeed=...)``
holds the case's DeepSpeed config, or none (``plain``: the Trainer's own DDP loop, the
reference). The Trainers run one after another in the same process group. Rank 0 writes, per
case, the logged loss and gradient norm of every step and the evaluation loss before and after
training (before: by a Trainer of its own, only without DeepSpeed and at stage 3, as
transformers allows), to OUT.json.

CASE is ``plain`` or ``z<stage>`` followed by any of ``-bf16``, ``-fp16`` (with a linear schedule;
``-fp16-ovf``: a loss scale so large that the first step overflows and is skipped), ``-off`` (optimizer state
offloaded to the CPU), ``-gas2`` (two micro-batches per step), ``-tp2`` (the config's
``tensor_parallel.autotp_size`` 2: transformers splits the model with ``tp_model_init``, and
accelerate gives both ranks of a tensor-parallel pair the same batches; with ``-sp`` and ``-lp``
the config's ``sequence_parallel`` and ``loss_parallel`` too), ``-mics2`` (``mics_shard_size`` 2: hybrid
sharding), ``-gc`` (the Trainer's gradient checkpointing), ``-half`` (one sample
per device instead of two: a 4-rank run's reference for ``-tp2``), ``-nodrop`` (dropout off, which
``-tp2`` implies: split layers draw other dropout masks than one process) and ``-pre`` (the model loaded with
``from_pretrained`` from a directory rank 0 saved it to, after the ``TrainingArguments``, so that
at stage 3 transformers builds it inside ``deepspeed.zero.Init`` and loads the weights through
``GatheredParameters``; with ``-miss`` from a checkpoint that lacks two weights, which
transformers initializes), e.g. ``z3-bf16-off``; ``-ckpt`` runs the checkpoint scenario instead
(``run_checkpoint_case``), ``-lora`` a PEFT LoRA model (``run_lora_case``; with ``-pre`` made by
``get_peft_model`` on the loaded model, which at stage 3 is built in ``zero.Init``, as fine-tuning tools
do; with ``-mts`` also PEFT's ``modules_to_save=["ln_f"]``, a trained copy of a base module);
``-adalora`` a PEFT AdaLoRA model whose rank allocation (``update_and_allocate``, which under DeepSpeed reads
gradients with ``deepspeed.utils.safe_get_full_grad``) runs after every backward (``run_adalora_case``);
``-qwen3moe`` and ``-mixtral`` train transformers' tiny Qwen3-MoE or Mixtral (router aux loss on) instead
of GPT-2, at stage 3 with every module a unit, so the sparse MoE block must be a leaf (DeepSpeed's default
leaf classes); ``-ep2`` splits their experts over the 2 ranks (``expert_parallel.autoep_size``);
``-resize`` (with ``-pre``) calls ``resize_token_embeddings`` on the loaded model.

The Trainers run on the CPU, or on CUDA with ``ZERODP_HF_TASKS_DEVICE=cuda`` (tests/cuda).
"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch
from accelerate.state import AcceleratorState
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

VOCAB, SEQ = 100, 16
ON_CUDA = os.environ.get("ZERODP_HF_TASKS_DEVICE", "cpu") == "cuda"
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if ON_CUDA else torch.device("cpu")
BUILT_IN_INIT: dict[str, bool] = {}  # per -pre case: every parameter a zero.Init slice after loading
ADAPTERS: dict[str, dict] = {}  # per -lora case: where peft put the adapters, and lora_B's largest value


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences (language modelling: the labels are the inputs)."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(self.offset + i))
        return {"input_ids": ids, "labels": ids}


def ds_config(stage: int, offload: bool) -> dict:
    """A DeepSpeed config of the kind fine-tuning tools ship: "auto" wherever the Trainer knows."""
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "zero_optimization": zero, "bf16": {"enabled": "auto"}}


def parse(case: str) -> dict:
    head, *flags = case.split("-")
    unknown = set(flags) - {"bf16", "fp16", "ovf", "off", "gas2", "pre", "miss", "ckpt", "lora", "tp2", "half",
                            "nodrop", "sp", "lp", "mics2", "gc", "mts", "qwen3moe", "mixtral", "resize", "adalora",
                            "ep2"}
    if unknown or not (head == "plain" or head in ("z0", "z1", "z2", "z3")):
        raise SystemExit(f"bad case {case!r}")
    ds = None if head == "plain" else ds_config(int(head[1]), "off" in flags)
    if ds is not None and "fp16" in flags:  # -ovf: a loss scale so large that the first step overflows
        ds["fp16"] = {"enabled": "auto", "initial_scale_power": 18 if "ovf" in flags else 4, "hysteresis": 1}
    if ds is not None and "tp2" in flags:
        ds["tensor_parallel"] = {"autotp_size": 2, "sequence_parallel": "sp" in flags, "loss_parallel": "lp" in flags}
    kind = "qwen3moe" if "qwen3moe" in flags else "mixtral" if "mixtral" in flags else "gpt2"
    if ds is not None and kind != "gpt2":  # every module with parameters a unit: the MoE block must be a leaf
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 1
    if ds is not None and "ep2" in flags:  # the experts split over pairs of ranks (AutoEP's config block)
        ds["expert_parallel"] = {"enabled": True, "autoep_size": 2}
    if ds is not None and "mics2" in flags:
        ds["zero_optimization"]["mics_shard_size"] = 2
    return {"ds": ds, "fp16": "fp16" in flags, "batch": 1 if "half" in flags else 2, "gc": "gc" in flags,
            "dropout": not ({"tp2", "nodrop"} & set(flags)),
            "bf16": "bf16" in flags, "gas": 2 if "gas2" in flags else 1, "pre": "pre" in flags,
            "ckpt": "ckpt" in flags, "lora": "lora" in flags, "miss": "miss" in flags, "mts": "mts" in flags,
            "kind": kind, "resize": "resize" in flags, "adalora": "adalora" in flags}


def adapters_of(model) -> dict:
    """Where peft put the new adapter weights (before ``initialize``), and whether ``lora_B`` is zero
    there, as peft initializes it (read whole at stage 3)."""
    import deepspeed  # zerodp under ZERODP_AS_DEEPSPEED=1
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    with deepspeed.zero.GatheredParameters([p for p in lora.values() if hasattr(p, "ds_shape")]):
        b_max = max(p.abs().max().item() for n, p in lora.items() if "lora_B" in n)
    return {"devices": sorted({str(p.device) for p in lora.values()}), "lora_B_max": b_max}


def reset() -> None:
    """Let the next Trainer build its Accelerator and DeepSpeed config afresh, in the same group."""
    AcceleratorState._reset_state()
    unset_hf_deepspeed_config()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # set by TrainingArguments(deepspeed=...), never unset
    gc.collect()


def build_model(dropout: bool = True, kind: str = "gpt2") -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen3moe":  # transformers' own MoE models: fused 3-D experts, a router aux loss
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.01))
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM
        return MixtralForCausalLM(MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.01))
    off = {} if dropout else {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, **off))


def make_trainer(case: str, out_dir: str, model: GPT2LMHeadModel | None = None) -> Trainer:
    spec = parse(case)
    if (spec["ckpt"] or spec["lora"]) and spec["ds"]:  # what the fine-tuning tools' ZeRO-3 configs say,
        spec["ds"]["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True  # so saves write weights
    if model is None and not spec["pre"]:
        model = build_model(spec["dropout"], spec["kind"])
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, case), per_device_train_batch_size=spec["batch"],
        per_device_eval_batch_size=spec["batch"],
        gradient_accumulation_steps=spec["gas"], max_steps=3, logging_steps=1, learning_rate=1e-3,
        lr_scheduler_type="linear" if spec["fp16"] else "constant", bf16=spec["bf16"], fp16=spec["fp16"],
        deepspeed=spec["ds"], use_cpu=not ON_CUDA,
        save_strategy="steps" if spec["ckpt"] else "no", save_steps=2, report_to=[], disable_tqdm=True,
        gradient_checkpointing=spec["gc"])
    if model is None:  # after the arguments: under a stage-3 config, built in zero.Init
        torch.distributed.barrier()  # (the group the arguments started) rank 0 has saved the weights
        torch.manual_seed(1)  # what initializes the weights a checkpoint lacks (-miss)
        model = GPT2LMHeadModel.from_pretrained(os.path.join(out_dir, "partial" if spec["miss"] else "pretrained"))
        # as DeepSpeed's zero.Init leaves them: empty data on the real device, the shape in ds_shape
        BUILT_IN_INIT[case] = all(p.numel() == 0 and p.device == model.device == DEVICE
                                  and hasattr(p, "ds_shape") for p in model.parameters())
        if spec["resize"]:  # transformers makes the new embedding on the old one's device, copies the rows in
            torch.manual_seed(3)  # (at stage 3 inside GatheredParameters) and draws the new rows
            model.resize_token_embeddings(VOCAB + 8)
    if spec["lora"]:  # after from_pretrained (-pre): peft puts each adapter on its base layer's device
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(2)  # the adapters' initial values, the same whatever loading drew before
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"],
                                                 lora_dropout=0.0, modules_to_save=["ln_f"] if spec["mts"] else None))
        ADAPTERS[case] = adapters_of(model)
    if spec["adalora"]:
        from peft import AdaLoraConfig, get_peft_model
        torch.manual_seed(2)
        model = get_peft_model(model, AdaLoraConfig(  # ranks pruned from 6 to 2 over the 3 steps
            init_r=6, target_r=2, tinit=0, tfinal=1, deltaT=1, total_step=3, lora_alpha=8,
            target_modules=["c_attn", "c_proj", "c_fc"], lora_dropout=0.0))
        return AdaLoraTrainer(model=model, args=args, train_dataset=Tokens(48), eval_dataset=Tokens(8, offset=1000))
    return Trainer(model=model, args=args, train_dataset=Tokens(48), eval_dataset=Tokens(8, offset=1000))


class AdaLoraTrainer(Trainer):
    """Runs AdaLoRA's ``update_and_allocate`` where peft asks for it: after each backward, before the
    optimizer step, since its importance scores read the gradients (``p.grad`` without DeepSpeed,
    ``deepspeed.utils.safe_get_full_grad`` with it). Under DeepSpeed the engine steps inside
    ``accelerator.backward``, so there the update goes between the engine's backward and step."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        accelerator = self.accelerator
        plain = accelerator.backward

        def backward(loss, **kwargs):
            wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
            if wrapped is None:
                plain(loss, **kwargs)
                self.update_ranks()
                return
            wrapped.engine.set_gradient_accumulation_boundary(accelerator.sync_gradients)
            wrapped.engine.backward(loss, **kwargs)
            self.update_ranks()
            wrapped.engine.step()

        accelerator.backward = backward
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            del accelerator.backward

    def update_ranks(self) -> None:
        """At stage 3 the adapters' values are gathered for it (peft reads and masks them whole),
        rank 0's masked values kept; every rank computes the same masks from the same gradients."""
        import contextlib

        from transformers.integrations import is_deepspeed_zero3_enabled
        lora = [p for n, p in self.model.named_parameters() if "lora_" in n]
        if is_deepspeed_zero3_enabled():
            import deepspeed  # zerodp under ZERODP_AS_DEEPSPEED=1
            gathered = deepspeed.zero.GatheredParameters(lora, modifier_rank=0)
        else:
            gathered = contextlib.nullcontext()
        with gathered:
            self.model.base_model.update_and_allocate(self.state.global_step)


PROMPT = [[1, 5, 9, 2]]


def generate(model) -> list:
    return model.generate(torch.tensor(PROMPT, device=DEVICE), max_new_tokens=5, do_sample=False,
                          pad_token_id=0).tolist()


def losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run_checkpoint_case(case: str, out_dir: str) -> dict:
    """Train 3 steps saving a checkpoint after step 2, generate, ``save_model``; resume a new
    Trainer from the checkpoint; load the saved model without DeepSpeed, evaluate and generate."""
    here = os.path.join(out_dir, case)
    trainer = make_trainer(case, out_dir)
    trainer.train()
    result = {"loss": losses(trainer), "eval_after": trainer.evaluate()["eval_loss"],
              "generated": generate(trainer.model)}  # every rank calls it: stage 3 gathers in step
    trainer.save_model(os.path.join(here, "final"))
    reset()
    resumed = make_trainer(case, out_dir)
    resumed.train(resume_from_checkpoint=os.path.join(here, "checkpoint-2"))
    result["resumed_loss"] = losses(resumed)
    reset()
    torch.distributed.barrier()  # rank 0 has written the model
    saved = make_trainer("plain", out_dir, model=GPT2LMHeadModel.from_pretrained(os.path.join(here, "final")))
    result["saved_eval"] = saved.evaluate()["eval_loss"]
    result["saved_generated"] = generate(saved.model)
    reset()
    return result


def run_lora_case(case: str, out_dir: str) -> dict:
    """PEFT LoRA through the Trainer: train, evaluate, save the adapter; reload it onto the base
    model without DeepSpeed and evaluate."""
    from peft import PeftModel
    here = os.path.join(out_dir, case)
    trainer = make_trainer(case, out_dir)
    trainer.train()
    result = {"loss": losses(trainer), "eval_after": trainer.evaluate()["eval_loss"],
              "grad_norm": [float(h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h],
              "adapters": ADAPTERS.get(case), "built_in_init": BUILT_IN_INIT.get(case)}
    from torch.distributed.tensor import DTensor
    result["adapter_split"] = any(isinstance(p, DTensor) and p.placements[0].is_shard()
                                  for n, p in trainer.model.named_parameters() if "lora_" in n)
    trainer.save_model(os.path.join(here, "adapter"))
    reset()
    torch.distributed.barrier()  # rank 0 has written the adapter
    result["adapter_files"] = sorted(os.listdir(os.path.join(here, "adapter")))
    reloaded = PeftModel.from_pretrained(build_model(), os.path.join(here, "adapter"))
    result["saved_eval"] = make_trainer("plain", out_dir, model=reloaded).evaluate()["eval_loss"]
    reset()
    return result


def run_adalora_case(case: str, out_dir: str) -> dict:
    """PEFT AdaLoRA through the Trainer: train (the rank allocation reads the reduced gradients after
    each backward), evaluate; the ranks it kept."""
    trainer = make_trainer(case, out_dir)
    trainer.train()
    config = trainer.model.peft_config["default"]
    result = {"loss": losses(trainer), "eval_after": trainer.evaluate()["eval_loss"],
              "grad_norm": [float(h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h],
              "rank_pattern": {k: [bool(x) for x in v] for k, v in (config.rank_pattern or {}).items()}}
    reset()
    return result


def run_case(case: str, out_dir: str) -> dict:
    print(f"case {case}", file=sys.stderr, flush=True)
    result = {}
    spec = parse(case)
    if spec["adalora"]:
        return run_adalora_case(case, out_dir)
    if spec["ckpt"]:
        return run_checkpoint_case(case, out_dir)
    if spec["lora"]:
        return run_lora_case(case, out_dir)
    if spec["ds"] is None or spec["ds"]["zero_optimization"]["stage"] == 3:
        # transformers refuses ZeRO inference below stage 3, and a Trainer that evaluated first
        # (an engine without optimizer) cannot train afterwards, with DeepSpeed too: a Trainer of its own
        result["eval_before"] = make_trainer(case, out_dir).evaluate()["eval_loss"]
        reset()
    trainer = make_trainer(case, out_dir)
    trainer.train()
    result["loss"] = losses(trainer)
    result["grad_norm"] = [float(h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
    result["eval_after"] = trainer.evaluate()["eval_loss"]
    result["learning_rate"] = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    from torch.distributed.tensor import DTensor
    result["split"] = any(isinstance(p, DTensor) for p in trainer.model.parameters())
    if case in BUILT_IN_INIT:
        result["built_in_init"] = BUILT_IN_INIT[case]
    result["leaves"] = sorted({type(m).__name__ for m in trainer.model.modules() if getattr(m, "_z3_leaf", False)})
    reset()
    return result


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:  # the same weights the other cases start from; and without two of them (-miss)
        build_model().save_pretrained(os.path.join(os.path.dirname(out), "pretrained"))
        from safetensors.torch import load_file, save_file
        weights = load_file(os.path.join(os.path.dirname(out), "pretrained", "model.safetensors"))
        del weights["transformer.h.1.mlp.c_fc.weight"], weights["transformer.h.1.mlp.c_fc.bias"]
        partial = os.path.join(os.path.dirname(out), "partial")
        os.makedirs(partial, exist_ok=True)
        save_file(weights, os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
        build_model().config.save_pretrained(partial)
    results = {case: run_case(case, os.path.dirname(out)) for case in cases}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()

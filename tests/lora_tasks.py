"""Worker tasks for ``test_lora.py``: a ``peft`` LoRA adapter on a tiny ``transformers`` GPT-2,
trained through zerodp, and its single-process PEFT reference.

The base model (``hf_tasks.build_model("gpt2")``) is frozen; LoRA adapters (rank 4) on the
attention and MLP projections are the only trainable parameters. ``peft`` and ``transformers``
are imported inside the functions.
"""
from __future__ import annotations

import hf_tasks
import torch
import torch.distributed as dist

import zerodp

ADAMW = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.0}
STEPS, GAS = 3, 2


def build_lora(seed: int = 0):
    from peft import LoraConfig, get_peft_model
    base = hf_tasks.build_model("gpt2", seed=seed)
    torch.manual_seed(seed + 1)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_fc"],
                     fan_in_fan_out=True)
    return get_peft_model(base, cfg)


def _numel(p) -> int:
    """A parameter's size, also at stage 3 outside a gather (empty data, ``ds_numel``), as the
    Trainer counts it."""
    return getattr(p, "ds_numel", p.numel())


def loss_of(model, step: int, rank: int, micro: int):
    ids = hf_tasks.batch(step, rank, micro)
    return model(input_ids=ids, labels=ids).loss


def reference(world: int) -> dict:
    """One process: PEFT model, torch AdamW over the adapters, the whole global batch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_lora()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, **ADAMW)
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            losses = [loss_of(model, step, r, m) for r in range(world) for m in range(GAS)]
            (sum(losses) / len(losses)).backward()
            opt.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def lora_train(group, stage: int, save_dir: str | None = None, precision: str = "fp32") -> dict:
    rank = dist.get_rank(group)
    model = build_lora()
    cfg = {"train_micro_batch_size_per_gpu": hf_tasks.MICRO, "gradient_accumulation_steps": GAS,
           "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": dict(ADAMW, betas=list(ADAMW["betas"]))},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    engine, *_ = zerodp.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                   config=cfg, process_group=group)
    for step in range(STEPS):
        for m in range(GAS):
            engine.backward(loss_of(engine, step, rank, m))
            engine.step()
    memory = engine.memory_breakdown()
    trainable = [p for p in model.parameters() if p.requires_grad]
    from zerodp.tools.memory_check import compare_with_engine
    compared = [(c.category, c.estimated, c.measured, c.ok) for c in compare_with_engine(engine)]
    with zerodp.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if save_dir is not None:
        with zerodp.GatheredParameters(trainable):  # the adapter, full, for PEFT's own format
            if rank == 0:
                model.save_pretrained(save_dir)
        dist.barrier(group)
    out = {"params": params, "memory": memory, "compared": compared,
           "frozen_grads": [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None],
           "n_trainable": sum(_numel(p) for p in trainable), "n_all": sum(_numel(p) for p in model.parameters())}
    engine.destroy()
    return out


def meta_lora_task(group, init_lora_weights=True) -> dict:
    """A GPT-2 built wholly on the meta device (``zero.Init(meta=True)``: ``initialize`` gives every
    value), LoRA adapters added by ``get_peft_model``, stage 3: the adapters' values after
    ``initialize``, and the first loss with the adapters on and off."""
    from peft import LoraConfig, get_peft_model
    with zerodp.zero.Init(meta=True):
        base = hf_tasks.build_model("gpt2")
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                     init_lora_weights=init_lora_weights)
    model = get_peft_model(base, cfg)
    config = {"train_micro_batch_size_per_gpu": hf_tasks.MICRO, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 3}}
    try:
        engine, *_ = zerodp.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                       config=config, process_group=group)
    except ValueError as e:
        return {"error": str(e)}
    with zerodp.GatheredParameters(list(model.parameters())):
        adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    ids = hf_tasks.batch(0, dist.get_rank(group), 0)
    with torch.no_grad():
        on = engine(input_ids=ids, labels=ids).loss.item()
        with model.disable_adapter():
            off = engine(input_ids=ids, labels=ids).loss.item()
    engine.destroy()
    return {"adapters": adapters, "on": on, "off": off}


def _merged_round(model, ids, safe_merge: bool) -> dict:
    """PEFT's merge and unmerge of the adapters into the base weights (as TRL does around generation):
    the merged model's logits, and the weights while merged and after unmerging."""
    with torch.no_grad():
        model.merge_adapter(safe_merge=safe_merge)
        logits = model(input_ids=ids).logits.clone()
        merged = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
        model.unmerge_adapter()
    return {"logits": logits, "merged": merged}


def merge_reference(world: int, safe_merge: bool) -> dict:
    """One process: a step, a merged round, another step, on the whole global batch."""
    model = build_lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
    out = {}
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        losses = [loss_of(model, step, r, 0) for r in range(world)]
        (sum(losses) / world).backward()
        opt.step()
        if step == 0:
            out.update(_merged_round(model, hf_tasks.batch(9, 0, 0), safe_merge))
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def merge_in_engine(group, stage: int, safe_merge: bool) -> dict:
    """The same through zerodp: the merged round inside ``GatheredParameters`` (at stage 3 the merged
    forward runs the units' hooks inside it), as TRL's ``unwrap_model_for_generation`` does."""
    rank = dist.get_rank(group)
    model = build_lora()
    cfg = {"train_micro_batch_size_per_gpu": hf_tasks.MICRO, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": dict(ADAMW, betas=list(ADAMW["betas"]))},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    engine, *_ = zerodp.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                   config=cfg, process_group=group)
    out = {}
    for step in range(2):
        engine.backward(loss_of(engine, step, rank, 0))
        engine.step()
        if step == 0:
            with zerodp.GatheredParameters(list(model.parameters())):
                out.update(_merged_round(model, hf_tasks.batch(9, 0, 0), safe_merge))
    with zerodp.GatheredParameters(list(model.parameters())):
        out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return out

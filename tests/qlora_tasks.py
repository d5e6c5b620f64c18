"""Worker tasks for ``test_qlora.py``: QLoRA, a LoRA adapter on a base model quantized to 4 bits by
bitsandbytes (nf4, packed weights stored as fp32 so that the engine can lay them out with the rest),
trained through zerodp at stage 3 against the same model trained in one process."""
from __future__ import annotations

import hf_tasks
import torch
import torch.distributed as dist

import zerodp

ADAMW = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.0}
STEPS = 3


def save_base(path: str) -> None:
    hf_tasks.build_model("llama").save_pretrained(path)


def build_qlora(path: str):
    """The saved Llama loaded in 4 bits, made ready for k-bit training, with LoRA on its projections."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                               bnb_4bit_quant_storage=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    return model.train()  # from_pretrained leaves it in eval mode


def _loss(model, step: int, rank: int) -> torch.Tensor:
    ids = hf_tasks.batch(step, rank, 0)
    return model(input_ids=ids, labels=ids).loss


def reference(path: str, world: int) -> dict:
    model = build_qlora(path)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, **ADAMW)
    for step in range(STEPS):
        opt.zero_grad()
        (sum(_loss(model, step, r) for r in range(world)) / world).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def train(group, path: str) -> dict:
    rank = dist.get_rank(group)
    model = build_qlora(path)
    packed = [p for p in model.parameters() if type(p).__name__ == "Params4bit"]
    cfg = {"train_micro_batch_size_per_gpu": hf_tasks.MICRO, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": dict(ADAMW, betas=list(ADAMW["betas"]))},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1}}
    engine, *_ = zerodp.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                   config=cfg, process_group=group)
    losses = []
    for step in range(STEPS):
        loss = _loss(engine, step, rank)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with zerodp.GatheredParameters([p for p in model.parameters() if p.requires_grad]):
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    out = {"trained": trained, "losses": losses, "packed": len(packed),
           "params_bytes": engine.memory_breakdown()["parameters"],
           "all_bytes": sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())}
    engine.destroy()
    return out

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


def load_base(path: str, sharded=None, storage: torch.dtype = torch.float32):
    """The saved Llama loaded in 4 bits (nf4, double quantization); ``sharded`` (a process group):
    inside ``zerodp.zero.ShardedLoad``, each rank of the group keeping its slice of every packed weight."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                               bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=storage)
    if sharded is None:
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32)
    with zerodp.zero.ShardedLoad(sharded):
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32)


def packed_bytes(model) -> tuple[int, int]:
    """(bytes of packed 4-bit codes this rank holds, bytes of the whole model's codes)."""
    from zerodp.core.init_shards import init_shard
    held = whole = 0
    for p in model.parameters():
        if type(p).__name__ == "Params4bit":
            shard = init_shard(p)
            held += p.numel() * p.element_size() + (0 if shard is None else shard.data.numel() * p.element_size())
            whole += getattr(p, "ds_numel", p.numel()) * p.element_size()
    return held, whole


def with_lora(model):
    """``model`` made ready for k-bit training, with LoRA on its projections."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    return model.train()  # from_pretrained leaves it in eval mode


def build_qlora(path: str, storage: torch.dtype = torch.float32):
    """The saved Llama loaded in 4 bits, made ready for k-bit training, with LoRA on its projections."""
    return with_lora(load_base(path, storage=storage))


def _loss(model, step: int, rank: int) -> torch.Tensor:
    ids = hf_tasks.batch(step, rank, 0)
    return model(input_ids=ids, labels=ids).loss


def reference(path: str, world: int, storage: torch.dtype = torch.float32) -> dict:
    model = build_qlora(path, storage)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, **ADAMW)
    for step in range(STEPS):
        opt.zero_grad()
        (sum(_loss(model, step, r) for r in range(world)) / world).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


CONFIG = {"train_micro_batch_size_per_gpu": hf_tasks.MICRO, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": dict(ADAMW, betas=list(ADAMW["betas"]))},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1}}


def _engine(model, group):
    engine, *_ = zerodp.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                   config=CONFIG, process_group=group)
    return engine


def train(group, path: str, sharded: bool = False, save_dir: str = "", storage: torch.dtype = torch.float32) -> dict:
    rank = dist.get_rank(group)
    base = load_base(path, group if sharded else None, storage)
    loaded_bytes = packed_bytes(base)  # right after the load, before initialize
    model = with_lora(base)
    packed = [p for p in model.parameters() if type(p).__name__ == "Params4bit"]
    engine = _engine(model, group)
    losses = []
    for step in range(STEPS):
        loss = _loss(engine, step, rank)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if save_dir:
        engine.save_checkpoint(save_dir, tag="trained")
    with zerodp.GatheredParameters([p for p in model.parameters() if p.requires_grad]):
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    out = {"trained": trained, "losses": losses, "packed": len(packed), "loaded_bytes": loaded_bytes,
           "params_bytes": engine.memory_breakdown()["parameters"],
           "all_bytes": sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())}
    engine.destroy()
    return out


def quantized_base(model) -> dict:
    """Each packed weight of ``model`` (gathered): its codes and its quantization state's tensors."""
    from zerodp.core.packed import packed_states
    packed = {n: p for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}
    with zerodp.GatheredParameters(list(packed.values())):
        codes = {n: p.detach().clone() for n, p in packed.items()}
    return {"codes": codes, "states": {k: v for s in packed_states(model).values() for k, v in s.items()}}


def resume(group, path: str, save_dir: str) -> dict:
    """Load the base plainly, spoil its quantization state (as if quantized otherwise), and load the
    checkpoint into an engine: what the packed base and the adapters are then."""
    model = with_lora(load_base(path))
    for p in model.parameters():
        if type(p).__name__ == "Params4bit":
            p.quant_state.state2.absmax.mul_(2.0)  # the checkpoint's state, not this one, must win
    engine = _engine(model, group)
    engine.load_checkpoint(save_dir, tag="trained")
    out = quantized_base(model)
    with zerodp.GatheredParameters([p for p in model.parameters() if p.requires_grad]):
        out["trained"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    engine.destroy()
    return out

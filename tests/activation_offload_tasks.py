"""Worker tasks for ``test_activation_offload.py``: a small transformers Llama under the Trainer's
kind of gradient checkpointing, with ``activation_checkpointing.cpu_checkpointing`` on and off."""
from __future__ import annotations

import torch
import torch.distributed as dist

import zerodp

SEQ, BATCH, VOCAB, LAYERS = 16, 2, 64, 3


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def train_llama(group, stage: int, checkpointing: bool, offload: bool, copy: bool = False,
                steps: int = 2, enable_after: bool = False) -> dict:
    """``steps`` steps on this rank's samples; the losses, the final parameters and what the offload
    hooks saw. ``enable_after``: gradient checkpointing turned on after ``initialize``."""
    model = _llama()
    if checkpointing and not enable_after:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "activation_checkpointing": {"cpu_checkpointing": offload},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, process_group=group)
    if checkpointing and enable_after:
        engine.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if engine.activation_offload is not None:
        engine.activation_offload.copy_host_tensors = copy
    engine.train()
    g = torch.Generator().manual_seed(5 + dist.get_rank(group))
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    stats = engine.activation_offload.stats if engine.activation_offload is not None else None
    with zerodp.zero.GatheredParameters(list(engine.module.parameters())):
        params = torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])
    engine.destroy()
    return {"losses": losses, "params": params,
            "marked": stats.marked if stats else 0, "offloaded": stats.offloaded if stats else 0,
            "restored": stats.restored if stats else 0, "bytes": stats.offloaded_bytes if stats else 0}

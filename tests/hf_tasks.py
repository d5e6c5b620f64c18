"""Tiny Hugging Face ``transformers`` models trained through zerodp, and their single-process
references (for ``test_hf.py``).

The models are built from configs (no download): a 2-layer GPT-2 whose ``lm_head.weight`` is
tied to ``transformer.wte.weight``, and a 2-layer Llama (rotary position buffers, RMSNorm,
grouped-query attention, untied embeddings). Dropout is off, so a run is deterministic.

A run is described by a picklable dict ``spec`` (defaults in ``DEFAULT_SPEC``):

* ``model``: ``"gpt2"`` or ``"llama"``; ``stage``; ``steps``; ``gas``; ``clip``;
  ``precision``: ``"fp32"`` or ``"bf16"``.
* ``threshold``: ``stage3_param_persistence_threshold``, which decides the stage-3 units
  (see ``zerodp.core.gather.plan_units``). On the GPT-2: ``1`` makes every module with parameters
  of its own a unit (each LayerNorm, Conv1D and the position embedding; ``lm_head`` holds
  only the tied weight, so it stays with the root), ``10_000`` makes each ``GPT2Block`` one
  unit (its 12,704 parameters) and nothing else, ``5_000`` makes each ``GPT2MLP`` a unit
  nested inside the unit ``transformer``.
* ``checkpointing``: ``None``, or activation checkpointing of every decoder layer through the
  model's own switch (``activation_checkpointing_enable``, formerly
  ``gradient_checkpointing_enable``; non-reentrant ``torch.utils.checkpoint``), with
  torch's default early stop of the recomputation (``"early_stop"``) or without it
  (``"full_recompute"``: ``torch.utils.checkpoint.set_checkpoint_early_stop(False)``, where
  the recomputation runs every module of the layer to its end).

``transformers`` is imported inside the functions, so that importing this module (as the
pool's workers do for every task of the suite) needs no ``transformers``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils.checkpoint

import zerodp

VOCAB, SEQ, MICRO = 64, 8, 2

DEFAULT_SPEC = {"model": "gpt2", "stage": 3, "steps": 3, "gas": 2, "clip": 0.5, "threshold": 1,
                "checkpointing": None, "precision": "fp32"}

# A small lr and an eps above torch's default 1e-8 keep fp32 rounding differences from being
# magnified by Adam: see the tolerance note in test_hf.py.
ADAMW = {"lr": 0.003, "betas": (0.9, 0.99), "eps": 1e-5, "weight_decay": 0.1}


def full_spec(**overrides) -> dict:
    unknown = set(overrides) - set(DEFAULT_SPEC)
    if unknown:
        raise KeyError(f"unknown spec keys {sorted(unknown)}")
    return {**DEFAULT_SPEC, **overrides}


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    if name == "gpt2":
        config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0,
                            attn_implementation="sdpa")
        model = GPT2LMHeadModel(config)
        assert model.lm_head.weight is model.transformer.wte.weight, "GPT-2 should tie lm_head to wte"
    elif name == "llama":
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                             max_position_embeddings=32, attention_dropout=0.0,
                             bos_token_id=0, eos_token_id=0, pad_token_id=None,
                             attn_implementation="sdpa")
        model = LlamaForCausalLM(config)
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    else:
        raise ValueError(f"unknown model {name!r}")
    return model.train()


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, the model's own way."""
    model.config.use_cache = False  # incompatible with checkpointing (transformers warns)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def batch(step: int, rank: int, micro: int) -> torch.Tensor:
    """Token ids of one micro-batch: a function of (step, rank, micro) only."""
    g = torch.Generator().manual_seed(10_000 + 1000 * step + 10 * rank + micro)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def make_config(spec: dict, world: int) -> dict:
    return {"train_batch_size": MICRO * spec["gas"] * world, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": spec["clip"], "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {k: list(v) if isinstance(v, tuple) else v
                                                      for k, v in ADAMW.items()}},
            "bf16": {"enabled": spec["precision"] == "bf16"},
            "zero_optimization": {"stage": spec["stage"],
                                  "stage3_param_persistence_threshold": spec["threshold"]}}


def reference(world: int, spec: dict):
    """One process, ``torch.optim.AdamW``, the whole global batch each step (the mean of the
    ``world * gas`` micro-batch losses). Returns the final parameters and the global gradient
    norm (before clipping) of every step."""
    model = build_model(spec["model"])
    params = list(model.parameters())  # the tied weight once
    opt = torch.optim.AdamW(params, **ADAMW)
    norms = []
    for step in range(spec["steps"]):
        opt.zero_grad(set_to_none=True)
        losses = [model(input_ids=x, labels=x).loss
                  for x in (batch(step, r, m) for r in range(world) for m in range(spec["gas"]))]
        (sum(losses) / len(losses)).backward()
        clip = spec["clip"] if spec["clip"] > 0 else float("inf")
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip).item())
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def train_task(group, spec: dict) -> dict:
    """Worker task: the same training through zerodp. Returns the gathered final parameters,
    the per-step global gradient norms, the stage-3 unit names and whether the parameters
    were sharded between steps."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    model = build_model(spec["model"])
    if spec["checkpointing"]:
        enable_checkpointing(model)
    engine, _, _, _ = zerodp.initialize(model=model, config=make_config(spec, world),
                                        process_group=group)
    norms, at_rest, losses = [], [], []
    early_stop = spec["checkpointing"] != "full_recompute"
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        for step in range(spec["steps"]):
            for m in range(spec["gas"]):
                x = batch(step, rank, m)
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            norms.append(engine.get_global_grad_norm())
            at_rest.append(engine.memory_breakdown().get("gathered_parameters", 0))
    params = list(engine.module.parameters())
    with zerodp.GatheredParameters(params):
        final = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"params": final, "norms": norms, "losses": losses, "global_steps": engine.global_steps,
            "units": [u.name for u in engine.sharded.units] if engine.sharded else [], "gathered_at_rest": at_rest}

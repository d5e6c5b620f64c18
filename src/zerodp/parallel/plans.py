"""Which modules of a model are split, and how: the tensor-parallel plan of a model.

A plan comes from, in this order of precedence:

1. the config's ``tensor_parallel.partition_config`` (DeepSpeed's AutoTP rules: regular
   expressions over parameter names, ``"partition_type": "column" | "row" | "skip"``, and
   ``"shape": [k, -1]`` for a weight fused from ``k`` blocks);
2. the model's own plan: ``transformers``' ``tp_plan`` (its ``base_model_tp_plan`` and the output
   layer's), translated into zerodp's splits;
3. a plan zerodp ships for models without one of their own: the example GPT and ``transformers``'
   GPT-2.

After the split, :func:`localize` adjusts what a model's forward computes from whole sizes
(GPT-2's attention splits its fused projection by ``split_size``).
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Optional

from torch import nn

from .tensor import Split, TensorParallelError

#: ``transformers``' plan names -> zerodp's split (None: nothing is split).
HF_STYLES: dict[str, Optional[Split]] = {
    "colwise": Split("column"),
    "colwise_rep": Split("column_gather"),
    "colwise_gather_output": Split("column_gather"),
    "rowwise": Split("row"),
    "rowwise_rep": Split("row", whole_input=True),
    "rowwise_split_input": Split("row", whole_input=True),
    "embedding_rowwise": Split("vocab"),
    "embedding_colwise": Split("column"),
    "packed_colwise": Split("column", blocks=2),
    "sequence_parallel": None,  # norms stay replicated
    "replicate": None,
    "replicated_with_grad_allreduce": Split("head_norm"),  # Qwen3's per-head q and k norms
}

#: The example GPT (``zerodp.examples.gpt``): heads and MLP split, the vocabulary split in the
#: embedding and the tied output layer.
GPT_PLAN = {
    "wte": Split("vocab"),
    "blocks.*.attn.c_attn": Split("column", blocks=3),
    "blocks.*.attn.c_proj": Split("row"),
    "blocks.*.mlp.c_fc": Split("column"),
    "blocks.*.mlp.c_proj": Split("row"),
    "lm_head": Split("column_gather"),
}

#: ``transformers``' GPT-2, which ships no plan (its layers are ``Conv1D``).
GPT2_PLAN = {
    "wte": Split("vocab"),
    "h.*.attn.c_attn": Split("column", blocks=3),
    "h.*.attn.c_proj": Split("row"),
    "h.*.mlp.c_fc": Split("column"),
    "h.*.mlp.c_proj": Split("row"),
}


#: Sequence parallelism in the example GPT: the norms run on sequence slices, the position
#: embedding's output is cut to them (the splits above gather and reduce-scatter around them).
GPT_SEQUENCE_PLAN = {
    "wpe": Split("sequence_positions"),
    "blocks.*.ln_1": Split("sequence_norm"),
    "blocks.*.ln_2": Split("sequence_norm"),
    "ln_f": Split("sequence_norm"),
}


#: Sequence parallelism in ``transformers``' Llama-style decoders (their own plan splits the
#: projections): the token embedding's output is cut to the sequence slices and stays a
#: ``DTensor`` down the residual stream (the model builds its positions and causal mask from the
#: embeddings' shape, which a ``DTensor`` gives whole), the norms run on the slices.
HF_SEQUENCE_PLAN = {
    "embed_tokens": Split("sequence_positions", dtensor_output=True),
    "layers.*.input_layernorm": Split("sequence_norm"),
    "layers.*.post_attention_layernorm": Split("sequence_norm"),
    "norm": Split("sequence_norm"),
}

#: The same for ``transformers``' GPT-2 (its vocabulary split by zerodp's plan): the position
#: embedding's output is cut to the slices as well, and added to the token embedding's there.
GPT2_SEQUENCE_PLAN = {
    "wpe": Split("sequence_positions", dtensor_output=True),
    "h.*.ln_1": Split("sequence_norm"),
    "h.*.ln_2": Split("sequence_norm"),
    "ln_f": Split("sequence_norm"),
}

#: ``transformers`` model types whose sequence zerodp splits, and the plan that names their norms.
HF_SEQUENCE_PLANS = {"llama": HF_SEQUENCE_PLAN, "mistral": HF_SEQUENCE_PLAN, "qwen2": HF_SEQUENCE_PLAN,
                     "qwen3": HF_SEQUENCE_PLAN, "gpt2": GPT2_SEQUENCE_PLAN}


def _prefixed(model: nn.Module, plan: dict[str, Split], prefix: str) -> dict[str, Split]:
    names = {n for n, _ in model.named_modules()}
    if prefix and not any(n.startswith(prefix + ".") for n in names):
        prefix = ""
    return {(f"{prefix}.{k}" if prefix else k): v for k, v in plan.items()}


def _hf_plan(model: nn.Module) -> Optional[dict[str, Split]]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "base_model_prefix"):
        return None
    raw = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    prefix = model.base_model_prefix
    if not raw and getattr(config, "base_model_tp_plan", None):
        raw = {f"{prefix}.{k}": v for k, v in config.base_model_tp_plan.items()}
    if not raw:
        if getattr(config, "model_type", None) == "gpt2":
            plan = _prefixed(model, GPT2_PLAN, prefix)
            if hasattr(model, "lm_head"):
                plan["lm_head"] = Split("column_gather")
            return plan
        return None
    plan = {}
    for pattern, style in raw.items():
        if style not in HF_STYLES:
            raise TensorParallelError(
                f"tensor_parallel: the model's plan splits {pattern!r} as {style!r}, which zerodp does not "
                f"implement (it implements {', '.join(sorted(HF_STYLES))}); give a partition_config instead")
        if HF_STYLES[style] is not None:
            plan[pattern] = HF_STYLES[style]
    names = {n for n, _ in model.named_modules()}
    if "lm_head" in names and "lm_head" not in plan and any(k.endswith("embed_tokens") for k in plan):
        plan["lm_head"] = Split("column_gather")
    return {k: v for k, v in plan.items() if "*" in k or k in names}


def _from_partition_config(model: nn.Module, partition_config: dict) -> dict[str, Split]:
    """DeepSpeed's ``partition_config`` (``layer_specs`` of ``patterns`` over parameter names)."""
    specs = partition_config.get("layer_specs") or []
    if not specs:
        raise TensorParallelError("tensor_parallel.partition_config: layer_specs is empty")
    modules = dict(model.named_modules())
    plan: dict[str, Split] = {}
    for i, spec in enumerate(specs):
        key = f"tensor_parallel.partition_config.layer_specs[{i}]"
        kind = spec.get("partition_type")
        if kind not in ("column", "row", "skip"):
            raise TensorParallelError(f"{key}.partition_type: got {kind!r}; allowed: column, row, skip")
        shape = spec.get("shape")
        blocks = 1
        if shape is not None:
            if spec.get("partition_dim", 0) != 0 or len(shape) != 2 or shape[1] != -1:
                raise TensorParallelError(f"{key}.shape: zerodp splits fused weights given as [blocks, -1] on "
                                          f"partition_dim 0; got shape {shape}")
            blocks = int(shape[0])
        rxs = [re.compile(p) for p in spec.get("patterns") or []]
        if not rxs:
            raise TensorParallelError(f"{key}.patterns: empty")
        hits = 0
        for pname, _ in model.named_parameters():
            if not any(rx.search(pname) for rx in rxs):
                continue
            mname = pname.rsplit(".", 1)[0]
            hits += 1
            if kind == "skip":
                plan.pop(mname, None)
                continue
            mod = modules[mname]
            if isinstance(mod, nn.Embedding):
                plan[mname] = Split("vocab" if kind == "row" else "column")
            else:
                plan[mname] = Split(kind, blocks=blocks)
        if not hits:
            raise TensorParallelError(f"{key}.patterns: {spec['patterns']} match no parameter of the model")
    return plan


def _is_example_gpt(model: nn.Module) -> bool:
    """The example GPT (``examples/gpt.py``, under any module name), known by its shape: the library
    does not import the examples."""
    return type(model).__name__ == "GPT" and all(
        hasattr(model, a) for a in ("wte", "wpe", "blocks", "ln_f", "lm_head"))


def plan_for(model: nn.Module, partition_config: Optional[dict] = None) -> dict[str, Split]:
    """The tensor-parallel plan of ``model`` (see the module docstring), with patterns."""
    if partition_config:
        return _from_partition_config(model, partition_config)
    if _is_example_gpt(model):
        return dict(GPT_PLAN)
    plan = _hf_plan(model)
    if plan:
        return plan
    raise TensorParallelError(
        f"tensor_parallel: zerodp has no plan for {type(model).__name__}: it splits the example GPT and "
        "transformers models (their own tp_plan, or GPT-2's); for another model give "
        '"tensor_parallel": {"partition_config": {"layer_specs": [{"patterns": [...], "partition_type": '
        '"column" | "row"}]}} in the config')


def with_loss_parallel(plan: dict[str, Split]) -> dict[str, Split]:
    """``plan`` with its gathered output layer (``column_gather``) keeping its logits split over the
    vocabulary (``loss_output``), for torch's loss-parallel cross entropy."""
    out = {k: (replace(v, kind="loss_output") if v.kind == "column_gather" else v) for k, v in plan.items()}
    if out == plan:
        raise TensorParallelError(
            "tensor_parallel.loss_parallel: the model's plan has no output layer whose logits are gathered "
            f"('column_gather'; the plan: {describe(plan)}), so there are no split logits for the loss")
    return out


def with_sequence_parallel(model: nn.Module, plan: dict[str, Split], partition_config: Optional[dict]) -> dict:
    """``plan`` with the activations between the split layers split along the sequence: the
    example GPT, and ``transformers``' GPT-2, Llama, Mistral, Qwen2 and Qwen3 under their plans."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    hf = not _is_example_gpt(model) and model_type in HF_SEQUENCE_PLANS
    if partition_config or not (_is_example_gpt(model) or hf):
        raise TensorParallelError(
            "tensor_parallel.sequence_parallel: zerodp splits the sequence of the example GPT and of transformers' "
            f"{', '.join(HF_SEQUENCE_PLANS)} models under their plans; {type(model).__name__}"
            + (" with a partition_config" if partition_config else "")
            + " keeps its activations whole on every tensor-parallel rank (leave sequence_parallel off)")
    # a transformers model's residual stream stays a DTensor: what is added into it is one too
    out = {k: replace(v, sequence=True, dtensor_output=hf and v.kind in ("row", "vocab")) for k, v in plan.items()}
    if hf:
        names = {n for n, _ in model.named_modules()}
        extra = _prefixed(model, HF_SEQUENCE_PLANS[model_type], model.base_model_prefix)
        out.update({k: v for k, v in extra.items() if "*" in k or k in names})
    else:
        out.update(GPT_SEQUENCE_PLAN)
    return out


def check_heads(model: nn.Module, tp: int) -> None:
    """Refuse, naming the first attention layer, attention heads that do not split over ``tp``."""
    if _is_example_gpt(model):
        for name, mod in model.named_modules():
            if type(mod).__name__ == "CausalSelfAttention" and mod.n_head % tp:
                raise TensorParallelError(f"{name}: {mod.n_head} attention heads do not split over {tp} "
                                          "tensor-parallel ranks; choose a tensor-parallel size that divides them")
        return
    config = getattr(model, "config", None)
    if config is None:
        return
    heads = {"attention heads": getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None),
             "key/value heads": getattr(config, "num_key_value_heads", None)}
    attn = next((n for n, m in model.named_modules() if type(m).__name__.endswith("Attention")), "attention")
    for what, n in heads.items():
        if isinstance(n, int) and n % tp:
            raise TensorParallelError(f"{attn}: {n} {what} do not split over {tp} tensor-parallel ranks; choose a "
                                      "tensor-parallel size that divides them")


def localize(model: nn.Module, tp: int) -> None:
    """What a model's forward computes from whole sizes, made this rank's (after the split)."""
    for mod in model.modules():
        if type(mod).__name__ == "GPT2Attention" and hasattr(mod, "split_size"):
            mod.split_size = mod.split_size // tp


def describe(plan: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v.kind}" + (f"/{v.blocks}" if v.blocks > 1 else "") for k, v in plan.items())

"""One pipeline stage of a ``transformers`` decoder-only model, for ``zerodp simulate --pp P``.

torch's pipeline stages agree on their tensors' shapes through object messages at the first step,
which a fake process group cannot deliver, so a rank of a P-stage pipeline is simulated as what
its ZeRO side sees: the layers of its stage (split by parameter counts, as
``PipelineModule(partition_method="parameters")`` splits them) as a one-stage
``PipelineModule`` over its stage's data x tensor grid (world / P ranks). The engine then does
what it does inside a pipeline: gathers the stage's parameters once for the whole step (stage
3), accumulates the micro-batches' gradients locally and reduces them once, and updates. What
differs: its micro-batches run one after another (a 1F1B schedule keeps up to P - s of them in
flight on stage s: more activations, which at the simulation's tiny batch are small), a stage
after the first starts from zero hidden states, a stage before the last ends in the mean of its
outputs instead of the gradient the next stage would send, and the point-to-point bytes are not
counted (:func:`p2p_bytes` computes them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...estimator import EstimateError
from .build import ModelSpec

__all__ = ["TP_PARTITION", "tp_partition", "decoder_layers", "stage_bounds", "stage_module", "stage_batch",
           "p2p_bytes"]

#: The tensor-parallel split of the layers of :func:`decoder_layers` (``tensor_parallel.partition_config``
#: over parameter names), as the model's own plan splits it: attention heads and the MLP, the vocabulary
#: of the embedding (row: an embedding's rows) and of the output layer (its logits stay split here).
TP_PARTITION = {"layer_specs": [
    {"patterns": [r"\.self_attn\.(q|k|v)_proj\.weight$", r"\.mlp\.(gate|up)_proj\.weight$",
                  r"\.lm_head\.weight$"], "partition_type": "column"},
    {"patterns": [r"\.self_attn\.o_proj\.weight$", r"\.mlp\.down_proj\.weight$",
                  r"\.embed_tokens\.weight$"], "partition_type": "row"}]}


def tp_partition(model: nn.Module) -> dict:
    """:data:`TP_PARTITION` cut to the patterns that name a parameter of ``model`` (one stage's
    layers; a pattern that names none is an error to ``partition_config``)."""
    import re
    names = [n for n, _ in model.named_parameters()]
    specs = []
    for spec in TP_PARTITION["layer_specs"]:
        hits = [p for p in spec["patterns"] if any(re.search(p, n) for n in names)]
        if hits:
            specs.append({**spec, "patterns": hits})
    return {"layer_specs": specs}


class Embed(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)


class Decoder(nn.Module):
    """One decoder layer with its own rotary embedding (a buffer of a few hundred values)."""

    def __init__(self, layer_cls: type, rotary_cls: type, config, index: int) -> None:
        super().__init__()
        self.layer = layer_cls(config, index)
        self.rotary = rotary_cls(config=config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)[None]
        out = self.layer(x, position_embeddings=self.rotary(x, pos), position_ids=pos, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    def __init__(self, norm_cls: type, config) -> None:
        super().__init__()
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def stand_in_loss(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A stage before the last: its backward starts from the mean of its outputs."""
    return hidden.float().mean()


def decoder_layers(spec: ModelSpec, tp: int = 1) -> list:
    """``LayerSpec`` s of a decoder-only causal LM (``model.layers``, ``model.rotary_emb``,
    ``model.norm``, ``lm_head``; Llama, Mistral, Qwen2): the embedding, each decoder layer, the
    final norm with the output layer. Its attention heads must split over ``tp`` ranks."""
    from ...pipe import LayerSpec
    if spec.is_factory:
        raise EstimateError("pp", "pipeline stages are simulated for a transformers config of a decoder-only "
                                  "model (Llama, Mistral, Qwen2), not for a factory")
    config = spec.hf_config()
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        probe = AutoModelForCausalLM.from_config(config)
    inner = getattr(probe, "model", None)
    if inner is None or not all(hasattr(inner, n) for n in ("layers", "rotary_emb", "norm")) \
            or not hasattr(probe, "lm_head"):
        raise EstimateError("pp", f"{type(probe).__name__} is not a decoder with model.layers, model.rotary_emb, "
                                  "model.norm and lm_head")
    if getattr(config, "tie_word_embeddings", False):
        raise EstimateError("pp", "a model whose output layer is its input embedding (tie_word_embeddings) is "
                                  "not split into pipeline stages here")
    from ...parallel.plans import check_heads
    check_heads(probe, tp)  # (the stage's layers carry no config to check later)
    layer_cls, rotary_cls, norm_cls = type(inner.layers[0]), type(inner.rotary_emb), type(inner.norm)
    return [LayerSpec(Embed, config),
            *[LayerSpec(Decoder, layer_cls, rotary_cls, config, i) for i in range(len(inner.layers))],
            LayerSpec(Head, norm_cls, config)]


def stage_bounds(layers: list, pp: int) -> list[int]:
    """Where each of ``pp`` stages starts, by parameter counts (as ``PipelineModule`` splits)."""
    from ...pipe.module import partition_balanced
    if len(layers) < pp:
        raise EstimateError("pp", f"{len(layers)} layers cannot fill {pp} pipeline stages")
    counts = []
    for spec in layers:
        with torch.device("meta"):
            counts.append(float(sum(p.numel() for p in spec.build().parameters())))
    return partition_balanced(counts, pp)


def stage_module(layers: list, bounds: list[int], stage: int, pp: int) -> nn.Module:
    """Stage ``stage``'s layers as a one-stage ``PipelineModule`` (built inside the caller's context)."""
    from ...pipe import PipelineModule
    last = stage == pp - 1
    return PipelineModule(layers[bounds[stage]:bounds[stage + 1]], num_stages=1,
                          loss_fn=lm_loss if last else stand_in_loss)


def stage_batch(spec: ModelSpec, stage: int, micro_batch: int, seq: int, dtype: torch.dtype,
                device: torch.device) -> tuple:
    """The (inputs, labels) of one micro-batch on ``stage``: token ids on the first, zero hidden
    states (which need a gradient, as a received activation does) on the others; labels 0."""
    config = spec.hf_config()
    ids = torch.randint(0, config.vocab_size, (micro_batch, seq), device=device)
    labels = torch.zeros_like(ids)  # in every vocabulary slice (the logits stay split over tensor ranks)
    if stage == 0:
        return ids, labels
    hidden = torch.zeros(micro_batch, seq, config.hidden_size, dtype=dtype, device=device, requires_grad=True)
    return hidden, labels


def p2p_bytes(spec: ModelSpec, stage: int, pp: int, micro_batches: int, micro_batch: int, seq: int,
              element_size: int) -> int:
    """Bytes ``stage`` sends per step: each micro-batch's activations forward (not from the last
    stage) and their gradients back (not from the first)."""
    one = micro_batch * seq * spec.hf_config().hidden_size * element_size
    return micro_batches * one * ((stage < pp - 1) + (stage > 0))

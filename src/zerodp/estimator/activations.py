"""Activation memory of one micro-batch on one rank, for known transformer shapes
(Korthikanti et al.), or the reason it is not estimated."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .accounting import FP32, PRECISIONS
from .inputs import EstimateError
from .model import ModelInfo, TransformerShape


@dataclass(frozen=True)
class Activations:
    """Activation memory of one micro-batch on one rank (``bytes`` None: not estimated)."""

    bytes: Optional[int]
    micro_batch: Optional[int] = None
    seq_len: Optional[int] = None
    checkpointing: bool = False
    per_layer: Optional[int] = None
    logits: Optional[int] = None
    formula: str = ""
    note: str = ""


ACTIVATION_FORMULA = (
    "Korthikanti et al. (2022): per layer s·b·h·(34 + 5·a·s/h) bytes in 16-bit, written "
    "s·b·(18·h + 4·f) + 5·a·s²·b for MLP width f (f = 4h gives 34); x2 in fp32; plus logits "
    "s·b·V·(p + 4) (logits and their fp32 copy for the loss)")
ACTIVATION_ASSUMPTIONS = (
    "assumes no tensor or sequence parallelism and a GPT-style MLP; counts the a·s² attention "
    "scores, which fused attention (scaled_dot_product_attention, flash) never stores, so it is "
    "an upper bound for such models")


def layer_activation_bytes(shape: TransformerShape, micro_batch: int, seq_len: int, p: int,
                           fused_attention: bool = False) -> int:
    """One layer's activations kept for backward (Korthikanti et al.), in ``p``-byte precision;
    ``fused_attention``: without the ``5·a·s²·b`` of attention scores, softmax and its dropout
    mask, which fused kernels (flash, ``scaled_dot_product_attention``) recompute instead."""
    b, s = micro_batch, seq_len
    # attention 11·s·b·h + 5·a·s²·b, two LayerNorms 4·s·b·h, MLP s·b·(3·h + 4·f)
    scores = 0 if fused_attention else 5 * shape.heads * s * s * b
    sixteen_bit = s * b * (18 * shape.hidden + 4 * shape.ffn) + scores
    return sixteen_bit * p // 2


def estimate_activations(model: ModelInfo, precision: str, micro_batch: Optional[int],
                         seq_len: Optional[int], checkpointing: bool, fused_attention: bool = False,
                         pp: int = 1, virtual_stages: int = 1) -> Activations:
    """Activations for a known transformer; for other models a reason why not. A pipeline's first
    stage holds ``pp`` micro-batches of its ``L / pp`` layers under 1F1B, the whole model's layers'
    worth for one micro-batch (what is counted); the interleaved schedule with ``v`` chunks holds
    ``1 + (pp - 1) / (pp v)`` times that (Korthikanti et al. 2022)."""
    shape = model.transformer
    if shape is None:
        why = ("a bare parameter count has no layer shapes" if model.source == "count" else
               "the model has no transformer config (layers, hidden size, heads, vocabulary)")
        return Activations(None, micro_batch, seq_len, checkpointing,
                           note=f"not estimated: {why}")
    b = micro_batch or 1
    s = seq_len or shape.context
    if s is None:
        raise EstimateError("seq_len", "the model config gives no context length; give one")
    p = PRECISIONS[precision]
    layer = layer_activation_bytes(shape, b, s, p, fused_attention)
    logits = s * b * shape.vocab * (p + FP32)
    if checkpointing:
        kept = shape.layers * s * b * shape.hidden * p + layer
        how = "with activation checkpointing: each layer's input (s·b·h·p) plus one layer recomputed"
    else:
        kept = shape.layers * layer
        how = "no activation checkpointing"
    if virtual_stages > 1:
        kept = int(kept * (1 + (pp - 1) / (pp * virtual_stages)))
        how += f"; the interleaved schedule's first stage, {virtual_stages} chunks: x(1 + (pp-1)/(pp·v))"
    where = []
    if micro_batch is None:
        where.append("micro-batch 1 (default)")
    if seq_len is None:
        where.append(f"sequence {s} (the model's context length)")
    assumptions = (ACTIVATION_ASSUMPTIONS.split("; counts")[0] + "; fused attention: no a·s² scores stored"
                   if fused_attention else ACTIVATION_ASSUMPTIONS)
    note = f"{how}; {assumptions}" + (f"; {', '.join(where)}" if where else "")
    return Activations(kept + logits, b, s, checkpointing, layer, logits, ACTIVATION_FORMULA, note)

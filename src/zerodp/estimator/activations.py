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
    sp: int = 1
    """Sequence-parallel size: each rank holds ``seq_len / sp`` tokens (Ulysses)."""
    tiled: bool = False
    """ALST's tiled MLP and tiled logits-and-loss."""
    host: int = 0
    """Checkpointed layers' inputs kept in host memory (``cpu_checkpointing``), not on the device."""


ACTIVATION_FORMULA = (
    "Korthikanti et al. (2022): per layer s·b·h·(34 + 5·a·s/h) bytes in 16-bit, written "
    "s·b·(18·h + 4·f) + 5·a·s²·b for MLP width f (f = 4h gives 34); x2 in fp32; plus logits "
    "s·b·V·(p + 4) (logits and their fp32 copy for the loss)")
ACTIVATION_ASSUMPTIONS = (
    "assumes no tensor parallelism and a GPT-style MLP; counts the a·s² attention "
    "scores, which fused attention (scaled_dot_product_attention, flash) never stores, so it is "
    "an upper bound for such models")


#: The logits one tile of the tiled loss holds at most (logits and their fp32 copy), as ALST sizes them.
LOSS_TILE_BYTES = 1 << 30


def tile_tokens(shape: TransformerShape, tokens: int) -> int:
    """Tokens per tile of the tiled MLP and loss: ``tokens`` in ``ceil(tokens / h)`` tiles, as
    DeepSpeed's ALST recipe cuts them (about ``h`` tokens each)."""
    tiles = max(1, -(-tokens // shape.hidden))
    return -(-tokens // tiles)


def layer_activation_bytes(shape: TransformerShape, micro_batch: int, seq_len: int, p: int,
                           fused_attention: bool = False, sp: int = 1, tiled: bool = False) -> int:
    """One layer's activations kept for backward (Korthikanti et al.), in ``p``-byte precision;
    ``fused_attention``: without the ``5·a·s²·b`` of attention scores, softmax and its dropout
    mask, which fused kernels (flash, ``scaled_dot_product_attention``) recompute instead.
    ``sp``: Ulysses sequence parallelism, each rank holds ``s / sp`` tokens of every activation
    but attention's, which holds ``a / sp`` heads over the whole sequence (the same element count
    for the linear terms; the scores are ``5·(a/sp)·s²·b``). ``tiled``: the MLP keeps its input
    (``2·s·b·h``) and one tile's intermediates instead of ``s·b·(3·h + 4·f)``."""
    b, s = micro_batch, seq_len
    local = -(-s // sp)
    # attention 11·s·b·h + 5·a·s²·b, two LayerNorms 4·s·b·h, MLP s·b·(3·h + 4·f)
    scores = 0 if fused_attention else 5 * (shape.heads // sp) * s * s * b
    mlp = local * b * (3 * shape.hidden + 4 * shape.ffn)
    if tiled:
        mlp = local * b * 2 * shape.hidden + tile_tokens(shape, local) * b * (shape.hidden + 4 * shape.ffn)
    sixteen_bit = local * b * 15 * shape.hidden + mlp + scores
    return sixteen_bit * p // 2


def estimate_activations(model: ModelInfo, precision: str, micro_batch: Optional[int],
                         seq_len: Optional[int], checkpointing: bool, fused_attention: bool = False,
                         pp: int = 1, virtual_stages: int = 1, sp: int = 1, tiled: bool = False,
                         offload: bool = False) -> Activations:
    """Activations for a known transformer; for other models a reason why not. A pipeline's first
    stage holds ``pp`` micro-batches of its ``L / pp`` layers under 1F1B, the whole model's layers'
    worth for one micro-batch (what is counted); the interleaved schedule with ``v`` chunks holds
    ``1 + (pp - 1) / (pp v)`` times that (Korthikanti et al. 2022). ``sp``: each rank's ``s / sp``
    tokens (see :func:`layer_activation_bytes`); ``tiled``: the tiled MLP and the tiled loss (the
    logits of one tile, not of the sequence); ``offload`` (with ``checkpointing``): the layers'
    inputs in host memory (``cpu_checkpointing``), two of them on the device at a time."""
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
    if offload and not checkpointing:
        raise EstimateError("offload_activations", "moves checkpointed layers' inputs: add checkpointing")
    p = PRECISIONS[precision]
    local = -(-s // sp)
    layer = layer_activation_bytes(shape, b, s, p, fused_attention, sp, tiled)
    logits = local * b * shape.vocab * (p + FP32)
    if tiled:  # the hidden states the loss keeps, and one tile's logits (at most 1 GiB) at a time
        per_token = b * shape.vocab * (p + FP32)
        logits = local * b * shape.hidden * p + min(local, max(1, LOSS_TILE_BYTES // per_token)) * per_token
    host = 0
    inputs = local * b * shape.hidden * p  # one layer's input
    if checkpointing and offload:
        kept, host = 2 * inputs + layer, shape.layers * inputs
        how = ("with activation checkpointing, the layers' inputs in host memory: two inputs on the device "
               "(one in flight) plus one layer recomputed")
    elif checkpointing:
        kept = shape.layers * inputs + layer
        how = "with activation checkpointing: each layer's input (s·b·h·p) plus one layer recomputed"
    else:
        kept = shape.layers * layer
        how = "no activation checkpointing"
    if sp > 1:
        how += (f"; Ulysses sequence parallelism over {sp} ranks: {local} of the {s} tokens per rank, "
                f"attention over all {s} for {shape.heads // sp} of the {shape.heads} heads")
    if tiled:
        how += (f"; tiled MLP (tiles of {tile_tokens(shape, local)} tokens, it keeps its input) and loss (the "
                "logits of one tile of at most 1 GiB)")
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
    return Activations(kept + logits, b, s, checkpointing, layer, logits, ACTIVATION_FORMULA, note, sp, tiled, host)


def longest_sequence(model: ModelInfo, precision: str, micro_batch: Optional[int], budget: int,
                     checkpointing: bool, fused_attention: bool = False, sp: int = 1, tiled: bool = False,
                     offload: bool = False, limit: int = 1 << 27) -> Optional[int]:
    """The longest sequence (a multiple of ``sp``) whose activations take at most ``budget`` bytes
    per rank, up to ``limit`` tokens; None when not even ``sp`` tokens fit or the shapes are unknown."""
    if model.transformer is None or budget <= 0:
        return None

    def fits(k: int) -> bool:
        acts = estimate_activations(model, precision, micro_batch, k * sp, checkpointing, fused_attention,
                                    sp=sp, tiled=tiled, offload=offload)
        return acts.bytes is not None and acts.bytes <= budget

    lo, hi = 0, limit // sp
    while lo < hi:  # activations grow with the sequence: the last k that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * sp if lo else None

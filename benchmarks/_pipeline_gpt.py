"""The example GPT as a pipeline of layers, for ``peers.py``'s pipeline systems: the same layer
list for zerodp's and DeepSpeed's ``PipelineModule`` (the two take the same ``LayerSpec`` /
``TiedLayerSpec`` API), over the modules of a GPT built as the other systems build it, so every
system starts from the same values.

Layers: the embeddings (token and position; a ``TiedLayerSpec`` whose token weight is also the
output layer's), one layer per block, the final norm, and the output layer (the tied embeddings'
weight, ``forward_fn``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embeddings(nn.Module):
    """The GPT's token and position embeddings (its own modules)."""

    def __init__(self, gpt) -> None:
        super().__init__()
        self.wte, self.wpe = gpt.wte, gpt.wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class Same(nn.Module):
    """A module built beforehand (a GPT block), as a layer a ``LayerSpec`` builds."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.inner = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def logits(embeddings: Embeddings, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, embeddings.wte.weight)


def layers(pipe, gpt) -> list:
    """``gpt`` as a list of layers for ``pipe.PipelineModule`` (``pipe``: ``zerodp.pipe`` or
    ``deepspeed.pipe``)."""
    return [pipe.TiedLayerSpec("embed", Embeddings, gpt, tied_weight_attr=["wte.weight"]),
            *[pipe.LayerSpec(Same, block) for block in gpt.blocks],
            pipe.LayerSpec(Same, gpt.ln_f),
            pipe.TiedLayerSpec("embed", Embeddings, gpt, forward_fn=logits, tied_weight_attr=["wte.weight"])]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


#: The tensor-parallel split of the blocks (``partition_config`` over the layers' parameter names).
TP_PARTITION = {"layer_specs": [
    {"patterns": [r"\.attn\.c_attn\.weight$"], "partition_type": "column", "shape": [3, -1], "partition_dim": 0},
    {"patterns": [r"\.attn\.c_proj\.weight$", r"\.mlp\.c_proj\.weight$"], "partition_type": "row"},
    {"patterns": [r"\.mlp\.c_fc\.weight$"], "partition_type": "column"}]}

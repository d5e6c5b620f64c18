"""ALST's memory savers for long sequences: compute over tiles of the sequence, keep only the input,
recompute each tile in backward (DeepSpeed's ``TiledMLP``, ``SequenceTiledCompute`` /
``sequence_tiled_compute`` and ``TiledFusedLogitsLoss``, ``runtime.sequence_parallel.ulysses_sp``).

An MLP's intermediate activations (``[tokens, 4 x hidden]`` and more) and the logits of a loss
(``[tokens, vocabulary]``) are what long sequences run out of memory on. Here the forward runs tile
by tile without keeping a graph, and the backward runs each tile's forward again and its backward,
so at most one tile's activations exist at a time.

Unlike DeepSpeed's, the parameters the computation uses (``compute_params``) are inputs of the
autograd function here: each tile's parameter gradients are summed in backward and handed to
autograd once, so the engine's gradient hooks fire once per parameter, whatever the number of tiles
(DeepSpeed marks the parameters ``ds_grad_is_ready`` instead); the loss's parameter gradients are
scaled by the gradient that reaches it (DeepSpeed's ``TiledFusedLogitsLoss`` computes them in
forward, unscaled by gradient accumulation or the fp16 loss scale). At stage 3 the parameters are
gathered while the function is applied (autograd records their whole shapes) and by their modules'
own hooks when a tile is recomputed in backward.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..core.param_api import GatheredParameters


def _trained(params: Optional[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    return [p for p in (params or []) if p.requires_grad]


def _tile_grads(out: torch.Tensor, inputs: list[torch.Tensor], grad_out: Any) -> list[Optional[torch.Tensor]]:
    return list(torch.autograd.grad(out, inputs, grad_out, allow_unused=True))


class TiledMLP:
    """DeepSpeed's ``TiledMLP.apply(fn, self, x, shards, compute_params)``: ``fn(self, x_tile)`` over
    ``shards`` tiles of ``x`` along its sequence dimension (``-2``), recomputed tile by tile in
    backward. ``compute_params``: the parameters ``fn`` uses (their gradients come out summed)."""

    @staticmethod
    def apply(fn: Callable, module: Any, x: torch.Tensor, shards: int,
              compute_params: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
        params = _trained(compute_params)
        with GatheredParameters(params):  # stage 3: autograd records the parameters' whole shapes
            return _TiledMLP.apply(fn, module, x, shards, *params)


class _TiledMLP(torch.autograd.Function):
    """``fn`` over tiles of ``x``, the parameters as inputs (so autograd accumulates their gradients once)."""

    @staticmethod
    def forward(ctx, fn, module, x, shards, *params):
        ctx.fn, ctx.module, ctx.shards = fn, module, max(1, int(shards))
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return torch.cat([fn(module, tile) for tile in torch.chunk(x, ctx.shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        x, *params = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        x_grad = torch.zeros_like(x) if want_x else None
        param_grads: list[Optional[torch.Tensor]] = [None] * len(params)
        x_tiles = torch.chunk(x, ctx.shards, dim=-2)
        for n, (tile, tile_grad) in enumerate(zip(x_tiles, torch.chunk(grad, ctx.shards, dim=-2))):
            tile = tile.detach().requires_grad_(want_x)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, tile)
            got = _tile_grads(out, ([tile] if want_x else []) + params, tile_grad)
            if want_x:
                lo = sum(t.shape[-2] for t in x_tiles[:n])
                x_grad.narrow(-2, lo, tile.shape[-2]).copy_(got.pop(0))
            for i, g in enumerate(got):
                if g is not None:
                    param_grads[i] = g if param_grads[i] is None else param_grads[i] + g
        return (None, None, x_grad, None, *param_grads)


class _TiledLoss(torch.autograd.Function):
    """A scalar ``fn(module, x_tile, y_tile[, mask_tile])`` per tile of ``[tokens, ...]``-flattened
    ``x`` and ``y``, reduced by mean (of the tiles' values) or sum; recomputed tile by tile in backward."""

    @staticmethod
    def forward(ctx, fn, module, x, y, mask, shards, reduction, *params):
        ctx.fn, ctx.module, ctx.reduction = fn, module, reduction
        ctx.shards = max(1, int(shards))
        ctx.shape = x.shape
        ctx.has_mask = mask is not None
        ctx.save_for_backward(x, y, *([mask] if mask is not None else []), *params)
        with torch.no_grad():
            values = [fn(module, *tile) for tile in _loss_tiles(x, y, mask, ctx.shards)]
            total = torch.stack([v.reshape(()) for v in values]).sum()
            return total / len(values) if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad):
        saved = list(ctx.saved_tensors)
        x, y = saved[0], saved[1]
        mask = saved[2] if ctx.has_mask else None
        params = saved[3:] if ctx.has_mask else saved[2:]
        want_x = ctx.needs_input_grad[2]
        tiles = list(_loss_tiles(x, y, mask, ctx.shards))
        scale = grad / len(tiles) if ctx.reduction == "mean" else grad
        flat_x_grad = torch.zeros(x.shape[0] * x.shape[1] if x.dim() > 2 else x.shape[0], *x.shape[2:],
                                  dtype=x.dtype, device=x.device) if want_x else None
        param_grads: list[Optional[torch.Tensor]] = [None] * len(params)
        at = 0
        for tile in tiles:
            x_tile = tile[0].detach().requires_grad_(want_x)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, x_tile, *tile[1:])
            got = _tile_grads(out, ([x_tile] if want_x else []) + list(params), scale)
            if want_x:
                g = got.pop(0)
                flat_x_grad[at:at + g.shape[0]].copy_(g)
                at += g.shape[0]
            for i, g in enumerate(got):
                if g is not None:
                    param_grads[i] = g if param_grads[i] is None else param_grads[i] + g
        x_grad = flat_x_grad.view(ctx.shape) if want_x else None
        return (None, None, x_grad, None, None, None, None, *param_grads)


def _loss_tiles(x: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor], shards: int):
    """Tiles of ``x`` and ``y`` (and ``mask``) over their flattened ``[batch * sequence]`` tokens."""
    flat_x = x.reshape(-1, *x.shape[2:]) if x.dim() > 2 else x
    flat_y = y.reshape(-1, *y.shape[2:]) if y.dim() > 1 and y.shape[:2] == x.shape[:2] else y
    xs, ys = torch.chunk(flat_x, shards, dim=0), torch.chunk(flat_y, shards, dim=0)
    ms = torch.chunk(mask.reshape(-1), shards, dim=0) if mask is not None else [None] * len(xs)
    for a, b, m in zip(xs, ys, ms):
        yield (a, b) if m is None else (a, b, m)


class TiledFusedLogitsLoss:
    """DeepSpeed's ``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params,
    output_reduction)``: ``fn(self, x_tile, y_tile[, mask_tile])`` (the logits of a tile and their
    loss, a scalar) over ``shards`` tiles of the ``[batch, sequence]`` tokens, so the whole
    sequence's logits never exist; ``output_reduction`` ``"mean"`` (of the tiles' values) or ``"sum"``."""

    @staticmethod
    def apply(fn: Callable, module: Any, x: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor],
              shards: int, compute_params: Optional[Sequence[torch.Tensor]] = None,
              output_reduction: str = "mean") -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError("TiledFusedLogitsLoss: output_reduction must be 'mean' or 'sum', "
                             f"not {output_reduction!r}")
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(f"TiledFusedLogitsLoss: x {tuple(x.shape)} and y {tuple(y.shape)} must share their "
                             "[batch, sequence] dimensions")
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"TiledFusedLogitsLoss: mask {tuple(mask.shape)} is not [batch, sequence] "
                             f"{tuple(x.shape[:2])}")
        params = _trained(compute_params)
        with GatheredParameters(params):  # stage 3: autograd records the parameters' whole shapes
            return _TiledLoss.apply(fn, module, x, y, mask, shards, output_reduction, *params)

"""ALST's memory savers for long sequences: compute over tiles of the sequence, keep only the input,
recompute each tile in backward (DeepSpeed's ``TiledMLP``, ``SequenceTiledCompute`` /
``sequence_tiled_compute`` (any function of ``[batch, sequence, ...]`` inputs) and
``TiledFusedLogitsLoss``, ``runtime.sequence_parallel.ulysses_sp``).

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
    if not inputs or not out.requires_grad:
        return [None] * len(inputs)
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


def sequence_tiled_compute(fn: Callable, seqlen: int, shards: int, kwargs_to_shard: dict, kwargs_to_pass: dict,
                           grad_requiring_tensor_key: str, compute_params: Optional[Sequence[torch.Tensor]] = None,
                           output_unshard_dimension: int = 1, output_reduction: Optional[str] = "mean") -> torch.Tensor:
    """DeepSpeed's ``sequence_tiled_compute``: ``fn(**tile_kwargs, **kwargs_to_pass)`` over ``shards``
    tiles of ``seqlen`` (each ``kwargs_to_shard`` value is ``[batch, seqlen, ...]``, cut along
    dimension 1 in steps of ``ceil(seqlen / shards)``), recomputed tile by tile in backward. The
    outputs are concatenated along ``output_unshard_dimension`` (0: each tile's output is a scalar,
    stacked), then reduced by ``output_reduction`` (``None``, ``"mean"`` or ``"sum"``). Gradients
    reach ``kwargs_to_shard[grad_requiring_tensor_key]`` and ``compute_params`` (summed over tiles)."""
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())


class SequenceTiledCompute:
    """DeepSpeed's ``SequenceTiledCompute.apply(fn, seqlen, shards, keys_to_shard, keys_to_pass,
    grad_requiring_tensor_key, compute_params, output_unshard_dimension, output_reduction, *args)``,
    ``args`` the values of ``keys_to_shard`` then ``keys_to_pass``; see :func:`sequence_tiled_compute`."""

    @staticmethod
    def apply(fn: Callable, seqlen: int, shards: int, keys_to_shard: Sequence[str], keys_to_pass: Sequence[str],
              grad_requiring_tensor_key: str, compute_params: Optional[Sequence[torch.Tensor]],
              output_unshard_dimension: int, output_reduction: Optional[str], *args: Any) -> torch.Tensor:
        if output_reduction not in (None, "mean", "sum"):
            raise ValueError(f"sequence_tiled_compute: unknown output_reduction {output_reduction!r}: valid "
                             "values are None, 'mean' and 'sum'")
        keys = list(keys_to_shard) + list(keys_to_pass)
        if len(args) != len(keys):
            raise ValueError(f"sequence_tiled_compute: {len(args)} values for {len(keys)} keys")
        if grad_requiring_tensor_key not in keys_to_shard:
            raise ValueError(f"sequence_tiled_compute: grad_requiring_tensor_key {grad_requiring_tensor_key!r} "
                             f"is not one of the sharded keys {list(keys_to_shard)}")
        params = _trained(compute_params)
        spec = _TileSpec(fn, int(seqlen), max(1, int(shards)), list(keys_to_shard), list(keys_to_pass),
                         grad_requiring_tensor_key, output_unshard_dimension, output_reduction)
        with GatheredParameters(params):  # stage 3: autograd records the parameters' whole shapes
            return _SequenceTiled.apply(spec, len(args), *args, *params)


class _TileSpec:
    """What :class:`_SequenceTiled` computes, kept off autograd's inputs."""

    def __init__(self, fn, seqlen, shards, keys_to_shard, keys_to_pass, key, dim, reduction):
        self.fn, self.seqlen, self.shards = fn, seqlen, shards
        self.keys_to_shard, self.keys_to_pass, self.key = keys_to_shard, keys_to_pass, key
        self.dim, self.reduction = dim, reduction
        step = -(-seqlen // shards)
        self.cuts = [(lo, min(lo + step, seqlen)) for lo in range(0, seqlen, step)]  # no empty tile

    def call(self, values: list, cut: tuple[int, int], grad_tensor: Optional[torch.Tensor] = None):
        lo, hi = cut
        kwargs = {k: v[:, lo:hi] for k, v in zip(self.keys_to_shard, values)}
        if grad_tensor is not None:
            kwargs[self.key] = grad_tensor
        kwargs.update(zip(self.keys_to_pass, values[len(self.keys_to_shard):]))
        return self.fn(**kwargs)


class _SequenceTiled(torch.autograd.Function):

    @staticmethod
    def forward(ctx, spec, n_args, *inputs):
        values, params = list(inputs[:n_args]), inputs[n_args:]
        ctx.spec, ctx.n_args = spec, n_args
        ctx.save_for_backward(*[v if isinstance(v, torch.Tensor) else None for v in values], *params)
        ctx.others = [None if isinstance(v, torch.Tensor) else v for v in values]
        with torch.no_grad():
            outs = [spec.call(values, cut) for cut in spec.cuts]
        ctx.sizes = [o.shape[spec.dim] if spec.dim != 0 or o.dim() > 0 else 1 for o in outs]
        whole = (torch.stack([o.reshape(()) for o in outs]) if spec.dim == 0 and outs[0].dim() == 0
                 else torch.cat(outs, dim=spec.dim))
        ctx.whole_shape = whole.shape
        if spec.reduction == "mean":
            return whole.mean()
        return whole.sum() if spec.reduction == "sum" else whole

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        saved = list(ctx.saved_tensors)
        values = [t if t is not None else o for t, o in zip(saved[:ctx.n_args], ctx.others)]
        params = saved[ctx.n_args:]
        if spec.reduction is not None:  # the gradient of each element of the unreduced output
            numel = 1
            for n in ctx.whole_shape:
                numel *= n
            grad = (grad / numel if spec.reduction == "mean" else grad).expand(ctx.whole_shape)
        index = spec.keys_to_shard.index(spec.key)
        source = values[index]
        want = ctx.needs_input_grad[2 + index]
        source_grad = torch.zeros_like(source) if want else None
        param_grads: list[Optional[torch.Tensor]] = [None] * len(params)
        at = 0
        for cut, size in zip(spec.cuts, ctx.sizes):
            tile = source[:, cut[0]:cut[1]].detach().requires_grad_(want)
            with torch.enable_grad():
                out = spec.call(values, cut, tile)
            tile_grad = grad.narrow(spec.dim, at, size).reshape(out.shape)
            at += size
            got = _tile_grads(out, ([tile] if want else []) + list(params), tile_grad)
            if want:
                source_grad[:, cut[0]:cut[1]].copy_(got.pop(0))
            for i, g in enumerate(got):
                if g is not None:
                    param_grads[i] = g if param_grads[i] is None else param_grads[i] + g
        grads: list[Optional[torch.Tensor]] = [None] * ctx.n_args
        grads[index] = source_grad
        return (None, None, *grads, *param_grads)


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

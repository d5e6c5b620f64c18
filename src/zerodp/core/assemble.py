"""How an engine is put together from a model: param groups, flat groups, the initial state
every rank starts from, the optimizer over this rank's pieces, and the learning-rate scheduler.

``ZeroEngine.__init__`` calls these in order; they run once, before the first step.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn

from ..config import Config, ConfigError
from ..optim import build_scheduler, check_elementwise
from ..optim.build import optimizer_from_config
from ..optim.muon import MuonWithAuxAdam, from_torch_muon, is_muon_type, muon_param_groups, tag_for_muon
from .axes import DATA, ShardAxes
from .collectives import Comm
from .flat import FlatGroup, local_tensor
from .gather import external_users
from .init_shards import full_shape


def as_tensor_list(params) -> list:
    """A param group's ``params`` as a list of tensors, as torch optimizers accept them: a
    single tensor, an iterable of tensors, or of ``(name, tensor)`` pairs."""
    if isinstance(params, torch.Tensor):
        return [params]
    return [p[1] if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) else p
            for p in params]


def user_param_groups(module: nn.Module, model_parameters, optimizer,
                      replaced: Optional[dict[int, nn.Parameter]] = None) -> list[dict]:
    """The optimizer param groups as dicts of {"params": [...], hyperparameters...}. ``replaced``
    (``id(old) -> new``): parameters the model no longer holds, taken as the ones that replaced
    them (an optimizer built before ``initialize`` split the model over its tensor axis)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if model_parameters is not None:
            warnings.warn("zerodp uses the param groups of the optimizer passed in; "
                          "model_parameters is ignored", UserWarning, stacklevel=4)
        groups = [dict(g) for g in optimizer.param_groups]
    elif model_parameters is not None:
        mp = as_tensor_list(model_parameters) if isinstance(model_parameters, torch.Tensor) \
            else list(model_parameters)
        groups = ([dict(g) for g in mp] if mp and isinstance(mp[0], dict) else [{"params": mp}])
    else:
        groups = [{"params": [p for p in module.parameters() if p.requires_grad]}]
    model_ids = {id(p) for p in module.parameters()}
    replaced = replaced or {}
    seen: dict[int, int] = {}
    for gi, g in enumerate(groups):
        g["params"] = [p if id(p) in model_ids else replaced.get(id(p), p) for p in as_tensor_list(g["params"])]
        for p in g["params"]:
            if not isinstance(p, torch.Tensor) or id(p) not in model_ids:
                what = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) \
                    else f"a {type(p).__name__}"
                raise ValueError(f"param group {gi} holds {what} that is not a parameter of the model")
            if id(p) in seen:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is in param groups "
                                 f"{seen[id(p)]} and {gi}; each parameter may be in one group")
            seen[id(p)] = gi
    return groups


def optimizer_param_groups(config: Config, module: nn.Module, groups: list[dict], optimizer,
                           report: bool) -> list[dict]:
    """The param groups the flat groups and the optimizer are built on: ``groups`` as the caller
    gave them or, for the config's Muon, each split into its Muon and AdamW halves by the
    parameters' ``use_muon`` tags (those without one tagged here by DeepSpeed's rule;
    ``optim/muon.py``), the split logged where ``report``."""
    cfg = config.optimizer
    if cfg is None or optimizer is not None or not is_muon_type(cfg.type):
        return groups

    def shape_of(p):
        return full_shape(local_tensor(p))

    tag_for_muon(module, shape_of)
    names = {id(p): n for n, p in module.named_parameters()}
    return muon_param_groups(groups, dict(cfg.params), shape_of, names, report=report)


def build_flat_groups(module: nn.Module, groups: list[dict], unit_of: dict[int, int], bucket_numel: int,
                      axes: ShardAxes, sharding: bool, device: torch.device,
                      tp_of: Optional[dict] = None, separate: Optional[dict[int, str]] = None,
                      axis_of: Optional[dict[int, str]] = None,
                      counted_elsewhere: frozenset = frozenset()) -> list[FlatGroup]:
    """Cut parameters into flat groups of at most ``reduce_bucket_size`` elements.

    Parameters are taken in reverse registration order (roughly the order backward
    produces their gradients), one open bucket per (param group, dtype, trained or not,
    stage-3 unit, split over the tensor-parallel ranks or not, shard axis), and a group of its own for each
    parameter in ``separate`` (id -> label: a weight tied across pipeline stages, laid out the
    same on every stage that holds it); sizes count this rank's local tensors;
    groups are numbered by the position of their last parameter, so that group order
    is the order in which they are expected to become ready. Each group shards over the axis
    ``axis_of`` names for its parameters (id -> axis name; ``DATA`` for those it does not name)
    when ``sharding`` (stages 1-3), over one partition otherwise. A group holding a parameter in
    ``counted_elsewhere`` (ids; a weight tied across pipeline stages) leaves its gradient norm
    and checkpoint to another rank.
    """
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
    tp_of, separate, axis_of = tp_of or {}, separate or {}, axis_of or {}
    named = list(module.named_parameters())
    left_out = [n for n, p in named if p.requires_grad and id(p) not in group_of]
    if left_out:
        warnings.warn(f"zerodp: trainable parameters not given to the optimizer stay frozen and "
                      f"unsynchronized: {', '.join(left_out[:5])}{' ...' if len(left_out) > 5 else ''}",
                      UserWarning, stacklevel=4)
    cap = int(bucket_numel)
    open_buckets: dict[tuple, list] = {}
    open_sizes: dict[tuple, int] = {}
    closed: list[tuple[int, tuple, list]] = []
    order = [(n, p) for n, p in reversed(named) if id(p) in group_of or not p.requires_grad]
    for pos, (name, p) in enumerate(order):
        key = (group_of.get(id(p), -1), p.dtype, p.requires_grad and id(p) in group_of,
               unit_of.get(id(p), 0), id(p) in tp_of, separate.get(id(p)), axis_of.get(id(p), DATA))
        numel = full_shape(local_tensor(p)).numel()
        bucket = open_buckets.setdefault(key, [])
        if bucket and open_sizes[key] + numel > cap:
            closed.append((pos - 1, key, bucket))
            bucket = open_buckets[key] = []
        open_sizes[key] = (open_sizes[key] if bucket else 0) + numel
        bucket.append((name, p))
    last_pos = {n: pos for pos, (n, _) in enumerate(order)}
    for key, bucket in open_buckets.items():
        if bucket:
            closed.append((last_pos[bucket[-1][0]], key, bucket))
    closed.sort(key=lambda c: c[0])
    def placed(axis: str) -> dict:
        comm = axes.comm(axis)
        return dict(axis=axis, partitions=comm.world_size, rank=comm.rank) if sharding \
            else dict(axis=axis, partitions=1, rank=0)
    return [FlatGroup(i, bucket, param_group=max(key[0], 0), trainable=key[2], unit=key[3],
                      device=device, tp_of=tp_of, **placed(key[6]),
                      counted_here=not any(id(p) in counted_elsewhere for _, p in bucket))
            for i, (_, key, bucket) in enumerate(closed)]


def adopt_replaced_params(module: nn.Module, flat_groups: list[FlatGroup]) -> None:
    """Put the parameters that replaced meta-device ones into the modules (tied
    parameters stay tied: every slot holding the old one gets the same new one)."""
    new = {old: p for g in flat_groups for old, p in g.replaced.items()}
    if not new:
        return
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and id(p) in new:
                mod._parameters[name] = new[id(p)]
    for _, params in external_users(module):
        params[:] = [new.get(id(p), p) for p in params]


def broadcast_initial_state(comm: Comm, module: nn.Module, flat_groups: list[FlatGroup],
                            axes: Optional[ShardAxes] = None) -> None:
    """Start every rank from rank 0's parameters and buffers (parameters built on the
    meta device are initialized identically on every rank instead): over ``comm`` (the data-parallel
    ranks), a group on another shard axis over that axis (``axes``: expert parameters from the first
    rank holding the same experts)."""
    for g in flat_groups:
        if not g.replaced:
            (comm if axes is None or g.axis == DATA else axes.of(g)).broadcast(g.full)
    for b in module.buffers():
        comm.broadcast(b)


def build_optimizer(config: Config, groups: list[dict], pieces_by_group: list[list], optimizer
                    ) -> torch.optim.Optimizer:
    cfg = config.optimizer
    if cfg is not None and optimizer is not None:
        raise ConfigError("optimizer: the config has an 'optimizer' block and an optimizer was "
                          "also passed to initialize; give one or the other")
    hyper = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in groups]
    new_groups = [dict(h, params=pieces) for h, pieces in zip(hyper, pieces_by_group)]
    torch_muon = getattr(torch.optim, "Muon", None)
    if torch_muon is not None and isinstance(optimizer, torch_muon):  # torch's math, each matrix whole on one rank
        if len(optimizer.state):
            raise ValueError("the optimizer passed to initialize already has state; pass a "
                             "freshly constructed optimizer")
        return MuonWithAuxAdam(from_torch_muon(new_groups))
    if isinstance(optimizer, torch.optim.Optimizer):
        check_elementwise(type(optimizer))
        if len(optimizer.state):
            raise ValueError("the optimizer passed to initialize already has state; pass a "
                             "freshly constructed optimizer")
        for g, pieces in zip(optimizer.param_groups, pieces_by_group):
            g["params"] = pieces
            if "param_names" in g:
                g["param_names"] = [f"piece{i}" for i in range(len(pieces))]
        return optimizer
    if callable(optimizer):
        opt = optimizer(new_groups)
        check_elementwise(type(opt))
        return opt
    if cfg is None:
        raise ConfigError("optimizer: no optimizer; add an 'optimizer' block to the config "
                          "(e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-4}}) or pass optimizer=")
    return optimizer_from_config(cfg.type, cfg.params, new_groups)  # ConfigError naming the key


def build_lr_scheduler(config: Config, optimizer: torch.optim.Optimizer, lr_scheduler):
    if config.scheduler is not None:
        if lr_scheduler is not None:
            warnings.warn("zerodp uses the config's 'scheduler' block; the lr_scheduler passed "
                          "to initialize is ignored", UserWarning, stacklevel=5)
        return build_scheduler(optimizer, config.scheduler.type,
                               dict(config.scheduler.params))
    if lr_scheduler is None:
        return None
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        if lr_scheduler.optimizer is not optimizer:
            raise ValueError("lr_scheduler is bound to a different optimizer; pass a callable "
                             "that takes the optimizer, or build it on the optimizer you pass in")
        return lr_scheduler
    if callable(lr_scheduler):
        return lr_scheduler(optimizer)
    raise TypeError(f"lr_scheduler: expected an LRScheduler or a callable, got {type(lr_scheduler)}")

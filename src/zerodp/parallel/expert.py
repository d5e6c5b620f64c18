"""Expert parallelism: each rank of an expert-parallel group owns ``E / ep`` of a mixture-of-experts
layer's experts whole; tokens travel to their experts' ranks by all-to-all and come back.

Groups. ``initialize_expert_parallel(ep)`` cuts the world into expert-parallel groups of ``ep``
consecutive ranks (they exchange tokens) and, across them, expert-data groups: the ranks with the
same place in their expert group, which hold the same experts (``world / ep`` of them). DeepSpeed
lays its groups out the same way.

ZeRO. An expert's parameters live on one rank of every expert group, so ZeRO shards and reduces
them over the expert-data group (the shard axis ``EXPERT_DATA``, ``core/axes.py``; named for those
parameters by :class:`ExpertParallel`, the engine's handle, ``Parallelism.shard_axis_of``), while the
dense parameters (the router, attention, embeddings) shard over every data-parallel rank as before.
The gradients are divided by the data-parallel world for both: an expert's gradient on its rank
already holds the contributions of every token its group sent it, and the sum over the expert-data
group adds those of the other groups, which is the sum over all ranks' losses.

Routing (:class:`ExpertParallelMoE`): the router's top-``k`` experts of every token, without a
capacity limit and without dropped tokens, so the layer equals the same layer on one process. The
token counts per expert are exchanged first, then the tokens (``Comm.all_to_all_rows``, uneven), then
the outputs travel back. Every local expert runs once per forward, also on no token, so that at ZeRO
stage 3 every rank of an expert-data group gathers the same experts in the same order, and a rank
whose experts got no token still takes part in every collective (its experts' gradients are zeros).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..core import teardown
from ..core.collectives import Comm, CommCounter
from .base import Parallelism
from .grid import Axis, new_axis

EXPERT_DATA = "expert_data"
"""The shard axis of expert parameters: the ranks that hold the same experts."""


class ExpertParallelError(ValueError):
    """An expert-parallel layout or layer that cannot be made as asked."""


@dataclass
class ExpertAxes:
    """This rank's expert-parallel group (``expert``: ranks that exchange tokens) and expert-data
    group (``expert_data``: ranks that hold the same experts)."""

    size: int
    expert: Axis
    expert_data: Axis


_AXES: dict[int, ExpertAxes] = {}  # by expert-parallel size, made once per process
teardown.on_exit_release(_AXES.clear)


def initialize_expert_parallel(ep_size: int) -> ExpertAxes:
    """Make the expert-parallel groups of the world (blocks of ``ep_size`` consecutive ranks) and the
    expert-data groups across them (every rank must call it, in the same order); the same axes again
    for the same size."""
    import torch.distributed as dist
    ep = int(ep_size)
    if ep in _AXES:
        return _AXES[ep]
    if not (dist.is_available() and dist.is_initialized()):
        raise ExpertParallelError("expert parallelism needs torch.distributed initialized first")
    world, me = dist.get_world_size(), dist.get_rank()
    if ep < 1 or world % ep:
        raise ExpertParallelError(f"expert-parallel size {ep} does not divide the world size {world}")
    expert = new_axis("expert", [list(range(i, i + ep)) for i in range(0, world, ep)], me)
    expert_data = new_axis(EXPERT_DATA, [list(range(j, world, ep)) for j in range(ep)], me)
    _AXES[ep] = ExpertAxes(ep, expert, expert_data)
    return _AXES[ep]


def forget_expert_axes() -> None:
    """Forget the expert axes (the process group is being destroyed)."""
    _AXES.clear()


class _AllToAllRows(torch.autograd.Function):
    """``Comm.all_to_all_rows`` with its backward: the same exchange the other way."""

    @staticmethod
    def forward(ctx, comm: Comm, x: torch.Tensor, send: list[int], recv: list[int], what: str):
        ctx.comm, ctx.send, ctx.recv, ctx.what = comm, send, recv, what
        return comm.all_to_all_rows(x, send, recv, what=what)

    @staticmethod
    def backward(ctx, grad):
        return None, ctx.comm.all_to_all_rows(grad, ctx.recv, ctx.send, what=ctx.what + " (backward)"), None, None, None


def route(comm: Comm, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, num_experts: int, rank: int,
          run: Callable[[torch.Tensor, list[list[int]]], torch.Tensor]) -> torch.Tensor:
    """Tokens ``x [T, h]`` to their ``chosen [T, k]`` experts over the expert-parallel group ``comm``
    (this rank, ``rank``, holds experts ``rank * E/ep`` to ``(rank + 1) * E/ep``) and back, weighted by
    ``weights [T, k]`` and summed. Token counts per expert go first, then the tokens, grouped by
    expert; ``run(tokens, counts)`` computes this rank's experts' outputs for the rows it received
    (laid out per source rank, then per local expert, ``counts[source][local expert]`` rows each)."""
    k, ep = chosen.shape[-1], comm.world_size
    per = num_experts // ep
    flat = chosen.reshape(-1)  # token t's j-th expert at t * k + j
    order = flat.argsort(stable=True)  # assignments grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    every = comm.all_gather_ints(counts, what="expert token counts")  # [source rank][expert]
    send = [sum(counts[r * per:(r + 1) * per]) for r in range(ep)]
    mine = [src[rank * per:(rank + 1) * per] for src in every]  # per source, per local expert
    recv = [sum(c) for c in mine]
    tokens = _AllToAllRows.apply(comm, x[order // k], send, recv, "tokens to their experts")
    out = run(tokens, mine)
    if tokens.requires_grad and not out.requires_grad:  # no token here: still in the backward exchange
        out = out + tokens.sum() * 0
    out = _AllToAllRows.apply(comm, out, recv, send, "expert outputs")
    out = out[order.argsort()].view(-1, k, x.shape[-1])
    return (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)


class ExpertParallelMoE(nn.Module):
    """A mixture-of-experts layer with its experts split over an expert-parallel group.

    ``router``: hidden -> ``E`` logits; ``experts``: all ``E`` experts (hidden -> hidden), of which
    this rank keeps its ``E / ep_size`` (``self.experts``, keyed by their global index, so parameter
    names stay those of the whole layer); each token goes to its ``top_k`` experts by the router's
    softmax, weighted by those probabilities (renormalized over the ``top_k`` when ``normalize``).
    Input ``[..., hidden]``, output the same shape."""

    def __init__(self, router: nn.Module, experts: Sequence[nn.Module], top_k: int, ep_size: int = 1,
                 normalize: bool = True) -> None:
        super().__init__()
        n = len(experts)
        if ep_size < 1 or n % ep_size:
            raise ExpertParallelError(f"expert-parallel size {ep_size} does not divide the {n} experts")
        if not 1 <= top_k <= n:
            raise ExpertParallelError(f"top_k {top_k} is not between 1 and the {n} experts")
        self.axes: Optional[ExpertAxes] = initialize_expert_parallel(ep_size) if ep_size > 1 else None
        self.num_experts, self.top_k, self.ep_size, self.normalize = n, top_k, ep_size, normalize
        self.per_rank = n // ep_size
        first = (self.axes.expert.rank if self.axes else 0) * self.per_rank
        self.local = list(range(first, first + self.per_rank))
        self.router = router
        self.experts = nn.ModuleDict({str(e): experts[e] for e in self.local})
        mark_expert_params(self.experts.parameters(), self.axes, ep_size)
        self.comm = self.axes.expert.comm(label="expert") if self.axes else Comm.alone("expert")
        if self.axes is not None:
            setattr(self, _COMM_ATTR, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        rank = self.axes.expert.rank if self.axes is not None else 0
        return route(self.comm, x, chosen, weights, self.num_experts, rank, self._run_experts).view(shape)

    def _run_experts(self, tokens: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """Each local expert once, on its rows of ``tokens`` (laid out per source rank, then per
        local expert, with ``counts[source][expert]`` rows each); the outputs in the same layout."""
        rows: list[list[int]] = [[] for _ in self.local]
        at = 0
        for source in counts:
            for i, c in enumerate(source):
                rows[i].extend(range(at, at + c))
                at += c
        outs, where = [], []
        for i, e in enumerate(self.local):
            index = torch.tensor(rows[i], dtype=torch.long, device=tokens.device)
            outs.append(self.experts[str(e)](tokens.index_select(0, index)))  # also on no token
            where.append(index)
        return torch.cat(outs)[torch.cat(where).argsort()]


_AXES_ATTR = "_zerodp_expert_axes"
_COMM_ATTR = "_zerodp_expert_comm"  # on a module that exchanges tokens: its Comm, counted by the engine


def mark_expert_params(params, axes: Optional[ExpertAxes], ep_size: int) -> None:
    """Mark expert parameters: DeepSpeed's marks (``deepspeed.moe.utils.is_moe_param``) and, split
    over more than one rank, the axes they shard over."""
    for p in params:
        p.allreduce = False
        p.group_name = f"ep_size_{ep_size}"
        if axes is not None:
            setattr(p, _AXES_ATTR, axes)


def expert_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` held by one rank of an expert-parallel group (not everywhere)."""
    return [p for p in model.parameters() if getattr(p, _AXES_ATTR, None) is not None]


def expert_parallel_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that exchange tokens over an expert-parallel group."""
    return [m for m in model.modules() if getattr(m, _COMM_ATTR, None) is not None]


class ExpertParallel(Parallelism):
    """The engine's handle on expert parallelism: the expert-data axis its layers' expert parameters
    shard and reduce over (one expert-parallel size per model)."""

    name = "expert"

    def __init__(self, model: nn.Module, counter: CommCounter) -> None:
        sizes = sorted({getattr(p, _AXES_ATTR).size for p in expert_parallel_params(model)})
        if len(sizes) != 1:
            raise ExpertParallelError(f"the model's experts use expert-parallel sizes {sizes}; zerodp supports one "
                                      "per model")
        counter.declare("all_to_all")
        self.axes = _AXES[sizes[0]]
        self.comm = self.axes.expert_data.comm(counter, EXPERT_DATA)
        self.expert_comm = self.axes.expert.comm(counter, "expert")  # the layers' exchanges; whole-model saves
        for m in expert_parallel_layers(model):  # the token exchanges count with the engine's bytes
            m.set_comm(self.expert_comm) if hasattr(m, "set_comm") else setattr(m, "comm", self.expert_comm)

    def shard_axes(self) -> dict[str, Comm]:
        return {EXPERT_DATA: self.comm}

    def placement(self, model: nn.Module) -> dict:
        """The slices of transformers' fused experts (``expert_hf.py``): expert-parallel rank ``t``
        holds slice ``t`` of ``ep`` along the experts' dimension, which checkpoints write and read as
        tensor parallelism's slices (``TPSlice``), so they load at any expert-parallel size."""
        from .tensor import TPSlice
        out = {}
        for m in expert_parallel_layers(model):
            total = getattr(m, "global_num_experts", None)
            if total is None:
                continue
            for p in m.parameters(recurse=False):
                out[id(p)] = TPSlice(0, self.axes.size, self.axes.expert.rank, (total, *p.shape[1:]))
        return out

    def names_on(self, model: nn.Module, ep_rank: int) -> dict[str, str]:
        """This rank's expert parameter names -> the names the same places have on expert-parallel rank
        ``ep_rank`` in the model without expert parallelism (what checkpoints call them): DeepSpeed's
        MoE layer numbers a rank's experts from 0 (``deepspeed_experts.{i}``: global ``ep_rank *
        local + i``), ``ExpertParallelMoE`` by global index; fused experts keep one name (their
        slices are placed by :meth:`placement`)."""
        out = {}
        for prefix, m in model.named_modules():
            pre = f"{prefix}." if prefix else ""
            if isinstance(getattr(m, "deepspeed_experts", None), nn.ModuleList):  # expert_capacity.Experts
                for i, e in enumerate(m.deepspeed_experts):
                    for name, _ in e.named_parameters():
                        out[f"{pre}deepspeed_experts.{i}.{name}"] = \
                            f"{pre}deepspeed_experts.{ep_rank * m.num_local_experts + i}.{name}"
            elif isinstance(m, ExpertParallelMoE) and m.axes is not None:
                for j, e in enumerate(m.local):
                    for name, _ in m.experts[str(e)].named_parameters():
                        out[f"{pre}experts.{e}.{name}"] = f"{pre}experts.{ep_rank * m.per_rank + j}.{name}"
        return out

    def shard_axis_of(self, model: nn.Module) -> dict[int, str]:
        return {id(p): EXPERT_DATA for p in expert_parallel_params(model)}


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter (DeepSpeed's mark: ``allreduce`` set to False)."""
    return getattr(param, "allreduce", True) is False


def split_moe_param_groups(param_groups, max_group_size: Optional[float] = 178956971) -> list[dict]:
    """DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``: move the expert
    parameters of each optimizer param group (a dict, or a list or tuple of them) into groups of
    their own, one per group of the original and expert group name (``param.group_name``), marked
    ``"moe": True`` and named after the expert group, with the original's other options; with
    ``max_group_size``, each such group is cut into groups of at most that many elements. The dicts
    given are changed in place (they keep the dense parameters); returns the list of all groups."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: unknown param group type "
                         f"{type(param_groups).__name__}")
    names = sorted({p.group_name for g in groups for p in g["params"] if is_moe_param(p)})
    moe_groups = []
    for g in list(groups):
        params = list(g["params"])
        g["params"] = [p for p in params if not is_moe_param(p)]
        for name in names:
            mine = [p for p in params if is_moe_param(p) and p.group_name == name]
            base = {**g, "name": name, "moe": True}
            if max_group_size is None:
                moe_groups.append({**base, "params": mine})
                continue
            chunk: list = []
            size = 0
            for p in mine:
                n = int(getattr(p, "ds_numel", p.numel()))
                if chunk and size + n > max_group_size:
                    moe_groups.append({**base, "params": chunk})
                    chunk, size = [], 0
                chunk.append(p)
                size += n
            if chunk:
                moe_groups.append({**base, "params": chunk})
    return groups + moe_groups

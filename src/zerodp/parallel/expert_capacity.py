"""DeepSpeed's mixture-of-experts layer (``deepspeed.moe.layer.MoE``): GShard-style gates with an
expert capacity, and a dispatch of fixed size, split over an expert-parallel group.

Semantics (as DeepSpeed 0.19 defines them; the names and parameter paths are DeepSpeed's, so its
scripts and state dicts carry over):

* The gate (:class:`TopKGate`, a bias-free linear ``wg``) scores every token of this rank's batch in
  fp32. ``k = 1``: each token's best expert (Gumbel noise on the logits first under the ``RSample``
  policy); ``k = 2``: the best and, by default, a second one sampled by the Gumbel-max trick
  (``top2_2nd_expert_sampling``), both weighted by their probabilities renormalized over the two;
  ``k > 2``: the top ``k``, renormalized. The ``Jitter`` policy multiplies the gate's input by noise
  in ``[1 - 0.01, 1 + 0.01]`` in training.
* Capacity: an expert takes at most ``C = max(ceil(tokens / E * capacity_factor * k), min_capacity)``
  of this rank's tokens (``eval_capacity_factor`` in eval mode). Which ones, when more come: ``k = 1``
  a random choice (Random Token Selection, ``use_rts``) or torch's ``topk`` order; ``k = 2`` the first
  in token order, first choices before second ones; ``k > 2`` the highest gate values. A dropped
  route contributes nothing (a token whose routes all drop comes out as zeros, or as the residual
  MLP's output). ``drop_tokens=False``: ``C`` is the largest count any expert got on any rank of the
  expert-parallel group, so nothing drops.
* The auxiliary load-balancing loss ``l_aux`` (GShard's ``E * sum(mean gate * fraction routed)``, by
  ``k``) and the tokens per expert (``exp_counts``) are returned with the output.

The layer: each rank fills an ``[E, C, hidden]`` buffer with its tokens by expert and slot, sends
each expert-parallel rank the ``E / ep`` experts' rows it owns (one even all-to-all), runs its local
experts on what every rank sent, sends the results back and combines each token's routes with their
weights. Gating is per rank, so an expert-parallel size changes where experts run, not the numbers:
``ep = 1`` on every rank is the reference the split layers are tested against. What ZeRO does with
the expert parameters is ``expert.py``'s (the ``ep_size_N`` marks and the expert-data axis).
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..core.collectives import Comm
from ..core.init_shards import gathered, init_shard
from .expert import _COMM_ATTR, ExpertParallelError, _AllToAllRows, initialize_expert_parallel, mark_expert_params

NOISY_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass
class Routes:
    """A gate's decision for ``S`` tokens and ``k`` routes each: expert ``indices [k, S]`` (-1: the
    route was dropped), slot ``locations [k, S]`` in that expert's ``capacity`` rows, combine weights
    ``gates [k, S]`` (fp32), the load-balancing loss and the tokens each expert was given."""

    l_aux: torch.Tensor
    capacity: int
    indices: torch.Tensor
    locations: torch.Tensor
    gates: torch.Tensor
    exp_counts: torch.Tensor


def _uniform(shape, lo: float, hi: float, device) -> torch.Tensor:
    """Uniform noise drawn as ``torch.distributions.Uniform(lo, hi).rsample`` draws it (the same
    random stream as DeepSpeed's gates on the same seed)."""
    return torch.distributions.Uniform(torch.tensor(lo, device=device), torch.tensor(hi, device=device)).rsample(shape)


def _gumbel(shape, device) -> torch.Tensor:
    return torch.distributions.Gumbel(torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)).rsample(shape)


def _group_max(value: int, comm: Optional[Comm]) -> int:
    """The largest ``value`` over the expert-parallel group (every rank's capacity must agree)."""
    if comm is None or comm.world_size == 1:
        return value
    return max(v[0] for v in comm.all_gather_ints([value], what="expert capacity"))


def _capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    return max(math.ceil(tokens / experts * factor), min_capacity)


def top1(logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: Optional[torch.Tensor] = None,
         noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True, use_rts: bool = True,
         comm: Optional[Comm] = None) -> Routes:
    """Each token's best expert, at most ``capacity`` tokens per expert (see the module docstring)."""
    tokens, experts = logits.shape
    noisy = logits + _gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" else None
    gates = F.softmax(logits, dim=1)
    capacity = _capacity(tokens, experts, capacity_factor, min_capacity)
    chosen = torch.argmax(noisy if noisy is not None else gates, dim=1)
    mask = F.one_hot(chosen, num_classes=experts)
    if used_token is not None:
        mask = used_token.unsqueeze(1) * mask
    counts = mask.sum(dim=0).detach()
    if not drop_tokens:
        capacity = min(_group_max(int(counts.max()), comm), tokens)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * experts
    ranked = mask * _uniform(mask.shape, 0.0, 1.0, logits.device) if use_rts else mask
    if tokens < min_capacity:
        raise ExpertParallelError(f"MoE top-1 gate: {tokens} tokens, fewer than min_capacity={min_capacity}; lower "
                                  "min_capacity or give the layer more tokens")
    kept = torch.topk(ranked, k=min(capacity, tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, kept, 1)
    chosen = torch.where(mask.sum(dim=1) > 0, chosen, torch.full_like(chosen, -1))
    locations = ((torch.cumsum(mask, dim=0) - 1) * mask).sum(dim=1)
    weights = (gates * mask).sum(dim=1)
    return Routes(l_aux, int(capacity), chosen.unsqueeze(0), locations.unsqueeze(0), weights.unsqueeze(0), counts)


def top2(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
         second_sampling: bool = True, comm: Optional[Comm] = None) -> Routes:
    """Each token's best expert and a second one (sampled, or the runner-up), first come first
    served up to ``capacity`` per expert (see the module docstring)."""
    tokens, experts = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=experts)
    if second_sampling:
        logits = logits + _gumbel(logits.shape, logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=experts)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # second choices queue after firsts
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * experts * experts
    counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = _capacity(tokens, experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (loc1 < capacity)
        mask2 = mask2 * (loc2 < capacity)
    else:
        capacity = _group_max(int(counts.max()), comm)
    g1, g2 = (gates * mask1.float()).sum(dim=1), (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    chosen = torch.stack([torch.where(mask1.any(dim=1), first, -1), torch.where(mask2.any(dim=1), second, -1)])
    locations = torch.stack([(loc1 * mask1).sum(dim=1), (loc2 * mask2).sum(dim=1)])
    return Routes(l_aux, int(capacity), chosen, locations, torch.stack([g1 / denom, g2 / denom]), counts)


def topk(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
         comm: Optional[Comm] = None) -> Routes:
    """Each token's ``k`` best experts; over capacity, an expert keeps the tokens with the highest
    gate values (see the module docstring)."""
    tokens, experts = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * experts * experts / k
    if drop_tokens:
        capacity = _capacity(tokens, experts, capacity_factor * k, min_capacity)
        by_gate = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        kept = torch.topk(by_gate, k=min(capacity, tokens), dim=0, sorted=False)[1]
        mask &= torch.zeros_like(mask).scatter_(0, kept, True)
    else:
        capacity = _group_max(int(counts.max()), comm)
    locations = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(masked.sum(dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    kept_route = mask.gather(1, top_idx)
    chosen = torch.where(kept_route, top_idx, torch.full_like(top_idx, -1))
    return Routes(l_aux, int(capacity), chosen.t().contiguous(), (locations.gather(1, top_idx) * kept_route).t(),
                  masked.gather(1, top_idx).t().contiguous(), counts)


class TopKGate(nn.Module):
    """DeepSpeed's gate: ``wg`` scores the tokens; ``forward(x [S, hidden], used_token)`` returns the
    :class:`Routes` (see the module docstring for ``k``, capacity and noise)."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ExpertParallelError(f"MoE gate: k={k} is not between 1 and the {num_experts} experts")
        if noisy_gate_policy not in NOISY_POLICIES:
            raise ExpertParallelError(f"MoE gate: noisy_gate_policy {noisy_gate_policy!r} is not one of None, "
                                      "'Jitter', 'RSample'")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k, self.capacity_factor, self.eval_capacity_factor = k, capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts, self.top2_2nd_expert_sampling = drop_tokens, use_rts, top2_2nd_expert_sampling
        self.comm: Optional[Comm] = None  # the expert-parallel group's, for the capacity without drops

    def forward(self, x: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> Routes:
        x = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * _uniform(x.shape, 1.0 - 1e-2, 1.0 + 1e-2, x.device)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1(logits, factor, self.min_capacity, used_token,
                        self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts, self.comm)
        if self.k == 2:
            return top2(logits, factor, self.min_capacity, self.drop_tokens, self.top2_2nd_expert_sampling, self.comm)
        return topk(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.comm)


class Experts(nn.Module):
    """This rank's experts: ``num_local_experts`` copies of ``expert`` (``deepspeed_experts``), marked
    as expert parameters of the group ``expert_group_name``. ``forward([ep, local, C, hidden])`` runs
    expert ``i`` on ``[:, i]``."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: Optional[str] = None):
        super().__init__()
        params = list(expert.parameters())
        built_in_init = [p for p in params if init_shard(p) is not None]
        # built in zero.Init, the expert keeps slices: its values whole while copied (the copies are sliced
        # again when this constructor returns)
        with gathered(built_in_init, None) if built_in_init else contextlib.nullcontext():
            self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for p in self.deepspeed_experts.parameters():
            p.allreduce, p.group_name = False, expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)  # (output, bias) experts: the output
        return torch.cat(outs, dim=1)


class MOELayer(nn.Module):
    """The gate and this rank's experts, with the exchanges between them: ``forward(x, used_token)``
    returns the combined output; ``l_aux`` and ``exp_counts`` of the last forward are attributes."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int,
                 use_tutel: bool = False) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group_name, self.ep_size, self.num_local_experts = ep_group_name, ep_size, num_local_experts
        self.use_tutel = False  # Tutel's kernels are not used; the dispatch below computes the same
        self.comm: Comm = Comm.alone("expert")
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None

    def set_comm(self, comm: Comm) -> None:
        """The expert-parallel group's ``Comm`` (the engine's counted one once ``initialize`` ran)."""
        self.comm = self.gate.comm = comm

    def forward(self, x: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = x.shape[-1]
        flat = x.reshape(-1, hidden)
        routes = self.gate(flat, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        tokens, experts, capacity = flat.shape[0], self.ep_size * self.num_local_experts, routes.capacity
        # every route's row in the [E * C] buffer; dropped routes to one extra row, never sent
        slots = torch.where(routes.indices >= 0, routes.indices.long() * capacity + routes.locations.long(),
                            experts * capacity)
        source = torch.full((experts * capacity + 1,), tokens, dtype=torch.long, device=x.device)
        source.scatter_(0, slots.reshape(-1), torch.arange(tokens, device=x.device).expand_as(slots).reshape(-1))
        padded = torch.cat([flat, flat.new_zeros(1, hidden)])
        buffer = padded.index_select(0, source[:-1])  # [E * C, hidden]: expert e's slots at e * C
        rows = [self.num_local_experts * capacity] * self.ep_size
        received = _AllToAllRows.apply(self.comm, buffer, rows, rows, "tokens to their experts")
        out = self.experts(received.view(self.ep_size, self.num_local_experts, capacity, hidden))
        out = _AllToAllRows.apply(self.comm, out.reshape(-1, hidden), rows, rows, "expert outputs")
        out = torch.cat([out, out.new_zeros(1, hidden)]).index_select(0, slots.reshape(-1))
        out = (out.view(slots.shape[0], tokens, hidden) * routes.gates.unsqueeze(-1)).sum(dim=0)
        return out.to(x.dtype).reshape(x.shape)


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE``: ``num_experts`` copies of ``expert`` behind a top-``k``
    gate, split over expert-parallel groups of ``ep_size`` consecutive ranks (each holds
    ``num_experts / ep_size``); ``forward(hidden_states, used_token=None)`` returns ``(output, l_aux,
    exp_counts)``. ``use_residual``: Residual MoE, the output mixed with ``expert`` itself by a learned
    two-way softmax (``coefficient``). ``use_tutel`` and ``enable_expert_tensor_parallelism`` are
    accepted; the first changes nothing, the second is refused with tensor parallelism by the engine."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ExpertParallelError(f"MoE: expert-parallel size {ep_size} does not divide the {num_experts} "
                                      "experts")
        self.use_residual, self.enable_expert_tensor_parallelism = use_residual, enable_expert_tensor_parallelism
        self.ep_size, self.num_experts = ep_size, num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)
        import torch.distributed as dist
        if ep_size > 1 and dist.is_available() and dist.is_initialized():
            self.set_deepspeed_parallelism()

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Join the expert-parallel group of ``ep_size`` ranks (made at construction when
        torch.distributed is up, else by ``initialize``)."""
        if use_data_before_expert_parallel_:
            raise ExpertParallelError("use_data_before_expert_parallel_: zerodp lays expert-parallel groups out "
                                      "as consecutive ranks only")
        if self.ep_size == 1 or getattr(self.deepspeed_moe, _COMM_ATTR, False):
            return
        axes = initialize_expert_parallel(self.ep_size)
        mark_expert_params(self.deepspeed_moe.experts.parameters(), axes, self.ep_size)
        self.deepspeed_moe.set_comm(axes.expert.comm(label="expert"))
        setattr(self.deepspeed_moe, _COMM_ATTR, True)

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            mlp = self.mlp(hidden_states)
            mlp = mlp[0] if isinstance(mlp, tuple) else mlp
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def join_expert_groups(model: nn.Module) -> None:
    """Give every :class:`MoE` layer of ``model`` that was made before torch.distributed was up its
    expert-parallel group (``initialize`` does it, as DeepSpeed's engine does)."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.set_deepspeed_parallelism()

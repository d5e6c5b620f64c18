"""Worker tasks for ``test_moe_layer.py``: a small model with DeepSpeed's MoE layer (``zerodp.moe``)
trained through the engine with its experts over expert-parallel groups of 2 or 4 of the 4 ranks,
against the same model with every expert on every rank (``ep_size=1``): DeepSpeed's gates decide on
each rank's own tokens, so the expert-parallel size must not change a number."""
from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp
from zerodp.moe.layer import MoE
from zerodp.moe.utils import split_params_into_different_moe_groups_for_optimizer

EXPERTS, HIDDEN, CLASSES, BATCH = 4, 8, 5, 6
GATES = {
    "top1": dict(k=1, capacity_factor=1.0, min_capacity=0),  # capacity 2 of 6 tokens: drops, chosen at random
    "top1-nodrop": dict(k=1, min_capacity=0, drop_tokens=False, noisy_gate_policy="RSample"),
    "top2": dict(k=2, min_capacity=0),  # the second expert sampled (Gumbel)
    "top3": dict(k=3, capacity_factor=0.5, min_capacity=0),
    "residual": dict(k=1, min_capacity=0, use_residual=True, noisy_gate_policy="Jitter"),
}


class Net(nn.Module):
    """DeepSpeed's CIFAR example's shape: a dense layer, the MoE layer, a classifier; the loss adds
    the gate's auxiliary loss."""

    def __init__(self, ep: int, gate: str, perturb: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, 16), nn.GELU(), nn.Linear(16, HIDDEN))
        self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep, **GATES[gate])
        self.head = nn.Linear(HIDDEN, CLASSES)
        local = self.moe.num_local_experts
        first = (dist.get_rank() % ep) * local
        with torch.no_grad():  # the copies apart, by global expert index
            for i, e in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts if perturb else ()):
                for p in e.parameters():
                    p.add_(0.02 * (first + i + 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(F.relu(self.fc(x)))
        return F.cross_entropy(self.head(h), y) + 0.01 * l_aux


def _global_names(model: Net, ep: int) -> dict[str, torch.Tensor]:
    """Parameters by name, a local expert ``i`` renamed to its global index."""
    local = model.moe.num_local_experts
    first = (dist.get_rank() % ep) * local
    out = {}
    for n, p in model.named_parameters():
        parts = n.split(".")
        if "deepspeed_experts" in parts:
            at = parts.index("deepspeed_experts") + 1
            parts[at] = str(first + int(parts[at]))
        out[".".join(parts)] = p.detach().clone()
    return out


def _train(group, stage: int, ep: int, gate: str, steps: int, param_groups: bool, deferred: bool,
           init: bool = False, perturb: bool = True) -> dict:
    rank = dist.get_rank(group)
    if init:  # built in zero.Init: the expert's copies made from its gathered values
        with zerodp.zero.Init(data_parallel_group=group):  # rank 0's values everywhere: copies left alike
            model = Net(ep, gate, perturb=False)
    elif deferred:  # made before torch.distributed is up: initialize joins the groups
        with mock.patch("torch.distributed.is_initialized", return_value=False):
            model = Net(ep, gate)
        assert ep == 1 or not hasattr(next(model.moe.deepspeed_moe.experts.parameters()), "_zerodp_expert_axes")
    else:
        model = Net(ep, gate, perturb=perturb)
    params = (split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"}) if param_groups else model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**9, "gradient_clipping": 1.0,
           "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    engine, _, _, _ = zerodp.initialize(model=model, model_parameters=params, config=cfg, process_group=group)
    g = torch.Generator().manual_seed(11 + rank)
    losses, norms = [], []
    for step in range(steps):
        x, y = torch.randn(BATCH, 6, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)
        torch.manual_seed(100 + step)  # the gates' noise: the same draws at every expert-parallel size
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    with zerodp.zero.GatheredParameters(list(engine.module.parameters())):
        params_out = _global_names(engine.module, ep)
    counts = engine.comm_stats(by_group=True)
    engine.destroy()
    return {"losses": losses, "norms": norms, "params": params_out, "groups": sorted(counts)}


def train_against_ep1(group, stage: int, ep: int, gate: str, steps: int = 3, param_groups: bool = False,
                      deferred: bool = False, init: bool = False) -> dict:
    return {"split": _train(group, stage, ep, gate, steps, param_groups, deferred, init),
            "whole": _train(group, stage, 1, gate, steps, param_groups, False, perturb=not init)}

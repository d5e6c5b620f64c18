"""Expert parallelism for Hugging Face mixture-of-experts models (transformers 5's fused experts).

transformers 5 keeps a layer's experts as one module whose parameters are 3-D, one slice per expert
(``Qwen3MoeExperts``, ``MixtralExperts``, ...: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``),
called by the layer's own router as ``experts(hidden_states, top_k_index, top_k_weights)``.
:func:`expert_parallelize` splits each such module over an expert-parallel group in place: a rank
keeps its ``E / ep`` slices under the same parameter names, and the module's forward sends each
token's rows to the ranks of its experts, runs the module's own computation there on its local
experts (each row weighted 1) and combines the outputs it gets back with the router's weights. The
router is the model's own, so routing is exactly the model's: no capacity, no dropped tokens.
The exchanges are ``expert.py``'s; so is what ZeRO does with the expert parameters.
"""
from __future__ import annotations

import contextlib
import types
import weakref
from typing import Optional

import torch
from torch import nn

from ..core.init_shards import full_shape, gathered, init_shard, shard_in_place
from .expert import _COMM_ATTR, ExpertParallelError, initialize_expert_parallel, mark_expert_params, route
from .tensor import REPLACED_ATTR


def fused_experts_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that hold all of a layer's experts as 3-D parameters: a
    ``num_experts`` attribute and every direct parameter with that many slices along dimension 0."""
    found = []
    for m in model.modules():
        n = getattr(m, "num_experts", None)
        shapes = [full_shape(p) for p in m.parameters(recurse=False)]  # built in zero.Init: its ds_shape
        if isinstance(n, int) and n > 1 and shapes and all(len(s) == 3 and s[0] == n for s in shapes):
            found.append(m)
    return found


def expert_parallelize(model: nn.Module, ep_size: int) -> list[nn.Module]:
    """Split every fused-experts module of ``model`` over expert-parallel groups of ``ep_size``
    consecutive ranks (see the module docstring), before ``initialize``; returns the modules split."""
    modules = fused_experts_modules(model)
    if not modules:
        raise ExpertParallelError(f"expert parallelism: {type(model).__name__} has no fused-experts module (a "
                                  "module with num_experts and 3-D parameters of that many slices, as transformers "
                                  "5's MoE models have)")
    if ep_size == 1:
        return []
    axes = initialize_expert_parallel(ep_size)
    for m in modules:
        n = m.num_experts
        if n % ep_size:
            raise ExpertParallelError(f"expert-parallel size {ep_size} does not divide the {n} experts of "
                                      f"{type(m).__name__}")
        per = n // ep_size
        lo = axes.expert.rank * per
        for name, p in list(m.named_parameters(recurse=False)):
            built_in_init = init_shard(p) is not None
            with gathered([p], None) if built_in_init else contextlib.nullcontext():
                local = nn.Parameter(p.detach()[lo:lo + per].clone(), requires_grad=p.requires_grad)
            if built_in_init:  # the slice kept as one, over the ranks holding it
                shard_in_place(local, axes.expert_data.comm(label="expert_data"))
            m.register_parameter(name, local)
            # an optimizer built before initialize (the Trainer's) holds the whole one: it gets the slice
            m.__dict__.setdefault(REPLACED_ATTR, []).append((weakref.ref(p), local))
        mark_expert_params(m.parameters(recurse=False), axes, ep_size)
        m.num_experts, m.ep_size, m.ep_rank, m.global_num_experts = per, ep_size, axes.expert.rank, n
        m.comm = axes.expert.comm(label="expert")
        setattr(m, _COMM_ATTR, True)
        m.forward = types.MethodType(_forward, m)
    return modules


def _forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """An expert-parallel fused-experts module's forward (see the module docstring)."""
    def run(tokens: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:  # the module's own, weight 1
        local = torch.cat([torch.full((c,), i, dtype=torch.long) for src in counts for i, c in enumerate(src)]
                          or [torch.zeros(0, dtype=torch.long)]).to(tokens.device)
        return type(self).forward(self, tokens, local.unsqueeze(-1),
                                  torch.ones(local.shape[0], 1, dtype=tokens.dtype, device=tokens.device))

    return route(self.comm, hidden_states, top_k_index, top_k_weights, self.global_num_experts, self.ep_rank, run)


def autoep(model: nn.Module, config) -> list[nn.Module]:
    """The config's ``expert_parallel`` block (DeepSpeed's AutoEP) applied to ``model``: its preset and
    routing keys checked against the model (its own router routes), then :func:`expert_parallelize`."""
    from ..config import ConfigError
    from ..config.parallel import AUTOEP_PRESETS
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    model_type = getattr(text, "model_type", None)
    if config.preset_model is not None and model_type not in AUTOEP_PRESETS[config.preset_model]:
        raise ConfigError(f"expert_parallel.preset_model: '{config.preset_model}' is for "
                          f"{', '.join(AUTOEP_PRESETS[config.preset_model])} models; this model is "
                          f"{model_type or type(model).__name__}")
    k = getattr(text, "num_experts_per_tok", None)
    if config.top_k != "auto" and k is not None and config.top_k != k:
        raise ConfigError(f"expert_parallel.top_k: {config.top_k}, but the model's router picks {k} experts "
                          "(num_experts_per_tok); zerodp routes with the model's own router: leave it \"auto\"")
    norm = getattr(text, "norm_topk_prob", None)
    if config.route_norm is not None and norm is not None and config.route_norm != norm:
        raise ConfigError(f"expert_parallel.route_norm: {config.route_norm}, but the model's norm_topk_prob is "
                          f"{norm}; zerodp routes with the model's own router: leave it null")
    return expert_parallelize(model, config.autoep_size)


def local_expert_range(module: nn.Module) -> Optional[range]:
    """The global experts a split fused-experts module holds on this rank (None: not split)."""
    if getattr(module, _COMM_ATTR, None) is None or not hasattr(module, "ep_rank"):
        return None
    return range(module.ep_rank * module.num_experts, (module.ep_rank + 1) * module.num_experts)

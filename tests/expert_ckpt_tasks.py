"""Worker tasks for ``test_expert_checkpoint.py``: models with experts split over expert-parallel
ranks trained a few steps, saved, and loaded into another expert-parallel size, ZeRO stage or world
size; every parameter reported whole under its name in the model without expert parallelism."""
from __future__ import annotations

import torch
import torch.distributed as dist

import zerodp

BATCH = 2


def _model(kind: str, ep: int):
    """The model and the config keys that split it: transformers' Qwen3-MoE (fused experts, split by
    the config's ``expert_parallel`` block), DeepSpeed's MoE layer, or ``ExpertParallelMoE``."""
    if kind == "qwen3":
        from expert_tasks import _qwen3_moe
        block = {"expert_parallel": {"enabled": True, "autoep_size": ep}} if ep > 1 else {}
        return _qwen3_moe(), block
    if kind == "deepspeed":
        from moe_layer_tasks import Net
        return Net(ep, "top2"), {}
    from expert_tasks import ToyMoE
    return ToyMoE(ep), {}


def _batch(kind: str, step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "deepspeed":
        return (torch.randn(6, 6, generator=g), torch.randint(0, 5, (6,), generator=g)), {}
    ids = torch.randint(0, 32, (BATCH, 3), generator=g)
    labels = torch.randint(0, 32, (BATCH, 3), generator=g)
    return ((), {"input_ids": ids, "labels": labels}) if kind == "qwen3" else ((ids, labels), {})


def _loss(kind, out):
    return out.loss if kind == "qwen3" else out


def whole_params(engine, group) -> dict[str, torch.Tensor]:
    """Every parameter whole, by its name in the model without expert parallelism (fused experts'
    slices joined in expert order), on every rank."""
    from zerodp.parallel.expert_hf import local_expert_range
    view = engine.checkpoint_view()
    experts = view.experts
    names = experts.names_on(experts.ep_rank) if experts is not None else {}
    sliced = {f"{prefix}.{n}" for prefix, m in engine.module.named_modules()
              if local_expert_range(m) is not None for n, _ in m.named_parameters(recurse=False)}
    with zerodp.zero.GatheredParameters(list(engine.module.parameters())):
        mine = {names.get(n, n): (p.detach().clone(), experts.ep_rank if n in sliced else None)
                for n, p in engine.module.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    slices: dict[str, dict[int, torch.Tensor]] = {}
    for part in [mine] if dist.get_world_size(group) == 1 else _gather(mine, group):
        for n, (t, at) in part.items():
            if at is None:
                out[n] = t
            else:
                slices.setdefault(n, {})[at] = t
    for n, parts in slices.items():
        out[n] = torch.cat([parts[i] for i in sorted(parts)])
    return out


def _gather(obj, group):
    got = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, obj, group=group)
    return got


def train(group, kind: str, stage: int, ep: int, steps: int, save: str = "", save_at: int = 0,
          load: str = "", start: int = 0) -> dict:
    """Steps ``start`` to ``steps`` (after loading ``load`` if given; saving into ``save`` after step
    ``save_at``); the losses of those steps and the parameters after them, whole."""
    rank = dist.get_rank(group)
    model, block = _model(kind, ep)
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**9, "gradient_clipping": 1.0,
           "optimizer": {"type": "Adam", "params": {"lr": 0.02}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}, **block}
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, process_group=group)
    if load:
        path, _ = engine.load_checkpoint(load)
        assert path is not None
    losses = []
    for step in range(start, steps):
        args, kwargs = _batch(kind, step, rank)
        torch.manual_seed(100 + step)
        loss = _loss(kind, engine(*args, **kwargs))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if save and step + 1 == save_at:
            engine.save_checkpoint(save, tag="t")
    params = whole_params(engine, group)
    whole16 = engine._consolidated_16bit_state_dict() if ep > 1 else {}  # what save_16bit_model writes
    engine.destroy()
    return {"losses": losses, "params": params, "whole16": whole16}

"""Worker tasks for ``test_muon.py``: the example GPT trained with the config's Muon (and its AdamW
half), and the one-process reference of the same math on the global batch."""
from __future__ import annotations

import torch
import torch.distributed as dist

import zerodp
from zerodp.examples.gpt import Block, build_gpt
from zerodp.optim.muon_math import orthogonalize

STEPS, MICRO, SEQ = 5, 2, 24
PARAMS = {"lr": 0.01, "muon_lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9, "weight_decay": 0.05,
          "betas": [0.9, 0.98], "eps": 1e-8}


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 256, (MICRO, SEQ), generator=g)


def model(heads: int | None = None):
    """The tiny example GPT; ``heads``: its first attention projection orthogonalized head by head."""
    torch.manual_seed(0)
    net = build_gpt("tiny", dropout=0.0, bias=False)
    if heads is not None:
        net.blocks[0].attn.c_attn.weight.muon_num_heads = heads
    return net


def config(stage: int, params: dict | None = None, bucket: int = 30_000, clip: float = 0.0, extra: dict | None = None,
           **zero) -> dict:
    return {**(extra or {}), "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": clip,
            "steps_per_print": 10_000,
            "optimizer": {"type": "Muon", "params": dict(PARAMS if params is None else params)},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                  "stage3_param_persistence_threshold": 0, **zero}}


def reference(world: int | list, steps: int = STEPS, params: dict | None = None, clip: float = 0.0,
              forget_at: int | None = None, heads: int | None = None) -> dict:
    """One process, the whole global batch: DeepSpeed's Muon (momentum, Nesterov blend, the
    orthogonalized whole matrix, decoupled weight decay) for each matrix whose name has neither
    ``embed`` nor ``lm_head``, torch's AdamW for the rest; the gradient norm clipped first.
    ``world``: the ranks whose batches make the global batch, or a list of it per step;
    ``forget_at``: the Muon momentum starts again from zero at that step."""
    worlds = list(world) if isinstance(world, (list, tuple)) else [world] * steps
    steps = len(worlds)
    params = dict(PARAMS if params is None else params)
    net = model(heads)
    muon = [p for n, p in net.named_parameters() if p.dim() >= 2 and "embed" not in n and "lm_head" not in n]
    adam = [p for p in net.parameters() if all(p is not q for q in muon)]
    mlr, beta, wd = params.get("muon_lr", params.get("lr", 0.02)), params.get("momentum", 0.95), \
        params.get("weight_decay", 0.0)
    opt = torch.optim.AdamW(adam, lr=params.get("adam_lr", params.get("lr", 3e-4)),
                            betas=tuple(params.get("betas", (0.9, 0.95))), eps=params.get("eps", 1e-10),
                            weight_decay=wd)
    bufs = [torch.zeros_like(p) for p in muon]
    losses = []
    for step in range(steps):
        net.zero_grad()
        idx = torch.cat([batch(step, r) for r in range(worlds[step])])
        _, loss = net(idx, idx)
        loss.backward()
        losses.append(loss.item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        with torch.no_grad():
            if step == forget_at:
                for buf in bufs:
                    buf.zero_()
            for p, buf in zip(muon, bufs):
                buf.lerp_(p.grad, 1 - beta)
                update = p.grad.lerp(buf, beta)
                o = orthogonalize(update.reshape(-1), p.shape, ns_method=params.get("ns_method", "gram"),
                                  num_heads=getattr(p, "muon_num_heads", None))
                p.mul_(1 - mlr * wd).add_(o.view(p.shape), alpha=-mlr)
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in net.named_parameters()}, "losses": losses}


def gathered(engine) -> dict:
    """Every parameter whole (gathered at stage 3; a tensor-parallel split's slices joined)."""
    from tp_tasks import whole_params
    return whole_params(engine)


def train(group, stage: int, steps: int = STEPS, params: dict | None = None, clip: float = 0.0,
          bucket: int = 30_000, load: str | None = None, save: str | None = None, extra: dict | None = None,
          bf16: bool = False, heads: int | None = None, plain: bool = False, **zero) -> dict:
    """``steps`` steps of the example GPT at ``stage`` on this rank's part of the global batch;
    the parameters, the losses (averaged over ranks), what the engine counted of Muon's
    exchange, and the optimizer's share of the orthogonalization. ``load``: resume from the
    checkpoint there first (its steps count on); ``save``: save one there at the end; ``extra``: more
    of the config (a tensor-parallel block: the group is then the world); ``plain``: a plain PyTorch loop
    (``loss.backward(); optimizer.step(); optimizer.zero_grad()`` on what ``initialize`` returned)."""
    cfg = config(stage, params, bucket, clip, extra=dict(extra or {}, bf16={"enabled": bf16}), **zero)
    try:
        engine, opt, _, _ = zerodp.initialize(model=model(heads), config=cfg, unit_classes=(Block,),
                                              process_group=None if "tensor_parallel" in cfg else group)
    except (ValueError, zerodp.ConfigError) as e:
        return {"error": str(e)}
    rank = engine.get_data_parallel_rank()
    if load is not None:
        engine.load_checkpoint(load)
    first = engine.global_steps
    losses, comm = [], []
    for step in range(first, first + steps):
        _, loss = engine(batch(step, rank), batch(step, rank))
        if plain:
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            engine.backward(loss)
            engine.step()
        mean = loss.detach().float()
        dist.all_reduce(mean, group=group)
        losses.append(mean.item() / dist.get_world_size(group))
        comm.append(dict(engine.comm.counter.last_step))
    if save is not None:
        engine.save_checkpoint(save)
    out = {"params": gathered(engine), "losses": losses, "comm": comm, "work": opt.work(),
           "groups": [(g["name"], g["use_muon"], g["lr"]) for g in opt.param_groups],
           "ns_methods": [g["ns_method"] for g in opt.param_groups if g["use_muon"]]}
    engine.destroy()
    return out


def _torch_muon_model():
    net = model()
    matrices = [p for p in net.parameters() if p.dim() == 2]
    for p in net.parameters():
        p.requires_grad_(p.dim() == 2)
    return net, matrices


def reference_torch_muon(world: int, steps: int = 3) -> dict:
    """One process: ``torch.optim.Muon`` on the model's matrices (the rest frozen), the global batch."""
    net, matrices = _torch_muon_model()
    opt = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.05, adjust_lr_fn="match_rms_adamw")
    for step in range(steps):
        opt.zero_grad()
        idx = torch.cat([batch(step, r) for r in range(world)])
        net(idx, idx)[1].backward()
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def train_torch_muon(group, stage: int, steps: int = 3) -> dict:
    """The same with a ``torch.optim.Muon`` passed to ``initialize``."""
    rank = dist.get_rank(group)
    net, matrices = _torch_muon_model()
    opt = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.05, adjust_lr_fn="match_rms_adamw")
    cfg = config(stage)
    del cfg["optimizer"]
    engine, *_ = zerodp.initialize(model=net, optimizer=opt, config=cfg, process_group=group)
    for step in range(steps):
        _, loss = engine(batch(step, rank), batch(step, rank))
        engine.backward(loss)
        engine.step()
    out = gathered(engine)
    engine.destroy()
    return out


def pipeline_reference(dp: int, steps: int, gas: int) -> dict:
    """``pp_tasks``' model as one module on one process, the global batch of ``dp`` ranks x ``gas``
    micro-batches, clipped at 0.5, ``pp_tasks.MUON``'s Muon and AdamW (DeepSpeed's defaults besides)."""
    import pp_tasks as pt
    cfg = pt.MUON
    net = pt.build(1)
    named = list(net.named_parameters())
    muon = [p for n, p in named if p.dim() >= 2 and "embed" not in n and "lm_head" not in n]
    adam = [p for n, p in named if all(p is not q for q in muon)]
    opt = torch.optim.AdamW(adam, lr=cfg["adam_lr"], betas=(0.9, 0.95), eps=1e-10, weight_decay=cfg["weight_decay"])
    bufs = [torch.zeros_like(p) for p in muon]
    beta, lr, wd = cfg["momentum"], cfg["muon_lr"], cfg["weight_decay"]
    for step in range(steps):
        net.zero_grad(set_to_none=True)
        parts = [pt.loss_fn(net(x), y) for r in range(dp) for x, y in (pt.micro_batch(step, r, m) for m in range(gas))]
        (sum(parts) / len(parts)).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        with torch.no_grad():
            for p, buf in zip(muon, bufs):
                buf.lerp_(p.grad, 1 - beta)
                update = orthogonalize(p.grad.lerp(buf, beta).reshape(-1), p.shape).view(p.shape)
                p.mul_(1 - lr * wd).add_(update, alpha=-lr)
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def expert_run(group, stage: int, ep: int, steps: int = 3) -> dict:
    """``expert_tasks``' mixture of experts with Muon, its experts over ``ep`` ranks: the parameters,
    every expert's gathered from the rank holding it."""
    import expert_tasks as et
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = {"train_micro_batch_size_per_gpu": et.BATCH, "steps_per_print": 10**9, "gradient_clipping": 1.0,
           "optimizer": {"type": "Muon", "params": {"muon_lr": 0.05, "adam_lr": 0.01}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    engine, opt, _, _ = zerodp.initialize(model=et.ToyMoE(ep), config=cfg, process_group=group)
    for batch in et._batches(steps, world):
        loss = engine(*batch[rank])
        engine.backward(loss)
        engine.step()
    out = {"params": gathered(engine), "local": engine.module.moe.local, "work": opt.work()}
    engine.destroy()
    return out


def monitored(group, directory: str) -> list[dict]:
    """Two steps at stage 2 with the CSV monitor on: rank 0's rows."""
    import csv
    import os
    rank = dist.get_rank(group)
    cfg = config(2)
    cfg["csv_monitor"] = {"enabled": True, "output_path": directory, "job_name": "muon"}
    engine, *_ = zerodp.initialize(model=model(), config=cfg, process_group=group)
    for step in range(2):
        _, loss = engine(batch(step, rank), batch(step, rank))
        engine.backward(loss)
        engine.step()
    engine.destroy()
    if rank != 0:
        return []
    with open(os.path.join(directory, "muon", "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))

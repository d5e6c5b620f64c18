"""Worker tasks for ``test_plain_loop.py``: the engine and optimizer ``zerodp.initialize`` returns,
driven by a plain PyTorch loop (``loss.backward(); optimizer.step(); optimizer.zero_grad()``)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from parity_model import batch, build_model, gathered_params, make_config, param_groups, use_branch

import zerodp


def plain_train(group, stage: int, steps: int, gas: int = 1, clip: float = 0.0, no_sync: bool = False,
                scheduler: bool = False, optimizer: str = "AdamW") -> dict:
    """``gas`` micro-batches per optimizer step, each ``(loss / gas).backward()``; the config
    says gradient_accumulation_steps 1 (the loop decides when to step)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    model = build_model()
    cfg = make_config(stage, world, gas=1, clip=clip, bucket=60, optimizer=optimizer)
    engine, opt, _, _ = zerodp.initialize(model=model, model_parameters=param_groups(model), config=cfg,
                                          process_group=group)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if scheduler else None
    norms, lrs = [], []
    for step in range(steps):
        for m in range(gas):
            ctx = engine.no_sync() if no_sync and m < gas - 1 else _nothing()
            with ctx:
                loss = engine(*batch(step, rank, m), use_branch(step, rank, m, stage == 3))
                (loss / gas).backward()
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        norms.append(engine.get_global_grad_norm())
    out = {"params": gathered_params(engine), "norms": norms, "lrs": lrs, "global_steps": engine.global_steps,
           "applied": engine.was_step_applied()}
    engine.destroy()
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fp16_plain(group, scaled: bool) -> dict:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    model = build_model()
    cfg = make_config(2, world)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, opt, _, _ = zerodp.initialize(model=model, model_parameters=param_groups(model), config=cfg,
                                          process_group=group)
    loss = engine(*batch(0, rank, 0), False)
    (engine.scale(loss) if scaled else loss).backward()
    try:
        opt.step()
    except RuntimeError as e:
        return {"error": str(e)}
    finally:
        engine.destroy()
    return {"error": None, "steps": engine.global_steps}


def compiled_train(group, stage: int, steps: int, backend: str = "inductor") -> dict:
    """The parity model compiled with torch.compile before initialize, trained with
    engine.backward / engine.step; returns the parameters."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    torch._dynamo.reset()
    model = build_model() if backend == "none" else torch.compile(build_model(), backend=backend)
    cfg = make_config(stage, world, gas=2, clip=0.5, bucket=60)
    engine, *_ = zerodp.initialize(model=model, model_parameters=param_groups(model), config=cfg,
                                   process_group=group)
    for step in range(steps):
        for m in range(2):
            engine.backward(engine(*batch(step, rank, m), use_branch(step, rank, m, stage == 3)))
            engine.step()
    params = {n.replace("_orig_mod.", ""): p for n, p in gathered_params(engine).items()}
    engine.destroy()
    return {"error": None, "params": params, "norms": []}


def grads_after_step(group, stage: int) -> dict:
    """What ``.grad`` holds: after ``engine.backward`` (the reduced gradient), after ``engine.step()``
    (None, as in DeepSpeed), and after a backward then ``optimizer.zero_grad(set_to_none=False)``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    model = build_model()
    engine, opt, _, _ = zerodp.initialize(model=model, model_parameters=param_groups(model),
                                          config=make_config(stage, world), process_group=group)
    params = [p for p in model.parameters() if p.requires_grad]
    loss = engine(*batch(0, rank, 0), False)
    engine.backward(loss)
    after_backward = sum(p.grad is not None for p in params)
    engine.step()
    after_step = sum(p.grad is not None for p in params)
    engine(*batch(1, rank, 0), False).backward()
    opt.zero_grad(set_to_none=False)
    kept = [p.grad for p in params if p.grad is not None]
    out = {"params": len(params), "after_backward": after_backward, "after_step": after_step,
           "kept": len(kept), "kept_zero": all(bool((g == 0).all()) for g in kept)}
    engine.destroy()
    return out

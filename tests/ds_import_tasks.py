"""Worker tasks: zerodp resumes training from DeepSpeed's checkpoints (``ds_checkpoint_writer.py``),
and the single-process reference it is compared with.

DeepSpeed trained on 2 ranks with ``gas`` micro-batches each: the global batch of step ``s``
is ``parity_model.batch(s, r, m)`` for ``r < 2, m < gas``. zerodp continues at world size
``W`` with ``2 * gas / W`` micro-batches per rank over exactly those batches.
"""
from __future__ import annotations

import warnings

import parity_model as pm
import torch
import torch.distributed as dist
from ds_checkpoint_writer import build_model, ds_config
from parity_model import gathered_params
from precision_tasks import DTYPES, gathered_masters, master_update

import zerodp
from zerodp.optim.schedules import WarmupLR

DS_WORLD = 2


def zerodp_config(stage: int, dtype: str, gas_ds: int, world: int) -> dict:
    ds = ds_config(stage, dtype if dtype != "fp16" else "fp32", gas_ds, DS_WORLD, {})
    cfg = {"train_batch_size": pm.MICRO * gas_ds * DS_WORLD, "train_micro_batch_size_per_gpu": pm.MICRO,
           "gradient_clipping": ds["gradient_clipping"], "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": dict(pm.ADAMW)},
           "scheduler": ds["scheduler"],
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 50,
                                 "stage3_param_persistence_threshold": 1}}
    if dtype in ("bf16", "fp16"):
        cfg[dtype] = {"enabled": True}
        cfg["communication_data_type"] = "fp32"
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def gathered_states(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Every trainable parameter's full optimizer-state tensors, assembled from all ranks."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for g in engine.trainable:
        for key in ("exp_avg", "exp_avg_sq"):
            full = torch.zeros(g.padded_numel)
            if g.partitions > 1 or engine.dp_rank == 0:
                for pc, pp in zip(g.pieces, g.optim.leaves):
                    st = engine.optimizer.state.get(pp)
                    if st:
                        lo = g.shard_lo + pc.shard_lo
                        full[lo:lo + pc.shard_hi - pc.shard_lo] = st[key]
            dist.all_reduce(full, group=engine.comm.group)
            for i, slot in enumerate(g.slots):
                out.setdefault(slot.name, {})[key] = g.view(full, i).clone()
    return out


def resume_from_deepspeed(group, ckpt_dir: str, stage: int, dtype: str, gas_ds: int, more: int) -> dict:
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    torch.manual_seed(99)  # other initial weights than DeepSpeed's: the load must replace them
    model = build_model()
    engine, *_ = zerodp.initialize(model=model, model_parameters=pm.param_groups(model),
                                   config=zerodp_config(stage, dtype, gas_ds, world), process_group=group)
    path, client = engine.load_checkpoint(ckpt_dir)
    loaded = {"masters": gathered_masters(engine), "states": gathered_states(engine),
              "params": gathered_params(engine), "lr": engine.get_lr(), "global_steps": engine.global_steps,
              "buffers": {n: b.clone() for n, b in engine.module.named_buffers()},
              "loss_scale": engine.loss_scale, "skipped": engine.skipped_steps}
    steps_done, gas = engine.global_steps, engine.gradient_accumulation_steps()
    norms = []
    for s in range(steps_done, steps_done + more):
        for m in range(gas):
            r, mm = divmod(rank * gas + m, gas_ds)
            engine.backward(engine(*pm.batch(s, r, mm), True))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    out = {"path": path, "client": client, "loaded": loaded, "norms": norms,
           "masters": gathered_masters(engine), "params": gathered_params(engine)}
    engine.destroy()
    return out


def reference(dtype: str, gas_ds: int, phases: list[tuple[int, int]], start: dict | None = None) -> dict:
    """One process, on one thread. ``phases``: ``(world, steps)``; the global batch of every step
    is DeepSpeed's, split into ``2 * gas_ds / world`` micro-batch losses per rank (each scaled
    by 1/gas, as the engines do). ``start`` (DeepSpeed's dump: values and Adam moments, the step
    count and steps done) starts it from a checkpoint instead of from the initial weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(dtype, gas_ds, phases, start)
    finally:
        torch.set_num_threads(threads)


def _reference(dtype, gas_ds, phases, start):
    low = DTYPES[dtype]
    model = build_model()
    cfg = ds_config(1, "fp32", gas_ds, DS_WORLD, {})
    clip = cfg["gradient_clipping"]
    step = 0
    if start is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start["values"][n])
        step = start["steps_done"]
    model = model.to(low)
    groups = pm.param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in groups for p in g["params"]]
    masters = {id(p): (start["values"][names[id(p)]].clone() if start else p.detach().float().clone())
               .requires_grad_(True) for p in params}
    opt = torch.optim.AdamW([dict(g, params=[masters[id(p)] for p in g["params"]]) for g in groups],
                            **{k: tuple(v) if isinstance(v, list) else v for k, v in pm.ADAMW.items()})
    sched = WarmupLR(opt, **cfg["scheduler"]["params"])
    if start is not None:
        for p in params:
            opt.state[masters[id(p)]] = {"step": torch.tensor(float(start["step"])),
                                         "exp_avg": start["exp_avg"][names[id(p)]].clone(),
                                         "exp_avg_sq": start["exp_avg_sq"][names[id(p)]].clone()}
        with warnings.catch_warnings():  # the schedule is only advanced to the saved step
            warnings.simplefilter("ignore")
            for _ in range(step):
                sched.step()
    norms = []
    for world, steps in phases:
        gas = DS_WORLD * gas_ds // world
        for _ in range(steps):
            total: dict[int, torch.Tensor] = {}
            for r in range(DS_WORLD):
                for m in range(gas_ds):
                    model.zero_grad(set_to_none=True)
                    loss = model(*pm.batch(step, r, m), True)
                    (loss / gas if gas > 1 else loss).backward()
                    for p in params:
                        if p.grad is not None:
                            g = p.grad.float()
                            total[id(p)] = g.clone() if id(p) not in total else total[id(p)] + g
            norms.append(master_update(params, masters, total, world, clip, opt, sched))
            step += 1
    return {"masters": {names[k]: v.detach().clone() for k, v in masters.items()}, "norms": norms,
            "lr": [g["lr"] for g in opt.param_groups]}

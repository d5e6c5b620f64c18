"""Writes real DeepSpeed checkpoints of the parity model, and DeepSpeed's own view of them.

Run under torchrun with 2 ranks on CPU (gloo)::

    DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/ds_checkpoint_writer.py OUT_DIR [NAME ...]

For every configuration in ``CONFIGS`` (ZeRO stages 1, 2, 3 in fp32 and bf16; bf16 with fp32
gradient accumulation, which DeepSpeed runs with its ``BF16_Optimizer``; stage 2 with
``elastic_checkpoint``; fp16 with a loss scale that overflows at first), or only the NAMEs
given (``OPTIONAL_CONFIGS`` too: DeepSpeed's own Adam kernels, which compile on first use),
the parity model (tied embedding/head, a frozen layer, two param groups, plus a persistent
and a non-persistent buffer) trains a few steps with torch's AdamW (``torch_adam``), gradient
clipping and a WarmupLR schedule. Every rank runs the branch (``use_branch=True``), so all
parameters get gradients at every stage. Then ``engine.save_checkpoint(OUT_DIR/NAME)`` writes
the checkpoint (tag ``global_stepN``, with a ``client_state``), and rank 0 writes beside it
what DeepSpeed itself reports, gathered across ranks:

* ``NAME.expect.safetensors``: ``<param>/value`` (``safe_get_full_fp32_param``, or the
  parameter itself for a frozen one), ``<param>/exp_avg`` and ``<param>/exp_avg_sq``
  (``safe_get_full_optimizer_state``), and ``buffer/<name>`` for the persistent buffers;
* ``NAME.expect.json``: tag, stage, dtype, world size, engine counters, gradient accumulation
  steps, the lr of every param group, the optimizer's step count, the scheduler state,
  parameter names (all, trainable, frozen, tied), buffer names, the loss scaler's fields.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import parity_model as pm  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

#: name -> (stage, dtype, gradient accumulation steps, training steps, extra config)
CONFIGS = {
    "z1_fp32": (1, "fp32", 1, 4, {}),
    "z1_bf16": (1, "bf16", 2, 3, {}),
    "z2_fp32": (2, "fp32", 2, 3, {}),
    "z2_bf16": (2, "bf16", 1, 4, {}),
    "z3_fp32": (3, "fp32", 1, 4, {}),
    "z3_bf16": (3, "bf16", 2, 3, {}),
    # bf16 with fp32 gradient accumulation at stage 1: DeepSpeed's BF16_Optimizer
    "z1_bf16_fp32acc": (1, "bf16", 1, 3, {"data_types": {"grad_accum_dtype": "fp32"}}),
    # the optimizer state written per group without padding ("elastic" layout)
    "z2_fp32_elastic": (2, "fp32", 1, 3, {"zero_optimization": {"elastic_checkpoint": True}}),
    # fp16 with a loss scale that overflows at first (skipped steps, hysteresis used up)
    "z2_fp16": (2, "fp16", 1, 5, {}),
}

#: Written only when named: DeepSpeed's own Adam kernels, compiled on first use (about a minute).
OPTIONAL_CONFIGS = {
    "z2_fp32_fusedadam": (2, "fp32", 1, 3, {"optimizer": {"params": {"torch_adam": False}}}),
    "z2_fp32_cpuadam": (2, "fp32", 1, 3, {"optimizer": {"params": {"torch_adam": False}},
                                          "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}),
    "z3_fp32_cpuadam": (3, "fp32", 1, 3, {"optimizer": {"params": {"torch_adam": False}},
                                          "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}),
}

CLIENT_STATE = {"note": "hello", "data_pos": 7}


def ds_config(stage: int, dtype: str, gas: int, world: int, extra: dict) -> dict:
    cfg = {
        "train_batch_size": pm.MICRO * gas * world,
        "train_micro_batch_size_per_gpu": pm.MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.5,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {**pm.ADAMW, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 8}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64},
    }
    if stage == 3:
        # several sub groups, and every parameter partitioned (none kept whole)
        cfg["zero_optimization"].update({"sub_group_size": 60, "stage3_param_persistence_threshold": 0})
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2}
    return merge(cfg, extra)


def merge(base: dict, extra: dict) -> dict:
    """``base`` with ``extra`` merged in, dicts recursively."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def build_model() -> torch.nn.Module:
    """The parity model with two buffers added: a persistent one (saved) and a non-persistent one."""
    model = pm.build_model()
    model.norm.register_buffer("running", torch.linspace(0.0, 1.0, pm.DIM))
    model.register_buffer("scratch", torch.ones(2), persistent=False)
    return model


def write_one(out_dir: Path, name: str, stage: int, dtype: str, gas: int, steps: int, extra: dict) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    rank, world = dist.get_rank(), dist.get_world_size()
    if dtype == "fp16":
        # DeepSpeed's CPU accelerator reports no fp16 support; torch's CPU kernels have it
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    model = build_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=pm.param_groups(model),
                                           config=ds_config(stage, dtype, gas, world, extra))
    for step in range(steps):
        for micro in range(gas):
            loss = engine(*pm.batch(step, rank, micro), True)
            engine.backward(loss)
            engine.step()
    engine.save_checkpoint(str(out_dir / name),
                           client_state={**CLIENT_STATE, "vec": torch.arange(3.)})

    relink = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if relink is not None:
        # ZeRO 1/2 links the optimizer-state views of the params after the first step() of
        # group 0, before the other groups have any state; link them again now.
        engine.optimizer._hp_optimizer_states_linked = False
        relink()
    tensors: dict[str, torch.Tensor] = {}
    trainable, frozen = [], []
    for pname, p in engine.module.named_parameters():
        if p.requires_grad:
            trainable.append(pname)
            value = safe_get_full_fp32_param(p)
            exp_avg = safe_get_full_optimizer_state(p, "exp_avg")
            exp_avg_sq = safe_get_full_optimizer_state(p, "exp_avg_sq")
            tensors[f"{pname}/value"] = value.detach().cpu().clone().contiguous()
            tensors[f"{pname}/exp_avg"] = exp_avg.detach().cpu().clone().contiguous()
            tensors[f"{pname}/exp_avg_sq"] = exp_avg_sq.detach().cpu().clone().contiguous()
        else:
            frozen.append(pname)
            with deepspeed.zero.GatheredParameters([p], enabled=stage == 3):
                tensors[f"{pname}/value"] = p.detach().cpu().clone().contiguous()
    persistent = [n for n in engine.module.state_dict() if n in dict(engine.module.named_buffers())]
    for bname, b in engine.module.named_buffers():
        if bname not in persistent:
            continue
        tensors[f"buffer/{bname}"] = b.detach().cpu().clone().contiguous()

    base = engine.optimizer.optimizer
    steps_seen = {float(s["step"]) for s in base.state.values() if "step" in s}
    tied = {}
    seen = {}
    for mname, module in engine.module.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if id(p) in seen:
                tied[full] = seen[id(p)]
            else:
                seen[id(p)] = full
    if rank == 0:
        save_file(tensors, str(out_dir / f"{name}.expect.safetensors"))
        meta = {
            "tag": f"global_step{engine.global_steps}", "stage": stage, "dtype": dtype, "world_size": world,
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "gas": gas,
            "lr": [float(x) for x in engine.get_lr()], "step": sorted(steps_seen),
            "lr_scheduler": engine.lr_scheduler.state_dict(),
            "names": [n for n, _ in engine.module.named_parameters()],
            "trainable": trainable, "frozen": frozen, "tied": tied,
            "buffers": persistent,
            "client_state": CLIENT_STATE,
        }
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        if scaler is not None:
            meta["loss_scaler"] = {k: v for k, v in vars(scaler).items()
                                   if v is None or isinstance(v, (bool, int, float))}
        (out_dir / f"{name}.expect.json").write_text(json.dumps(meta, indent=1))
    dist.barrier()
    engine.destroy()


def main() -> None:
    out_dir = Path(sys.argv[1])
    names = sys.argv[2:] or list(CONFIGS)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    for log in ("DeepSpeed", "deepspeed"):
        logging.getLogger(log).setLevel(logging.ERROR)
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        write_one(out_dir, name, *{**CONFIGS, **OPTIONAL_CONFIGS}[name])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

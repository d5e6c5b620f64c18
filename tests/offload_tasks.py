"""Worker tasks for the offload tests: the checkpoint tests' model, batches and reference
(``checkpoint_tasks.py``), trained with ``offload_optimizer`` / ``offload_param`` blocks."""
from __future__ import annotations

import os

from checkpoint_tasks import make_engine, snapshot, train_steps


def zero_block(offload: str | None, nvme_dir: str | None = None, params: bool = False,
               sub_group_size: int | None = None) -> dict:
    """The ``zero_optimization`` keys of an offload setting: None, "cpu" or "nvme" (with
    ``params``, stage 3's parameter shards go to the same place)."""
    if offload is None:
        return {}
    opt = {"device": offload, "pin_memory": True}
    if offload == "nvme":
        opt["nvme_path"] = nvme_dir
    out = {"offload_optimizer": opt}
    if params:
        out["offload_param"] = dict(opt)
    if sub_group_size:
        out["sub_group_size"] = sub_group_size
    return out


def _swap_dirs(engine) -> list[str]:
    off = engine.offload
    if off is None:
        return []
    swaps = (off.swap, engine.param_offload.swap if engine.param_offload is not None else None)
    return sorted({str(s.dir) for s in swaps if s is not None})


def train_task(group, stage: int, dtype: str, steps: int, zero: dict, save_dir: str | None = None,
               async_save: bool = False) -> dict:
    """Train ``steps`` steps (then save to ``save_dir``); the masters, parameters and norms."""
    engine = make_engine(group, stage, dtype, zero=dict(zero))
    norms = train_steps(engine, 0, steps)
    if save_dir is not None:
        engine.save_checkpoint(save_dir, async_save=async_save)
        engine.wait_for_checkpoint()
    out = snapshot(engine)
    out["norms"] = norms
    out["memory"] = engine.memory_breakdown()
    swap = _swap_dirs(engine)
    out["swap_files"] = sorted(f for d in swap for f in os.listdir(d))
    engine.destroy()
    out["swap_left"] = [d for d in swap if os.path.exists(d)]
    return out


def resume_task(group, stage: int, dtype: str, zero: dict, load_dir: str, first: int, last: int) -> dict:
    """A fresh engine (other initial weights) loaded from ``load_dir`` and trained to ``last``."""
    engine = make_engine(group, stage, dtype, seed=123, zero=dict(zero))
    engine.load_checkpoint(load_dir)
    loaded = snapshot(engine)
    norms = train_steps(engine, first, last)
    out = snapshot(engine)
    out.update(norms=norms, loaded=loaded)
    engine.destroy()
    return out

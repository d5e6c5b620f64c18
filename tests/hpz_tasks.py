"""Worker tasks for ``test_hpz.py``: ZeRO++ hpZ (``zero_hpz_partition_size``) at stage 3 on the
parity model, against one process and against plain stage 3, with what each phase of a step sent
over which group and what a rank holds."""
from __future__ import annotations

import torch.distributed as dist
from parity_model import batch, build_model, gathered_params, make_config, on, param_groups, use_branch

import zerodp


def _gathered(engine) -> dict[str, int]:
    """All-gather bytes sent so far in the step in progress, by group."""
    return {group: n for (group, kind), n in engine.comm.counter.current.items() if kind == "all_gather"}


def train(group, hpz: int, steps: int = 3, gas: int = 1, optimizer: str = "AdamW", zero: dict | None = None,
          save_dir: str = "", load_dir: str = "") -> dict:
    """The parity model at stage 3 (``hpz``: the secondary group's size, 1 for plain stage 3), ``steps``
    steps of ``gas`` micro-batches. Per step: the all-gather bytes each group had sent after each
    forward and backward, and ``comm_stats(by_group=True)``; the memory breakdown before the first
    update (the secondary copy alive) and after the last; the trained parameters. ``save_dir``/``load_dir``: save a
    checkpoint after training / load one before it."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    model = build_model()
    config = make_config(3, world, gas, optimizer=optimizer)
    config["zero_optimization"].update({"zero_hpz_partition_size": hpz, **(zero or {})})
    engine, *_ = zerodp.initialize(model=model, model_parameters=param_groups(model), config=config,
                                   process_group=group)
    if load_dir:
        engine.load_checkpoint(load_dir)
    phases, by_group, before_step = [], [], None
    for step in range(steps):
        seen = []
        for m in range(gas):
            loss = engine(*on(engine.device, batch(step, rank, m)), use_branch(step, rank, m, True))
            seen.append(("forward", m, _gathered(engine)))
            engine.backward(loss)
            seen.append(("backward", m, _gathered(engine)))
            if step == 0 and m == gas - 1:
                before_step = engine.memory_breakdown()
            engine.step()
        phases.append(seen)
        by_group.append(engine.comm_stats(by_group=True))
    after = engine.memory_breakdown()  # after the last update, before anything gathers again
    k = engine.grid.secondary.size if engine.grid.secondary is not None else 1
    frozen = [g for g in engine.flat_groups if not g.trainable]
    out = {"phases": phases, "by_group": by_group, "before_step": before_step, "after_step": after,
           "grid": engine.grid.describe(),
           # what the frozen groups' copies hold, and what gathering them within the k ranks sends
           "frozen_copy": sum(g.padded_numel * g.full.element_size() // k for g in frozen) if k > 1 else 0,
           "frozen_gather": sum(g.padded_numel * g.full.element_size() * (k - 1) // k for g in frozen),
           "full_bytes": sum(g.padded_numel * g.full.element_size() for g in engine.flat_groups),
           "params": gathered_params(engine)}
    if save_dir:
        engine.save_checkpoint(save_dir)
    engine.destroy()
    return out


def refused(group, stage: int, zero: dict) -> str:
    """The error ``initialize`` gives for a config with hpZ where it does not apply."""
    model = build_model()
    config = make_config(stage, dist.get_world_size(group))
    config["zero_optimization"].update(zero)
    try:
        engine, *_ = zerodp.initialize(model=model, config=config, process_group=group)
    except ValueError as e:
        return str(e)
    engine.destroy()
    return "no error"

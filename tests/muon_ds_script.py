"""DeepSpeed's own Muon and zerodp's, side by side on the same ranks:

    torchrun --nproc-per-node 2 muon_ds_script.py OUT.json z0 z1 z2 z3

Each case ``z<stage>`` trains the example GPT (``muon_tasks``) 5 steps with the config's
``"optimizer": {"type": "Muon"}`` under real DeepSpeed (its ``MuonWithAuxAdam``; at stage 3 with
``reduce_scatter: false``, which its Muon needs), then under zerodp, from the same initial values
on the same batches; rank 0 reports both runs' losses and the largest relative difference of a
parameter between them. DeepSpeed compiles its Muon update; here it runs eagerly (the same
arithmetic without inductor's roundings, and without minutes of compiling on a CPU).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import muon_tasks as mt  # noqa: E402
import torchrun_cases  # noqa: E402


def _train(lib, stage: int, steps: range = range(mt.STEPS), load: str | None = None,
           save: str | None = None) -> tuple[list[float], dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = mt.config(stage, reduce_scatter=stage != 3)
    cfg["zero_allow_untested_optimizer"] = True
    engine, *_ = lib.initialize(model=mt.model(), model_parameters=None, config=cfg)
    if load is not None:
        engine.load_checkpoint(load)
    losses = []
    for step in steps:
        _, loss = engine(mt.batch(step, rank), mt.batch(step, rank))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if save is not None:
        engine.save_checkpoint(save)
    with lib.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return losses, params


def run_case(case: str, out_dir: str) -> dict:
    import deepspeed

    import zerodp
    stage = int(case[-1])
    if case.startswith("resume-"):  # 3 steps under DeepSpeed, its checkpoint, 2 more under zerodp
        where = os.path.join(out_dir, f"deepspeed-{case}")
        _train(deepspeed, stage, range(3), save=where)
        losses, params = _train(zerodp, stage, range(3, mt.STEPS), load=where)
        if dist.get_rank() == 0:
            torch.save(params, where + ".params.pt")
        return {"zerodp": losses, "params": where + ".params.pt"}
    theirs, their_params = _train(deepspeed, stage)
    ours, our_params = _train(zerodp, stage)
    gap = max(((our_params[n] - p).norm() / p.norm()).item() for n, p in their_params.items())
    return {"deepspeed": theirs, "zerodp": ours, "gap": gap}


if __name__ == "__main__":
    torch.set_num_threads(1)
    torch.compiler.set_stance("force_eager")
    dist.init_process_group("gloo")
    torchrun_cases.serve(run_case)

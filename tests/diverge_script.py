"""A 2-rank stage-3 job whose ranks stop running the same modules once prefetching is under way:

    torchrun --nproc-per-node 2 diverge_script.py DIR

Two steps agree, so the order of units is recorded and prefetched from; in the third, rank 0
runs a branch that rank 1 skips. Every rank must raise the error that names what each ran, and
the job must end instead of hanging, although the rank that kept to the plan may have started
collectives its peer never joins. Each rank writes ``step S: ...`` to ``DIR/rankR.txt`` and,
before raising, waits (up to a minute) for the other rank's file: torchrun stops the other
ranks as soon as one fails, which would otherwise race with the other rank's own error.
"""
import os
import sys
import time

import torch.distributed as dist
from parity_model import batch, build_model, make_config

import zerodp

out_dir = sys.argv[1]
cfg = make_config(3, 2)
cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 1
engine, _, _, _ = zerodp.initialize(model=build_model(), config=cfg)
rank, world = dist.get_rank(), dist.get_world_size()
for step in range(3):
    try:
        loss = engine(*batch(step, rank, 0), rank == 0 and step == 2)
    except RuntimeError as e:
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"step {step}: {e}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(os.listdir(out_dir)) < world:
            time.sleep(0.1)
        raise
    engine.backward(loss)
    engine.step()
print(f"rank {rank}: no error", flush=True)

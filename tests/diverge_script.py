"""A 2-rank stage-3 job whose ranks stop running the same modules once prefetching is under way:

    torchrun --nproc-per-node 2 diverge_script.py

Two steps agree, so the order of units is recorded and prefetched from; in the third, rank 0
runs a branch that rank 1 skips. Every rank must raise the error that names what each ran
(each prints it as ``rank R step S: ...``) and the job must end instead of hanging, although the
rank that kept to the plan may have started collectives its peer never joins.
"""
import torch.distributed as dist
from parity_model import batch, build_model, make_config

import zerodp

cfg = make_config(3, 2)
cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 1
engine, _, _, _ = zerodp.initialize(model=build_model(), config=cfg)
rank = dist.get_rank()
for step in range(3):
    try:
        loss = engine(*batch(step, rank, 0), rank == 0 and step == 2)
    except RuntimeError as e:
        print(f"rank {rank} step {step}: {e}", flush=True)
        raise
    engine.backward(loss)
    engine.step()
print(f"rank {rank}: no error", flush=True)

"""Eight ranks: pipeline 2 x tensor parallel 2 x data parallel 2 (``pp_tasks``' model, its MLP
blocks split by a ``partition_config``).

    torchrun --nproc-per-node 8 grid3d_script.py OUT.json CKPT_DIR STAGE...

For each ZeRO stage every rank trains ``pp_tasks.train`` on the 3-D grid; rank 0 and rank 4 (the
first rank of each pipeline stage) write their parameters' largest difference from one process
(``pp_tasks.reference`` over the 2 data-parallel ranks' batches), the norms and losses of both.
The last stage's run ends with a checkpoint in CKPT_DIR.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pp_tasks  # noqa: E402

STEPS, GAS = 2, 4


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    found = {}
    stages = list(map(int, sys.argv[3:]))
    for stage in stages:
        out = pp_tasks.train(None, 2, stage, STEPS, GAS, tp=2, save_to=sys.argv[2] if stage == stages[-1] else None)
        ref = pp_tasks.reference(2, STEPS, GAS)
        err = max((out["params"][n] - ref["params"][n]).abs().max().item() for n in out["params"])
        found[str(stage)] = {"max_err": err, "norms": out["norms"], "ref_norms": ref["norms"],
                             "losses": out["losses"], "ref_losses": ref["losses"], "names": sorted(out["params"]),
                             "tensor_bytes": out["comm"].get("tensor", {}).get("total", 0)}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, found)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

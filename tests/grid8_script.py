"""Eight ranks: tensor parallel 2 x hybrid sharding (shard 2 x replica 2) at ZeRO stage 3.

    torchrun --nproc-per-node 8 grid8_script.py OUT.json

Every rank trains ``tp_tasks.train`` on the grid; rank 0 writes its whole parameters' largest
difference from one process (``tp_tasks.reference`` over the 4 data-parallel ranks' batches),
the gradient norms of both, and the grid's groups as the engine saw them.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tp_tasks  # noqa: E402

STEPS, GAS, CLIP = 2, 2, 0.5


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = tp_tasks.train(None, "gpt", 3, 2, STEPS, gas=GAS, clip=CLIP, hybrid=2, optimizer_name="SGD")
    if dist.get_rank() == 0:
        ref = tp_tasks.reference("gpt", 4, STEPS, GAS, CLIP, "SGD")
        err = max((out["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"])
        with open(sys.argv[1], "w") as f:
            json.dump({"max_err": err, "norms": out["norms"], "ref_norms": ref["norms"],
                       "comm": out["comm"]}, f)
    sys.stdout.flush()
    os._exit(0)  # the result is written; no teardown for a gloo thread to abort in


if __name__ == "__main__":
    main()

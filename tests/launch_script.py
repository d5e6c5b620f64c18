"""A training script as a launcher sees it: ``zerodp launch ... launch_script.py [ARGS]``.

Every rank prints one line, ``LAUNCH_SCRIPT {json}``: its ``sys.argv``, ``sys.path[0]``,
``__name__``, the launcher's environment variables, and the sum over the ranks of ``rank + 1``
(a gloo all-reduce), in one write so that the ranks' lines do not interleave.
``LAUNCH_SCRIPT_EXIT=N`` in the environment: exit with code N after it.
``LAUNCH_SCRIPT_WAIT=1``: print ``LAUNCH_SCRIPT_READY <pid>`` instead and sleep until stopped.
"""
import json
import os
import sys
import time

if os.environ.get("LAUNCH_SCRIPT_WAIT") == "1":
    sys.stdout.write(f"LAUNCH_SCRIPT_READY {os.getpid()}\n")  # one write: lines of two ranks do not interleave
    sys.stdout.flush()
    while True:
        time.sleep(1)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")

if __name__ == "__main__":
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    line = "LAUNCH_SCRIPT " + json.dumps({
        "argv": sys.argv, "path0": sys.path[0], "name": __name__, "sum": total.item(),
        "env": {k: os.environ.get(k) for k in VARIABLES}})
    os.write(1, (line + "\n").encode())  # one write: the ranks share the pipe
    dist.destroy_process_group()
    sys.exit(int(os.environ.get("LAUNCH_SCRIPT_EXIT", "0")))

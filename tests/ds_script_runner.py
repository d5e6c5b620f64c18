"""Run one script several times in one torchrun launch, as ``python script.py ARGS`` would
(``runpy`` with ``__name__ == "__main__"``), once per argument list, so a test covers many
configs without paying a launch for each. Usage::

    torchrun --nproc-per-node 2 ds_script_runner.py SCRIPT RUNS.json

``RUNS.json``: a list of argument lists. Each run that returns appends a line to
``RUNS.json.rankR.done``; the process then ends with ``os._exit`` after flushing (gloo's
teardown may abort once all work is done).
"""
import gc
import json
import os
import runpy
import sys


def main() -> None:
    script, runs_path = sys.argv[1], sys.argv[2]
    with open(runs_path) as f:
        runs = json.load(f)
    rank = os.environ.get("RANK", "0")
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    for i, argv in enumerate(runs):
        sys.argv = [script, *argv]
        runpy.run_path(script, run_name="__main__")
        gc.collect()
        with open(f"{runs_path}.rank{rank}.done", "a") as f:
            f.write(f"{i}\n")
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

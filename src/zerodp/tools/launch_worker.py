"""One process of ``zerodp launch``: runs the training script as DeepSpeed's launcher does.

    python -m zerodp.tools.launch_worker [--no-local-rank] [--module] SCRIPT [ARGS...]

(torchrun starts it on every rank.) The script's arguments become ``SCRIPT --local_rank=<r>
ARGS...``, ``r`` being torchrun's ``LOCAL_RANK``: DeepSpeed's launcher puts the option right after
the script name, before the user's arguments (``--no-local-rank`` leaves them unchanged). The
script runs as ``__main__`` as ``python SCRIPT`` runs it (``sys.argv[0]`` its path, its
directory first on ``sys.path``), or as ``python -m SCRIPT`` with ``--module``. DeepSpeed's
``LOCAL_SIZE``, ``CROSS_RANK`` and ``CROSS_SIZE`` are set from torchrun's variables.
"""
from __future__ import annotations

import os
import runpy
import sys

FLAGS = ("--no-local-rank", "--module")


def script_argv(argv: list[str], local_rank: str) -> tuple[bool, list[str]]:
    """``(module, sys.argv for the script)`` from this worker's arguments."""
    flags = set()
    while argv and argv[0] in FLAGS:
        flags.add(argv[0])
        argv = argv[1:]
    if not argv:
        raise SystemExit(f"usage: python -m zerodp.tools.launch_worker [{'] ['.join(FLAGS)}] SCRIPT [ARGS...]")
    rank = [] if "--no-local-rank" in flags else [f"--local_rank={local_rank}"]
    return "--module" in flags, [argv[0], *rank, *argv[1:]]


def main() -> None:
    module, sys.argv = script_argv(sys.argv[1:], os.environ.get("LOCAL_RANK", "0"))
    for deepspeed, torchrun in (("LOCAL_SIZE", "LOCAL_WORLD_SIZE"), ("CROSS_RANK", "GROUP_RANK"),
                                ("CROSS_SIZE", "GROUP_WORLD_SIZE")):
        if torchrun in os.environ:
            os.environ.setdefault(deepspeed, os.environ[torchrun])
    if module:  # sys.path[0] stays the working directory, as with python -m
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        if not getattr(sys.flags, "safe_path", False):  # python -P adds no directory
            sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()

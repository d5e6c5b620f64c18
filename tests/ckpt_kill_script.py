"""A training script that is killed (SIGKILL) in the middle of a checkpoint save.

Run under torchrun with 2 ranks: ``ckpt_kill_script.py DIR PHASE``. It trains the parity model
at stage 2, saves ``global_step1`` normally, trains one more step and saves again, and the
named rank kills itself with SIGKILL at ``PHASE`` of that second save:

* ``write``: rank 1, after writing the first tensor of its file;
* ``index``: rank 0, after every rank's file is written, before the index;
* ``rename``: rank 0, after the tag directory is renamed into place, before ``latest``;
* ``latest``: rank 0, after the new ``latest`` is written to a temporary file, before the rename;
* ``overwrite``: the second save reuses the tag ``global_step1``; rank 0 dies after moving the
  old directory aside, before renaming the new one into place.

Before each save rank 0 writes the full parameters it is about to save to
``DIR/expect_step{N}.pt``, for the test to compare against.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import checkpoint_tasks as ct  # noqa: E402

from zerodp.checkpoint import save as save_module  # noqa: E402
from zerodp.checkpoint import tensorfile  # noqa: E402


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm(phase: str, rank: int) -> None:
    if phase == "write" and rank == 1:
        original = tensorfile.TensorWriter.write

        def write(self, name, parts):
            original(self, name, parts)
            die()
        tensorfile.TensorWriter.write = write
    if rank != 0:
        return
    if phase == "index":
        original_json = save_module.write_json_durably

        def write_json(path, data):
            if Path(path).name == save_module.INDEX:
                die()
            return original_json(path, data)
        save_module.write_json_durably = write_json
    elif phase == "rename":
        save_module.write_latest = lambda save_dir, tag: die()
    elif phase == "latest":
        real_replace = os.replace

        def replace(src, dst):
            if Path(dst).name == save_module.LATEST:
                die()
            return real_replace(src, dst)
        save_module.os.replace = replace
    elif phase == "overwrite":
        real_rename = os.rename
        calls = []

        def rename(src, dst):
            real_rename(src, dst)
            calls.append(dst)
            if Path(dst).name.endswith(".old"):
                die()
        save_module.os.rename = rename


def main() -> None:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    engine = ct.make_engine(None, 2, "fp32")
    ct.train_steps(engine, 0, 1)
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in engine.module.named_parameters()}, out / "expect_step1.pt")
    engine.save_checkpoint(out)
    ct.train_steps(engine, 1, 2)
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in engine.module.named_parameters()}, out / "expect_step2.pt")
    dist.barrier()
    arm(phase, rank)
    engine.save_checkpoint(out, tag="global_step1" if phase == "overwrite" else None)
    print("second save finished", flush=True)  # never reached: the armed rank dies first
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

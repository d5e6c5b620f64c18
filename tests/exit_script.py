r"""A finished job that ends without any teardown of its own, as scripts written for DeepSpeed do:

    torchrun --nproc-per-node 2 exit_script.py [MODE [DIR]]

Every rank trains three steps at stage 3 and returns from the script. The process must exit 0:
zerodp tears down what it started (engines, the process group it created) at interpreter exit.
An exit handler registered before zerodp's (so run after it) prints whether the default group
is still alive then, and how many gloo threads are left to outlive it into finalization (where
they abort the process): ``at exit: group alive False, gloo threads 0``.

MODE:
  ``plain`` (default): zerodp.initialize starts the process group from torchrun's environment.
  ``rank1_first``: rank 0 sleeps before it returns, so rank 1 tears down while its peer is still
  alive, and rank 0 destroys its group after rank 1 is gone.
  ``peer_gone``: rank 1 ends at once with os._exit(0) after training (no exit handlers, its
  connections dropped by the kernel); rank 0 sleeps, then tears down with its peer gone.
  ``user_group``: the script starts the group itself (torch.distributed.init_process_group) and
  destroys it itself at its end, as torch asks: zerodp leaves a group it did not start alone,
  and still tears its engine down at exit.
  ``user_group_left``: the script starts the group itself and never destroys it (as Accelerate's
  CPU jobs leave theirs): zerodp's last exit handler, registered when zerodp is imported, destroys
  it after the script's own handlers; a handler registered before ``import zerodp`` then prints
  ``after zerodp: group alive False, gloo threads 0``.
  ``async_save DIR``: the last step is followed by an asynchronous checkpoint save into DIR,
  still writing when the script returns.
"""
import atexit
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

MODE = sys.argv[1] if len(sys.argv) > 1 else "plain"
if MODE == "user_group_left":  # registered before zerodp's import-time handler, so run after it
    atexit.register(lambda: print(f"after zerodp: group alive {dist.is_initialized()}, gloo threads "
                                  f"{gloo_threads()}", flush=True))

import zerodp  # noqa: E402


def gloo_threads() -> int:
    """The threads of this process that belong to a gloo process group (Linux)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum("gloo" in n for n in names)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
    atexit.register(lambda: print(f"at exit: group alive {dist.is_initialized()}, gloo threads {gloo_threads()}",
                                  flush=True))
    if mode in ("user_group", "user_group_left"):
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if mode == "async_save":
        config["checkpoint"] = {"async_save": True}
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    rank = dist.get_rank()
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 16, generator=g)
        loss = F.mse_loss(engine(x), x.sum(dim=1, keepdim=True))
        engine.backward(loss)
        engine.step()
    if mode == "async_save":
        engine.save_checkpoint(sys.argv[2], tag="last")
    print(f"rank {rank} done", flush=True)
    if mode == "peer_gone" and rank == 1:
        os._exit(0)
    if mode in ("rank1_first", "peer_gone") and rank == 0:
        time.sleep(2.0)
    if mode == "user_group":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

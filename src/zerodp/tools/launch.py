"""``zerodp launch``: DeepSpeed's ``deepspeed`` launcher for one node, on torchrun.

::

    deepspeed     --num_gpus 2 train.py --deepspeed ds_config.json
    zerodp launch --num_gpus 2 train.py --deepspeed ds_config.json    # the same run

runs ``python -m torch.distributed.run --standalone --nproc-per-node 2 -m
zerodp.tools.launch_worker train.py --deepspeed ds_config.json``: torchrun gives every process
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, and the worker
(:mod:`zerodp.tools.launch_worker`) runs the script as ``__main__`` with ``--local_rank=<r>``
right after the script name, where DeepSpeed's launcher puts it. The launcher's single-node
options keep their names (``--num_gpus`` and ``--num-gpus`` alike); its multi-node and other
options are refused (exit 2) naming the option, since a multi-node run is started with torchrun.

The torchrun process is run as ``zerodp train`` runs it (:func:`run_torchrun`, with the
environment of :func:`torchrun_env`): Ctrl-C stops the workers and exits 130, otherwise the exit
code is torchrun's.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

__all__ = ["add_arguments", "run", "torchrun_command", "default_nproc", "torchrun_env", "run_torchrun",
           "REFUSED"]

PROG = "zerodp"
WORKER = "zerodp.tools.launch_worker"

MULTI_NODE = ("zerodp launch runs one node; start a multi-node run with torchrun on every node: "
              "torchrun --nnodes N --node-rank R --master-addr A --master-port P --nproc-per-node G "
              f"-m {WORKER} train.py ARGS")
NOT_HERE = "not supported by zerodp launch"
GPUS = "choose this node's GPUs with CUDA_VISIBLE_DEVICES=0,1 and --num_gpus"

#: DeepSpeed launcher options that zerodp launch refuses: option strings, metavar (None: a
#: flag), why, and whether it is a multi-node option (the message then says how to run one).
REFUSED: list[tuple[tuple[str, ...], str | None, str, bool]] = [
    (("-H", "--hostfile"), "FILE", "multi-node option", True),
    (("-i", "--include"), "SPEC", f"selects hosts and GPUs: {GPUS}", True),
    (("-e", "--exclude"), "SPEC", f"selects hosts and GPUs: {GPUS}", True),
    (("--node_rank", "--node-rank"), "R", "multi-node option", True),
    (("--launcher",), "NAME", "multi-node option", True),
    (("--launcher_args", "--launcher-args"), "ARGS", "multi-node option", True),
    (("--no_ssh", "--no-ssh"), None, "multi-node option", True),
    (("--no_ssh_check", "--no-ssh-check"), None, "multi-node option", True),
    (("--force_multi", "--force-multi"), None, "multi-node option", True),
    (("--ssh_port", "--ssh-port"), "PORT", "multi-node option", True),
    (("--venv_script", "--venv-script"), "FILE", "multi-node option", True),
    (("--autotuning",), "MODE", f"{NOT_HERE}: DeepSpeed's autotuner is not part of zerodp", True),
    (("--no_python", "--no-python"), None,
     f"{NOT_HERE}, which runs Python scripts and modules (torchrun --no-python runs other programs)", False),
    (("--save_pid", "--save-pid"), None, NOT_HERE, False),
    (("--enable_each_rank_log", "--enable-each-rank-log"), "DIR",
     f"{NOT_HERE} (torchrun --log-dir DIR --redirects 3 writes a log per rank)", False),
    (("--bind_cores_to_rank", "--bind-cores-to-rank"), None, f"{NOT_HERE} (see torchrun --numa-binding)", False),
    (("--bind_core_list", "--bind-core-list"), "CORES", f"{NOT_HERE} (see torchrun --numa-binding)", False),
    (("--log_level", "--log-level"), "LEVEL", NOT_HERE, False),
    (("-q", "--quiet"), None, NOT_HERE, False),
]


def default_nproc() -> int:
    """Processes when ``--num_gpus`` is not given: one per visible CUDA device, else one."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def torchrun_env(nproc: int) -> dict[str, str]:
    """This process's environment with the settings every torchrun that zerodp starts gets."""
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    # torchrun otherwise hands restarted ranks the store of the failed attempt, whose stale
    # gloo addresses make the restart fail to connect
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


def error(message: str, command: str) -> None:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)


# -- options --------------------------------------------------------------------------------

class _Refuse(argparse.Action):
    """An option of DeepSpeed's launcher that ``zerodp launch`` does not take: exit 2 naming it."""

    def __init__(self, option_strings, dest, reason: str, **kwargs):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.reason}")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _num_gpus(text: str) -> int:
    n = _integer(text)
    if n < 1 and n != -1:
        raise argparse.ArgumentTypeError(f"{n}: a number of processes is at least 1 (-1: all GPUs)")
    return n


def _num_nodes(text: str) -> int:
    n = _integer(text)
    if n not in (1, -1):
        raise argparse.ArgumentTypeError(f"{n} nodes: {MULTI_NODE}")
    return n


def _port(text: str) -> int:
    n = _integer(text)
    if not 0 < n < 65536:
        raise argparse.ArgumentTypeError(f"{n}: a port is 1-65535")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``zerodp launch``: DeepSpeed launcher's names, with ``-`` or ``_``."""
    parser.allow_abbrev = False  # an abbreviation could take a script's option for ours
    parser.usage = ("%(prog)s [-h] [--num_gpus N] [--num_nodes 1] [--master_port PORT] [--master_addr ADDR]"
                    " [--no_local_rank] [--module] SCRIPT [ARGS ...]")
    add = parser.add_argument
    add("--num_gpus", "--num-gpus", "--num_accelerators", "--num-accelerators", dest="num_gpus",
        type=_num_gpus, default=-1, metavar="N",
        help="processes to start, one per GPU (default, or -1: one per visible CUDA device, or 1 "
             "without CUDA); choose the GPUs with CUDA_VISIBLE_DEVICES")
    add("--num_nodes", "--num-nodes", dest="num_nodes", type=_num_nodes, default=-1, metavar="N",
        help="1 (or -1); more nodes are refused: a multi-node run is started with torchrun")
    add("--master_port", "--master-port", dest="master_port", type=_port, default=None, metavar="PORT",
        help="port of the rendezvous store (default: a free one, torchrun --standalone; with only "
             "--master_addr, 29500)")
    add("--master_addr", "--master-addr", dest="master_addr", default=None, metavar="ADDR",
        help="address of the rendezvous store (default: this host, torchrun --standalone); with "
             "only --master_port, 127.0.0.1")
    add("--no_local_rank", "--no-local-rank", dest="no_local_rank", action="store_true",
        help="do not pass --local_rank=<local rank> to the script (it is passed by default, right "
             "after the script name, as DeepSpeed does; LOCAL_RANK is in the environment either way)")
    add("--module", action="store_true",
        help="SCRIPT is a module name, run as 'python -m' runs it")
    add("script", metavar="SCRIPT", help="the training script (or module, with --module)")
    add("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
        help="the script's arguments, passed unchanged")
    refused = parser.add_argument_group(
        "DeepSpeed launcher options refused (exit 2, with a message naming the option)",
        f"{MULTI_NODE} (the worker passes --local_rank as zerodp launch does).")
    for names, metavar, why, multi_node in REFUSED:
        kwargs = {"nargs": 0} if metavar is None else {"nargs": "?", "metavar": metavar}
        reason = f"{why}; {MULTI_NODE}" if multi_node else why
        refused.add_argument(*names, action=_Refuse, reason=reason, help=why, **kwargs)


def torchrun_command(args: argparse.Namespace, nproc: int) -> list[str]:
    """The torchrun command line ``zerodp launch`` runs for ``args`` with ``nproc`` processes."""
    if args.master_port is None and args.master_addr is None:
        rendezvous = ["--standalone"]
    else:
        rendezvous = ["--nnodes", "1", "--node-rank", "0"]
        if args.master_addr is not None:
            rendezvous += ["--master-addr", args.master_addr]
        if args.master_port is not None:
            rendezvous += ["--master-port", str(args.master_port)]
    worker = ["--no-local-rank"] * args.no_local_rank + ["--module"] * args.module
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", str(nproc),
            "-m", WORKER, *worker, args.script, *args.script_args]


def run(args: argparse.Namespace) -> int:
    """``zerodp launch``: run torchrun for ``args``; its exit code."""
    if not args.module and not os.path.isfile(args.script):
        error(f"{args.script}: no such file (a module name needs --module)", "launch")
        return 2
    nproc = default_nproc() if args.num_gpus == -1 else args.num_gpus
    return run_torchrun(torchrun_command(args, nproc), torchrun_env(nproc), "launch", "the run")


# -- running torchrun -----------------------------------------------------------------------

STOP_GRACE_S = 60.0
"""Seconds torchrun gets to stop its workers after the forwarded SIGINT before they are killed
(torchrun itself gives the workers 30 s before it kills them)."""


def run_torchrun(cmd: list[str], env: dict[str, str], command: str, what: str) -> int:
    """Run the torchrun launcher and return its exit code, reporting a failure of ``what``.

    The launcher runs in a session of its own, so a terminal's Ctrl-C reaches it only
    through here, exactly once: the first Ctrl-C (or a SIGTERM to this process) is forwarded
    as SIGINT and torchrun stops the workers; a second one, or torchrun still running
    :data:`STOP_GRACE_S` later, kills torchrun and the workers.

    The handlers are this function's own, installed before torchrun starts: a process started
    with SIGINT ignored (a background job of a shell script, ``nohup``) still stops on it, and
    torchrun and the workers start with the default disposition, not an inherited "ignore".
    """
    def interrupted(signum, frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        except OSError as e:
            error(f"cannot start {cmd[0]}: {e}", command)
            return 1
        rc, interrupts = _wait(proc, command)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if interrupts:
        return 130
    if rc != 0:
        reason = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
        error(f"{what} failed ({reason}); see the messages above", command)
        return rc if rc > 0 else 128 - rc
    return 0


def _wait(proc: subprocess.Popen, command: str) -> tuple[int, int]:
    """Wait for torchrun: its exit code and how many interrupts came meanwhile."""
    interrupts, deadline = 0, None
    while True:
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            return proc.wait(timeout=timeout), interrupts
        except subprocess.TimeoutExpired:
            print(f"{PROG} {command}: the workers did not stop within {STOP_GRACE_S:.0f} s; "
                  "killing them", file=sys.stderr)
            _kill_tree(proc.pid)
            deadline = None
        except KeyboardInterrupt:
            if proc.poll() is not None:
                continue
            interrupts += 1
            if interrupts == 1:
                print(f"\n{PROG} {command}: interrupted; stopping the workers "
                      "(Ctrl-C again to kill them)", file=sys.stderr)
                proc.send_signal(signal.SIGINT)
                deadline = time.monotonic() + STOP_GRACE_S
            else:
                print(f"\n{PROG} {command}: killing the workers", file=sys.stderr)
                _kill_tree(proc.pid)
                deadline = None


def _children(pid: int) -> list[int]:
    """Child process ids of ``pid`` (Linux ``/proc``; empty where unavailable)."""
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
    except OSError:
        pass
    return kids


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun and its workers (each worker leads a process group of its own)."""
    for child in _children(pid):
        for kill in (os.killpg, os.kill):
            try:
                kill(child, signal.SIGKILL)
                break
            except (ProcessLookupError, PermissionError):
                continue
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

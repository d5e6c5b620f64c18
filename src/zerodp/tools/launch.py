"""Running torchrun for the ``zerodp`` commands that start processes.

:func:`run_torchrun` runs the torchrun launcher with the environment of :func:`torchrun_env`:
Ctrl-C stops the workers and exits 130, otherwise the exit code is torchrun's.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

__all__ = ["torchrun_env", "run_torchrun"]

PROG = "zerodp"


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


def run_torchrun(cmd: list[str], env: dict[str, str], command: str, what: str) -> int:
    """Run the torchrun launcher and return its exit code, reporting a failure of ``what``.

    The launcher runs in a session of its own, so a terminal's Ctrl-C reaches it only
    through here, exactly once: the first Ctrl-C (or a SIGTERM to this process) is forwarded
    as SIGINT and torchrun stops the workers; a second one kills torchrun and the workers.
    """
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    except OSError as e:
        error(f"cannot start {cmd[0]}: {e}", command)
        return 1

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    interrupts = 0
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:
                if proc.poll() is not None:
                    continue
                interrupts += 1
                if interrupts == 1:
                    print(f"\n{PROG} {command}: interrupted; stopping the workers "
                          "(Ctrl-C again to kill them)", file=sys.stderr)
                    proc.send_signal(signal.SIGINT)
                else:
                    print(f"\n{PROG} {command}: killing the workers", file=sys.stderr)
                    _kill_tree(proc.pid)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if interrupts:
        return 130
    if rc != 0:
        reason = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
        error(f"{what} failed ({reason}); see the messages above", command)
        return rc if rc > 0 else 128 - rc
    return 0


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

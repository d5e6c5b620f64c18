"""A finished job exits 0: at interpreter exit zerodp tears down the engines and the process group
it started (``core/teardown.py``), without a barrier, so a rank whose peer is already gone
leaves too. ``exit_script.py`` is a 2-rank stage-3 job that ends with no teardown of its own."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SRC = str(HERE.parent / "src")


def run_job(*args: str, timeout: float = 180) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "exit_script.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def check_clean_exit(proc: subprocess.CompletedProcess, ranks_at_exit: int = 2) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "terminate called" not in out and "SIGABRT" not in out, out[-3000:]
    assert proc.stdout.count(" done") == 2, out[-3000:]
    # the script's own exit handler runs after zerodp's: the group is gone by then, and so are
    # its gloo threads (left to finalization, they abort the process now and then)
    assert proc.stdout.count("at exit: group alive False, gloo threads 0") == ranks_at_exit, out[-3000:]


@pytest.mark.parametrize("mode", ["plain", "user_group"])
def test_job_without_teardown_exits_0(mode):
    proc, _ = run_job(mode)
    check_clean_exit(proc)


def test_a_group_the_script_leaves_alive_is_destroyed_after_its_exit_handlers():
    """The script starts its gloo group and never destroys it: its own exit handler still finds the
    group alive (zerodp leaves it to the script's handlers), and after them zerodp's last handler
    destroys it, its gloo threads joined before finalization."""
    proc, _ = run_job("user_group_left")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "terminate called" not in out, out[-3000:]
    assert proc.stdout.count("at exit: group alive True") == 2, out[-3000:]
    assert proc.stdout.count("after zerodp: group alive False, gloo threads 0") == 2, out[-3000:]


def test_peer_already_gone_does_not_hang():
    """Rank 1 ends with os._exit (no exit handlers, connections dropped); rank 0 tears down two
    seconds later with its peer gone: no barrier to wait in, no hang, exit 0."""
    proc, took = run_job("peer_gone", timeout=120)
    check_clean_exit(proc, ranks_at_exit=1)
    assert took < 90


def test_async_save_in_flight_at_exit_completes(tmp_path):
    proc, _ = run_job("async_save", str(tmp_path))
    check_clean_exit(proc)
    assert (tmp_path / "latest").read_text() == "last"
    names = sorted(p.name for p in (tmp_path / "last").iterdir())
    assert names == ["index.json", "rank00000.json", "rank00000.safetensors", "rank00001.json",
                     "rank00001.safetensors"]
    assert not any(tmp_path.glob(".*"))


@pytest.mark.slow
def test_job_without_teardown_exits_0_every_time():
    """Without the teardown, about one run in ten to twenty aborted (SIGABRT) on a 2-core CPU."""
    for mode in ["plain"] * 20 + ["rank1_first"] * 5 + ["peer_gone"] * 5:
        proc, _ = run_job(mode)
        check_clean_exit(proc, ranks_at_exit=1 if mode == "peer_gone" else 2)


_IN_PROCESS = r"""
import os, sys, torch, torch.distributed as dist
import zerodp
from zerodp.core import teardown

def engine():
    return zerodp.initialize(model=torch.nn.Linear(2, 2), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]

zerodp.init_distributed()  # a group of one, started by zerodp
e = engine()
teardown.at_exit()
print("zerodp's group: alive", dist.is_initialized(), "hooks", len(e._hooks))
os.environ["MASTER_PORT"] = sys.argv[1]
dist.init_process_group("gloo", rank=0, world_size=1)  # the script's own group
e = engine()
teardown.at_exit()
print("the script's group: alive", dist.is_initialized(), "hooks", len(e._hooks))
teardown.at_exit()  # again: nothing left to do
dist.destroy_process_group()
"""


def test_only_a_group_zerodp_started_is_destroyed():
    """zerodp destroys the group it started; one the script started is the script's, as in
    DeepSpeed (which destroys none). Engines are torn down either way; twice is harmless."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, PYTHONPATH=SRC)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", _IN_PROCESS, port], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "zerodp's group: alive False hooks 0" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "the script's group: alive True hooks 0" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_a_heartbeat_stopped_inside_a_store_call_does_not_abort_the_exit():
    """The hang detection's heartbeat is a daemon thread that writes to the job's store; stopped while
    inside a write and left there, it returned into Python during finalization and the process died
    with "terminate called without an active exception" (the rare abort of a finished job: about one
    run in 40). ``heartbeat_exit_script.py`` holds every write 300 ms in C++, so without the wait in
    ``Heartbeat.stop`` it aborts every time (seen: 3 of 3, exit 134)."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for _ in range(3):
        proc = subprocess.run([sys.executable, str(HERE / "heartbeat_exit_script.py")], env=env,
                              capture_output=True, text=True, timeout=60)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "terminate called" not in out, out[-2000:]
        assert "stopped, alive False" in proc.stdout, out[-2000:]

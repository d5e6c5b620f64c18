"""Hang detection (``zerodp/health``): a rank that stops answering (SIGSTOP) in a forward, in a
backward at stage 3, in the optimizer's step or inside a checkpoint save is named, with where it was
last seen, by every other rank within the timeout, and those ranks end (torchrun would then end the
job); a rank that is slow but alive is waited for. Each case starts its own processes
(``hang_script.py``): a stopped rank cannot go back to the shared pool."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 2.0  # hang_script.py's comms_timeout_s


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp_path: Path, world: int, stage: int, place: str, victim: int, limit: float = 120) -> dict:
    """Start the ranks; wait for every rank but a stopped victim to end; kill the victim. Returns
    each rank's report, exit code and the seconds from its error to its exit."""
    port = str(_port())
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), str(HERE)]))
    procs = [subprocess.Popen([sys.executable, str(HERE / "hang_script.py"), str(r), str(world), port, str(stage),
                               place, str(victim), str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    waited_for = [r for r in range(world) if place == "slow" or r != victim]
    deadline = time.monotonic() + limit
    ended: dict[int, float] = {}
    while len(ended) < len(waited_for) and time.monotonic() < deadline:
        for r in waited_for:
            if r not in ended and procs[r].poll() is not None:
                ended[r] = time.time()
        time.sleep(0.2)
    out = {}
    for r, p in enumerate(procs):
        code = p.poll()
        if code is None:
            p.kill()  # the stopped victim (SIGKILL ends a stopped process too)
        log = p.communicate()[0]
        report = tmp_path / f"rank{r}.json"
        out[r] = {"code": code, "log": log[-3000:],
                  "report": json.loads(report.read_text()) if report.exists() else None}
        if out[r]["report"] and out[r]["report"].get("at") and r in ended:
            out[r]["exit_after_s"] = ended[r] - out[r]["report"]["at"]
    return out


def assert_named(out: dict, victim: int, phase: str) -> None:
    for r, got in out.items():
        if r == victim:
            continue
        assert got["code"] not in (None, 0), f"rank {r} did not end with an error:\n{got['log']}"
        err = (got["report"] or {}).get("error") or ""
        assert err.startswith("RankTimeoutError"), f"rank {r}: {err or got['log']}"
        assert f"rank {victim} (last seen at step 2, {phase}" in err, err
        assert "stopped answering" in err
        assert got["exit_after_s"] < 15, "the process did not end promptly after the error"


@pytest.mark.parametrize("stage,place,phase", [
    (3, "forward", "forward"), (3, "backward", "backward"), (2, "step", "step"), (1, "save", "save_checkpoint")])
def test_a_stopped_rank_is_named_by_the_others(tmp_path, stage, place, phase):
    out = run(tmp_path, 2, stage, place, victim=1)
    assert_named(out, 1, phase)
    # named within the timeout: one period, a few beats to tell stopped from slow, the reads
    for r in (0,):
        assert "waited" in out[r]["report"]["error"]
        waited = float(out[r]["report"]["error"].split(" waited ")[1].split(" s ")[0])
        assert waited <= 2 * TIMEOUT_S + 3, waited


def test_four_ranks_one_stopped_in_backward(tmp_path):
    out = run(tmp_path, 4, 3, "backward", victim=2)
    assert_named(out, 2, "backward")


def test_a_rank_stopped_inside_a_pipeline_schedule(tmp_path):
    """Two pipeline stages: the other stage waits in a receive inside torch's schedule, which cannot
    be waited for in periods; the engine's watchdog thread names the stopped rank there and ends
    the process (code 1) at once."""
    out = run(tmp_path, 2, 1, "pipeline", victim=1)
    got = out[0]
    assert got["code"] == 1, got["log"]
    assert "RankTimeoutError" in got["log"] and "the pipeline's sends and receives" in got["log"], got["log"]
    assert "rank 1 (last seen at step 2, pipeline" in got["log"], got["log"]


def test_a_slow_rank_is_not_called_hung(tmp_path):
    """The victim sleeps 3.5 timeouts in a forward: the others wait (and warn), everyone trains on."""
    out = run(tmp_path, 2, 3, "slow", victim=1)
    for r, got in out.items():
        assert got["code"] == 0, got["log"]
        assert got["report"] == {"rank": r, "steps": 4, "error": None}
    assert "alive and not there yet" in out[0]["log"]

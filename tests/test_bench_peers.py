"""benchmarks/peers.py: its pure helpers (fast), and one cheap end-to-end run (slow, not in
the default selection: ``pytest -m slow tests/test_bench_peers.py``)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import _common  # noqa: E402
import peers  # noqa: E402


def _run(system, world, step_s, loss, norm, rss=500.0, rep=0, kind="time"):
    row = {"step_s": step_s, "peak_rss_mib": rss, "rss_ready_mib": 300.0, "comm_bytes_per_step": 2**20,
           "socket_bytes_per_step": 2**21, "comm_calls_per_step": 3, "grad_norms": [norm, 1.0],
           "losses": [5.0, loss]}
    return peers.Run(system, world, rep, rows=[dict(row), dict(row)], kind=kind)


def test_median_and_ratio_skip_missing_values():
    assert _common.median([3.0, None, 1.0, 2.0]) == 2.0
    assert _common.median([None]) is None
    assert _common.ratio(3.0, 2.0) == 1.5
    assert _common.ratio(None, 2.0) is None and _common.ratio(1.0, 0.0) is None


def test_summary_ratios_medians_and_agreement():
    runs = [_run("ddp", 2, 1.0, 3.1, 2.0, rep=0), _run("ddp", 2, 3.0, 3.1, 2.0, rep=1),
            _run("ddp", 2, 2.0, 3.1, 2.0, rep=2),
            # RSS comes from the memory run alone; its step time and loss are not the timed runs'
            _run("ddp", 2, 9.0, 4.0, 2.0, rss=400.0, kind="memory"),
            _run("zero2", 2, 9.0, 4.0, 2.0, rss=350.0, kind="memory"),
            _run("ddp-zro", 2, 2.0, 3.1, 2.0), _run("ddp-zro", 2, 9.0, 4.0, 2.5, kind="memory"),
            _run("zero2", 2, 2.2, 3.1 + peers.LOSS_ATOL / 2, 2.0 * (1 + peers.GRAD_NORM_RTOL / 2)),
            _run("fsdp2", 2, 2.4, 3.3, 4.0),                          # grads summed, not averaged
            peers.Run("ds2", 2, 0, error="RuntimeError: boom")]
    rows = peers.summarize(runs, [2], ["ddp", "zero2", "ddp-zro", "fsdp2", "ds2", "ds3"],
                           {"ds3": "not installed: pip install deepspeed"})
    by = {s.system: s for s in rows}
    assert by["ddp"].step_s == 2.0 and by["ddp"].vs_ddp == 1.0 and by["ddp"].reps == 3
    assert by["zero2"].vs_ddp == pytest.approx(1.1) and by["zero2"].ok and by["zero2"].note == ""
    assert by["zero2"].comm_mib == 1.0 and by["zero2"].socket_mib == 2.0
    assert by["ddp"].peak_rss_mib == 400.0 and by["zero2"].peak_rss_mib == 350.0 and by["ddp"].loss == 3.1
    assert by["fsdp2"].peak_rss_mib is None  # no memory run: no RSS, not the timed run's
    assert not by["ddp-zro"].ok and "memory run" in by["ddp-zro"].note
    assert not by["fsdp2"].ok and "grad norm" in by["fsdp2"].note and "final loss" in by["fsdp2"].note
    assert by["ds2"].step_s is None and by["ds2"].note == "failed: RuntimeError: boom"
    assert by["ds3"].note == "not installed: pip install deepspeed"

    table = peers.format_table(rows).splitlines()
    assert len(table) == 2 + 6 and table[0].startswith(
        "| world | system | step (ms, median) | runs' range (ms) | vs DDP")
    assert table[2].startswith("| 2 | ddp | 2000.0 | 1000-3000 | 1.00 | 400 | 300 | 1.0 | 2.0 | 3 |")
    assert "**fsdp2** (!)" in table[5] and "DISAGREES" in table[5] and "| 1.20 | - | - |" in table[5]
    assert table[6].startswith("| 2 | ds2 | - | - | - |") and table[6].endswith("failed: RuntimeError: boom |")


def test_memory_runs_alone_fill_the_memory_columns():
    """``--reps 0 --memory-reps 1``: no timed run, so no step time, but the RSS columns."""
    rows = peers.summarize([_run("zero3", 4, 9.0, 4.0, 2.0, rss=453.0, kind="memory")], [4], ["zero3", "fsdp2"], {})
    by = {s.system: s for s in rows}
    assert by["zero3"].peak_rss_mib == 453.0 and by["zero3"].rss_ready_mib == 300.0 and by["zero3"].step_s is None
    assert by["zero3"].ok and by["zero3"].note == "memory runs only"
    assert by["fsdp2"].peak_rss_mib is None and by["fsdp2"].note == "not run" and not by["fsdp2"].ok


def test_timed_runs_keep_the_allocator_and_memory_runs_set_it(monkeypatch, tmp_path):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert "MALLOC_MMAP_THRESHOLD_" not in _common.worker_env(2, memory=False)
    assert _common.worker_env(2)["MALLOC_MMAP_THRESHOLD_"] == _common.MMAP_THRESHOLD
    seen = []

    def fake_torchrun(script, world, cmd, env, timeout=None):
        seen.append((cmd[cmd.index("--steps") + 1], env.get("MALLOC_MMAP_THRESHOLD_")))
        return _common.Launch(1, "", "", 0.1)
    monkeypatch.setattr(_common, "torchrun", fake_torchrun)
    args = peers.argparse.Namespace(model="tiny", steps=4, warmup=2, micro_batch=2, bucket_mb=25.0, clip=1.0,
                                    seed=0, nvme_path=None, prefetch_mb=None, timeout=10)
    for kind in ("time", "memory"):
        run = peers._launch("ddp", 2, 0, args, str(tmp_path), kind)
        assert run.kind == kind and run.rows is None
    assert seen == [("4", None), ("1", _common.MMAP_THRESHOLD)]


def test_failure_reason_names_the_worker_exception():
    launch = _common.Launch(1, "", "Traceback (most recent call last):\n  File x\n"
                            "[rank0]: ValueError: bad config\ntorch.distributed.elastic...ChildFailedError:\n"
                            "worker failed", 3.0)
    assert _common.failure_reason(launch) == "ValueError: bad config"
    assert _common.failure_reason(_common.Launch(None, "", "", 12.0)) == "timed out after 12 s"


def test_missing_peer_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    assert peers._missing(peers.BY_NAME["ds3"]) == "not installed: pip install deepspeed"
    assert peers._missing(peers.BY_NAME["ddp"]) is None


@pytest.mark.slow
def test_peers_end_to_end_cheap(tmp_path):
    systems = ["ddp", "ddp-zro", "fsdp2", "zero1", "zero3", "zero3-tp2", "zero3-tp2-sp", "fsdp2-tp2"]
    if importlib.util.find_spec("deepspeed") is not None:
        systems.append("ds2")
    md = tmp_path / "table.md"
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "peers.py"), "--worlds", "2", "--reps", "1", "--model", "tiny",
         "--steps", "2", "--warmup", "1", "--systems", *systems, "--out", str(tmp_path), "--markdown", str(md)],
        capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "WARNING" not in proc.stdout and "FAILED" not in proc.stdout, proc.stdout
    table = md.read_text()
    for system in systems:
        assert f"| 2 | {system} |" in table
    assert (tmp_path / "peers.json").exists()
    # the wrapped collectives' ring bytes agree with the engine's own count (zerodp's gloo
    # all-gathers and reduce-scatters are all-to-alls: an exchange at world 2 sends a whole chunk)
    runs = json.loads((tmp_path / "peers.json").read_text())["runs"]
    for system in ("zero1", "zero3"):
        rows = next(r["rows"] for r in runs if r["system"] == system and r["kind"] == "time")
        for row in rows:
            own = row["own_comm_bytes_last_step"]
            assert own > 0 and abs(row["comm_bytes_per_step"] - own) < 0.02 * own, (system, row)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "peers.png").stat().st_size > 0

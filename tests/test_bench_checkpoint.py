"""benchmarks/checkpoint.py: its helpers, its smallest configuration end to end (zerodp only,
~20 s), and the quick run with every peer (slow, not in the default selection:
``pytest -m slow tests/test_bench_checkpoint.py``)."""
import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import checkpoint as bench  # noqa: E402


def test_disk_measurement_and_eviction(tmp_path):
    m = bench.measure_disk(str(tmp_path), 4 << 20, chunk=1 << 20)
    assert m["bytes"] == 4 << 20 and m["write_gbps"] > 0 and m["read_gbps"] > 0
    assert list(tmp_path.iterdir()) == []  # the file is removed
    f = tmp_path / "sub" / "a.bin"
    f.parent.mkdir()
    f.write_bytes(os.urandom(1 << 20))
    assert bench.files_under(str(tmp_path)) == [str(f)]
    assert bench.evict(str(tmp_path)) >= 0.0
    before = bench.io_counters()
    if before is not None:
        assert f.read_bytes() and bench.io_delta(before, bench.io_counters(), "read_bytes") >= 0


def _io_run(system, world, save_s, load_s, wbytes, rbytes, rep=0, stall=None):
    rows = [{"params": 1_000_000, "largest_tensor_bytes": 2 << 20, "save_s": save_s * (1 if r else 0.5),
             "load_s": load_s, "flush_s": 0.5 if system == "ds" else 0.0, "save_write_bytes": wbytes,
             "load_read_bytes": rbytes, "save_cpu_s": 0.25, "load_cpu_s": 0.5} for r in range(world)]
    if stall is not None:
        for r in rows:
            r["stall"] = stall
    return bench.Run("io", system, "3M", world, rep, rows=rows)


def test_summaries_tables_and_verdicts():
    disk = bench.disk_summary([{"write_gbps": 1.0, "read_gbps": 2.0}, {"write_gbps": 3.0, "read_gbps": 4.0}])
    assert disk["write_gbps"] == 2.0 and disk["read_gbps_range"] == (2.0, 4.0)
    saves = [{"call_s": 0.1, "wait_s": 0.0, "slowdown_s": 0.1, "stall_s": 0.2, "base_step_s": 1.0,
              "steps_during_s": [1.0, 1.1], "staging_rss_mib": 10.0, "extra_cpu_s": 0.3}] * 2
    runs = [_io_run("zerodp", 2, 1.0, 0.5, 1e9, 1e9, rep=0, stall=saves),
            _io_run("zerodp", 2, 3.0, 1.5, 1e9, 1e9, rep=1, stall=saves),
            _io_run("ds", 2, 1.5, 1.0, 1e9, 1e9, stall=[{"error": "needs CUDA"}]),
            bench.Run("io", "dcp", "3M", 2, 0, error="RuntimeError: boom"),
            bench.Run("consolidate", "zerodp", "3M", 2, 0, rows={
                "seconds": 1.0, "rss_before_mib": 200.0, "peak_rss_mib": 230.0, "peak_exact": True,
                "peak_over_start_mib": 30.0, "bytes_out": 4_000_000})]
    io = {s.system: s for s in bench.summarize_io(runs, disk, {})}
    z = io["zerodp"]
    assert z.reps == 2 and z.save_s == 2.0 and z.load_s == 1.0 and z.written_mb == 1000.0
    # 2 GB over the slowest rank's 1 s (rep 0) and 3 s (rep 1): median 1.33 GB/s, of 2 GB/s write
    assert z.save_gbps == pytest.approx((2.0 + 2 / 3) / 2) and z.save_frac == pytest.approx(z.save_gbps / 2.0)
    assert io["ds"].save_gbps == pytest.approx(2 / 2.0) and io["ds"].flush_s == 0.5
    assert io["dcp"].save_s is None and io["dcp"].note == "failed: RuntimeError: boom"
    stall = bench.summarize_stall(runs)
    assert [(s.system, s.save) for s in stall] == [("zerodp", 1), ("zerodp", 2), ("ds", None)]
    assert stall[0].stall_frac == pytest.approx((0.2 / 1 + 0.2 / 3) / 2) and stall[2].note == "n/a: needs CUDA"
    assert stall[1].extra_cpu_s == 0.3 and stall[1].sync_cpu_s == 0.25
    cons = bench.summarize_consolidate(runs)
    assert cons[0].largest_mib == 2.0 and cons[0].within and cons[0].peak_over_mib == 30.0

    table = bench.format_io(list(io.values())).splitlines()
    assert table[0].startswith("| params | world | system | written / rank (MB) | save (s)")
    assert table[2].startswith("| 1.0M | 2 | zerodp | 1000 | 2.00 | 0.00 | 1.33 | 67% | 0.25 | 1000 | 1.00 | 2.67 "
                               "| 89% | 0.50 | 2 |")
    assert bench.format_stall(stall, {"3M": 1_000_000}).splitlines()[2].startswith("| 1.0M | 2 | zerodp | 1st |")
    assert "| yes |" in bench.format_consolidate(cons)
    text = "\n".join(bench.verdicts(list(io.values()), stall, cons))
    assert "save >= 70% of disk bandwidth: missed" in text
    assert "consolidation peak" in text and "met at every size" in text


def test_plan_interleaves_peers_and_keeps_the_largest_world():
    args = argparse.Namespace(systems=["zerodp", "dcp", "ds"], reps=2, sizes=["3M", "25M"], worlds=[1, 2],
                              peer_size="3M", peer_worlds=[2, 4])
    plan = bench._plan(args, {})
    io = [p for p in plan if p[0] == "io"]
    rep0 = [(p[2], p[3], p[4], p[5]) for p in io if p[1] == 0]
    assert rep0 == [("3M", 1, "zerodp", False), ("3M", 2, "zerodp", True), ("3M", 2, "dcp", True),
                    ("3M", 2, "ds", True), ("3M", 4, "zerodp", True), ("3M", 4, "dcp", True),
                    ("3M", 4, "ds", True), ("25M", 1, "zerodp", False), ("25M", 2, "zerodp", False)]
    assert [p[4] for p in io if p[1] == 1 and p[2] == "3M" and p[3] == 2] == ["dcp", "ds", "zerodp"]
    kept = {(p[1], p[2], p[4], p[3]) for p in io if p[6]}
    assert kept == {(r, "3M", "zerodp", 4) for r in (0, 1)} | {(r, "3M", "ds", 4) for r in (0, 1)} \
        | {(r, "25M", "zerodp", 2) for r in (0, 1)}
    assert [p[0] for p in plan if p[1] == 0 and p[0] != "io"] == ["disk", "consolidate", "disk", "consolidate"]


def _bench(tmp_path, *args, timeout):
    md = tmp_path / "table.md"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "checkpoint.py"), *args, "--out", str(tmp_path),
                           "--markdown", str(md)], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED" not in proc.stdout, proc.stdout
    assert not (tmp_path / "ckpt-scratch").exists()  # every checkpoint removed
    return md.read_text(), json.loads((tmp_path / "checkpoint.json").read_text())


def test_smallest_configuration_end_to_end(tmp_path):
    table, data = _bench(tmp_path, "--systems", "zerodp", "--sizes", "0.5M", "--worlds", "1", "--reps", "1",
                         "--peer-size", "0.5M", "--peer-worlds", "1", "--disk-mb", "8", "--base-steps", "1",
                         "--async-saves", "1", timeout=300)
    assert "| 0.4M | 1 | zerodp |" in table and "| 0.4M | 1 | zerodp | 1st |" in table
    assert "| 0.4M | zerodp | 1 |" in table and "zerodp save >= 70%" in table
    (io,) = data["io"]
    assert io["written_mb"] > 1 and io["read_mb"] > 1 and io["save_s"] > 0 and io["load_s"] > 0
    (cons,) = data["consolidate"]
    assert cons["within"] and cons["out_mb"] > 1


@pytest.mark.slow
def test_quick_run_with_peers(tmp_path):
    systems = ["zerodp", "dcp"] + (["ds"] if importlib.util.find_spec("deepspeed") is not None else [])
    table, data = _bench(tmp_path, "--quick", "--systems", *systems, timeout=1800)
    for system in systems:
        assert f"| 3.2M | 2 | {system} |" in table
    assert {s["system"] for s in data["stall"] if s["stall_s"] is not None} == {"zerodp", "dcp"}
    assert {c["system"] for c in data["consolidate"]} == {"zerodp"} | ({"ds"} & set(systems))

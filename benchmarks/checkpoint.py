"""Checkpoint I/O on the example GPT: zerodp against the disk it writes to, and against its peers.

One run measures:

1. **disk bandwidth** on the filesystem the checkpoints go to (``--scratch``): a sequential
   write of a ``--disk-mb`` file of random bytes, timed to the end of its fsync, then a
   sequential read of it after evicting it from the page cache
   (``posix_fadvise(POSIX_FADV_DONTNEED)``). Measured again before every model size of every
   repetition; the fractions below use the median of all measurements.
2. **save and load per rank**, zerodp ZeRO stage ``--stage`` (fp32 weights, AdamW state)
   against model size (``--sizes``) and world size (``--worlds``): each rank times its own
   ``save_checkpoint`` and ``load_checkpoint``; before the load every checkpoint file is
   fsynced and evicted from the page cache, so loads read from the disk. Bytes are what each
   rank moved to and from storage (``write_bytes``/``read_bytes`` of ``/proc/self/io``).
3. **asynchronous save stall** (at ``--peer-size`` and ``--peer-worlds``): the training time
   lost to ``save_checkpoint(async_save=True)`` (the call, plus the slowdown of the steps
   that run while the write goes on, plus any wait at the end), against a synchronous save
   of the same model in the same process, for two asynchronous saves in a row (the first
   may allocate its host copy, the next reuse it); and the host memory the staging takes.
4. **consolidation peak memory**: ``zerodp.checkpoint.consolidate`` of each size's checkpoint
   in a fresh process, peak RSS over the RSS just before it starts, beside the model's
   largest tensor.
5. **peers** on the same model, world size and stage (``--systems``): PyTorch DCP
   (``dcp.save``/``dcp.load``/``dcp.async_save`` of an FSDP2 model's and AdamW's sharded
   state dict) and DeepSpeed (``save_checkpoint``/``load_checkpoint``, and its
   ``zero_to_fp32`` consolidation).

Every (repetition, size, world, system) runs in a fresh ``torchrun`` process group
(``MALLOC_MMAP_THRESHOLD_=65536``, so freed memory leaves RSS), systems interleaved within
each repetition and their order rotated between repetitions; tables give medians over the
repetitions, compared as ratios within the run, since the machine and its disk are shared.

    python benchmarks/checkpoint.py            # 25M/100M/200M parameters, worlds 1 2 4: ~17-25 min
    python benchmarks/checkpoint.py --quick    # 3M/25M parameters, worlds 1 2: ~3 min

Output (``--out``, default ``benchmarks/results/``): ``checkpoint.md``, ``checkpoint.json``
and one log per run under ``logs/``. Checkpoints go to ``--scratch`` (default
``benchmarks/results/ckpt-scratch``) and are removed after each run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from _checkpoint_harness import HARNESSES, Harness  # noqa: E402
from _checkpoint_report import (  # noqa: E402,F401 (the rows and summaries: tests)
    LEGEND,
    ConsolidateRow,
    IoRow,
    StallRow,
    disk_summary,
    format_consolidate,
    format_disk,
    format_io,
    format_stall,
    summarize_consolidate,
    summarize_io,
    summarize_stall,
    verdicts,
)
from _common import evict, files_under, read_file, write_file  # noqa: E402,F401 (files_under: tests)

#: Example-GPT shapes by approximate parameter count: (n_layer, n_embd, n_head).
SIZES = {
    "0.5M": (2, 128, 4),
    "3M": (4, 256, 4),
    "25M": (8, 512, 8),
    "100M": (14, 768, 12),
    "200M": (16, 1024, 16),
    "400M": (20, 1280, 20),
}
SYSTEMS = ("zerodp", "dcp", "ds")
DESCRIPTIONS = {
    "zerodp": "zerodp save_checkpoint / load_checkpoint",
    "dcp": "torch.distributed.checkpoint save / load of FSDP2 + AdamW get_state_dict",
    "ds": "DeepSpeed save_checkpoint / load_checkpoint",
}
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ============================================================================ storage helpers

def io_counters() -> Optional[dict[str, int]]:
    """This process's ``/proc/self/io`` counters (all its threads), or None where absent."""
    try:
        with open("/proc/self/io") as f:
            return {k.strip(): int(v) for k, v in (line.split(":") for line in f if ":" in line)}
    except OSError:
        return None


def io_delta(before: Optional[dict], after: Optional[dict], key: str) -> Optional[int]:
    if before is None or after is None:
        return None
    return after[key] - before[key]


def measure_disk(folder: str, nbytes: int, chunk: int = 8 << 20) -> dict[str, float]:
    """Sequential write (to the end of fsync) and cold read of an ``nbytes`` file of random
    bytes in ``folder``, in GB/s (10^9 bytes); the file is removed afterwards."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f".disk-bandwidth-{os.getpid()}")
    try:
        nbytes, write_s = write_file(path, nbytes, chunk)
        evict(path)
        got, read_s = read_file(path, chunk)
    finally:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
    return {"bytes": nbytes, "write_gbps": nbytes / write_s / 1e9, "read_gbps": got / read_s / 1e9,
            "write_s": write_s, "read_s": read_s}


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib(after_reset: bool) -> float:
    """Peak RSS since :func:`reset_peak_rss` (``VmHWM``), else since the process started."""
    if after_reset:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
    return _common.peak_rss_mib()


# ============================================================================ worker side

def _timed(fn, *a) -> float:
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


def cpu_s() -> float:
    """CPU time of this process so far (all threads, user + system)."""
    t = os.times()
    return t.user + t.system


def _stall(h: Harness, batches, args, sync_wall_s: float, dist, torch) -> list[dict]:
    """Steps before, during and after ``args.async_saves`` asynchronous saves (the first may
    allocate what later ones reuse); one dict per save, see the module docstring."""
    cpu: list[float] = []

    def step(i: int) -> float:
        c0 = cpu_s()
        wall = _timed(h.step, *batches[i % len(batches)])
        cpu.append(cpu_s() - c0)
        return wall
    h.step(*batches[0])  # first step after the load: state reallocated, not timed
    before = [step(i) for i in range(args.base_steps)]
    k = torch.tensor([min(args.max_stall_steps, math.ceil(1.3 * sync_wall_s / statistics.median(before)) + 1)])
    dist.all_reduce(k, op=dist.ReduceOp.MAX)
    saves = []
    for n in range(args.async_saves):
        plain_cpu = list(cpu)
        rss0 = _common.rss_now_mib()
        c0 = cpu_s()
        t0 = time.perf_counter()
        handle = h.save(args.dir, f"async{n}", asynchronous=True)
        call_s = time.perf_counter() - t0
        staged_mib = _common.rss_now_mib() - rss0
        during = [step(i) for i in range(int(k.item()))]
        rss1 = _common.rss_now_mib()
        wait_s = _timed(h.wait, handle)
        window_cpu = cpu_s() - c0
        del cpu[len(plain_cpu):]  # steps during a save are not plain steps
        saves.append({"call_s": call_s, "wait_s": wait_s, "steps_during_s": during, "rss_before_mib": rss0,
                      "staging_rss_mib": max(staged_mib, rss1 - rss0), "window_cpu_s": window_cpu})
    after = [step(i) for i in range(args.base_steps)]
    base = statistics.median(before + after)
    base_cpu = statistics.median(cpu)
    for sv in saves:
        n_during = len(sv["steps_during_s"])
        sv.update(base_step_s=base, base_step_cpu_s=base_cpu, steps_before_s=before, steps_after_s=after,
                  slowdown_s=sum(sv["steps_during_s"]) - n_during * base,
                  extra_cpu_s=sv["window_cpu_s"] - n_during * base_cpu)
        sv["stall_s"] = sv["call_s"] + sv["slowdown_s"] + sv["wait_s"]
    return saves


def _worker(args) -> None:
    t_start = time.perf_counter()
    import torch
    import torch.distributed as dist

    if args.system == "ds":
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gpt = _common.load_example_gpt()
    torch.manual_seed(args.seed)
    n_layer, n_embd, n_head = SIZES[args.size]
    model = gpt.build_gpt("small", n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=args.block_size)
    n_params = model.num_parameters()
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    batches = _common.make_batches(gpt, args.block_size, args.micro_batch, 4, args.seed, rank)
    h = HARNESSES[args.system](model, gpt, args)
    h.step(*batches[0])  # the optimizer state exists from the first step on
    row = {"rank": rank, "world": world, "params": n_params, "largest_tensor_bytes": largest,
           "rss_ready_mib": _common.rss_now_mib(), "ready_s": time.perf_counter() - t_start}

    dist.barrier()
    io0, c0 = io_counters(), cpu_s()
    row["save_s"] = _timed(h.save, args.dir, "sync")
    io1, row["save_cpu_s"] = io_counters(), cpu_s() - c0
    row["save_write_bytes"] = io_delta(io0, io1, "write_bytes")
    dist.barrier()
    flush = torch.tensor([evict(args.dir) if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(flush, 0)
    row["flush_s"] = float(flush.item())
    dist.barrier()
    io2, c0 = io_counters(), cpu_s()
    row["load_s"] = _timed(h.load, args.dir, "sync")
    io3, row["load_cpu_s"] = io_counters(), cpu_s() - c0
    row["load_read_bytes"] = io_delta(io2, io3, "read_bytes")
    row["rss_after_load_mib"] = _common.rss_now_mib()
    dist.barrier()

    if args.stall:
        wall = torch.tensor([row["save_s"]], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        row["stall"] = [{"error": h.no_async}] if h.no_async else \
            _stall(h, batches, args, float(wall.item()) + row["flush_s"], dist, torch)
    h.close()
    row["peak_rss_mib"] = _common.peak_rss_mib()
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(_common.RESULT_PREFIX + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _consolidate_worker(args) -> None:
    """One consolidation in this fresh process: time, output bytes and peak RSS over the RSS
    just before it starts."""
    if args.system == "ds":
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        def run():
            convert_zero_checkpoint_to_fp32_state_dict(args.dir, args.dest, tag=args.tag)
    else:
        from zerodp.checkpoint import consolidate

        def run():
            consolidate(args.dir, args.dest, tag=args.tag)
    rss0 = _common.rss_now_mib()
    exact = reset_peak_rss()
    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    peak = peak_rss_mib(exact)
    out = files_under(args.dest)
    print(_common.RESULT_PREFIX + json.dumps({
        "seconds": seconds, "rss_before_mib": rss0, "peak_rss_mib": peak, "peak_exact": exact,
        "peak_over_start_mib": peak - rss0, "bytes_out": sum(os.path.getsize(p) for p in out)}),
        flush=True)


# ============================================================================ driver side

@dataclasses.dataclass
class Run:
    kind: str            # "io" or "consolidate"
    system: str
    size: str
    world: int
    rep: int
    rows: Optional[list] = None     # io: one dict per rank; consolidate: one dict
    error: Optional[str] = None
    seconds: float = 0.0


def _missing(system: str) -> Optional[str]:
    import importlib.util
    if system == "ds" and importlib.util.find_spec("deepspeed") is None:
        return "not installed: pip install deepspeed"
    if system == "zerodp" and importlib.util.find_spec("zerodp") is None:
        return "not installed: pip install -e ."
    if system == "dcp":
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            return "FSDP2 not available in this torch: pip install 'torch>=2.6'"
    return None


def _env(system: str, world: int) -> dict:
    return _common.worker_env(world, {"DS_ACCELERATOR": "cpu"} if system == "ds" else None)


def _log(log_dir: str, name: str, launch: _common.Launch) -> None:
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, name + ".log"), "w") as f:
        f.write(f"exit {launch.returncode}, {launch.seconds:.1f} s\n--- stdout\n{launch.stdout}\n"
                f"--- stderr\n{launch.stderr}\n")


def _launch_io(system: str, size: str, world: int, rep: int, stall: bool, folder: str, args) -> Run:
    cmd = ["--worker", "io", "--system", system, "--size", size, "--stage", str(args.stage),
           "--dir", folder, "--block-size", str(args.block_size), "--micro-batch", str(args.micro_batch),
           "--base-steps", str(args.base_steps), "--max-stall-steps", str(args.max_stall_steps),
           "--async-saves", str(args.async_saves),
           "--seed", str(args.seed)] + (["--stall"] if stall else [])
    launch = _common.torchrun(__file__, world, cmd, _env(system, world), timeout=args.timeout)
    _log(os.path.join(args.out, "logs"), f"ckpt-{size}-w{world}-{system}-rep{rep}", launch)
    rows = launch.result()
    if rows is None:
        return Run("io", system, size, world, rep, error=_common.failure_reason(launch), seconds=launch.seconds)
    return Run("io", system, size, world, rep, rows=rows, seconds=launch.seconds)


def _launch_consolidate(system: str, size: str, world: int, rep: int, folder: str, args) -> Run:
    dest = folder.rstrip("/") + "-consolidated"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "consolidate", "--system", system,
           "--dir", folder, "--dest", dest, "--tag", "sync"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=_env(system, 1), capture_output=True, text=True, timeout=args.timeout)
        launch = _common.Launch(proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0)
    except subprocess.TimeoutExpired as e:
        launch = _common.Launch(None, e.stdout or "", e.stderr or "", time.perf_counter() - t0)
    finally:
        shutil.rmtree(dest, ignore_errors=True)
    _log(os.path.join(args.out, "logs"), f"consolidate-{size}-{system}-rep{rep}", launch)
    row = launch.result()
    if row is None:
        return Run("consolidate", system, size, world, rep, error=_common.failure_reason(launch),
                   seconds=launch.seconds)
    return Run("consolidate", system, size, world, rep, rows=row, seconds=launch.seconds)


# ---------------------------------------------------------------------------- summaries

def source_state() -> str:
    """The zerodp source measured: its git commit, and the files under ``src/zerodp`` that
    differ from it (the benchmark measures the working tree)."""
    try:
        import zerodp
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(zerodp.__file__))))
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "src/zerodp"], cwd=root,
                                 capture_output=True, text=True, timeout=10).stdout.split("\n")
    except Exception:
        return "zerodp source: unknown"
    if not head:
        return "zerodp source: not a git checkout"
    files = [ln[3:] for ln in changed if ln.strip()]
    return f"zerodp source: {head}" + (f" + changes to {', '.join(files)}" if files else "")


QUICK = {"sizes": ["3M", "25M"], "worlds": [1, 2], "reps": 1, "peer_size": "3M", "peer_worlds": [2], "disk_mb": 128}
FULL = {"sizes": ["25M", "100M", "200M"], "worlds": [1, 2, 4], "reps": 2, "peer_size": "100M",
        "peer_worlds": [2], "disk_mb": 512}


def _plan(args, skipped: dict[str, str]) -> list[tuple]:
    """The run order: repetition by repetition, size by size (a disk measurement first, the
    consolidations last), world by world. zerodp runs at every world size (``--worlds``, and
    ``--peer-worlds`` at the peer size); at the peer size and worlds the peers run too, with
    the asynchronous stall, the systems taking turns, their order rotated every repetition.
    Items: ``("disk", rep, size)``, ``("io", rep, size, world, system, stall, keep)`` (keep:
    the checkpoint is consolidated later) and ``("consolidate", rep, size)``."""
    steps: list[tuple] = []
    ours = [] if "zerodp" in skipped or "zerodp" not in args.systems else ["zerodp"]
    peers = [s for s in args.systems if s != "zerodp" and s not in skipped]
    for rep in range(args.reps):
        for size in args.sizes:
            steps.append(("disk", rep, size))
            at_peer_size = size == args.peer_size
            worlds = sorted(set(args.worlds) | (set(args.peer_worlds) if at_peer_size else set()))
            runs = []
            for world in worlds:
                stall = at_peer_size and world in args.peer_worlds
                systems = ours + (peers if stall else [])
                k = rep % max(1, len(systems))
                runs += [(world, system, stall) for system in systems[k:] + systems[:k]]
            last = {system: world for world, system, _ in runs}
            for world, system, stall in runs:
                keep = system in ("zerodp", "ds") and last[system] == world
                steps.append(("io", rep, size, world, system, stall, keep))
            steps.append(("consolidate", rep, size))
    return steps


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="small run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), help=f"model sizes (default {' '.join(FULL['sizes'])})")
    ap.add_argument("--worlds", type=int, nargs="+", help="zerodp world sizes (default 1 2 4)")
    ap.add_argument("--reps", type=int, help="repetitions, interleaved (default 2)")
    ap.add_argument("--peer-size", choices=list(SIZES), help="size for peers and the async stall (default 100M)")
    ap.add_argument("--peer-worlds", type=int, nargs="+", help="world sizes for peers and the async stall (default 2)")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS,
                    help="systems (default all: zerodp dcp ds)")
    ap.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="ZeRO stage of zerodp and DeepSpeed (default 2)")
    ap.add_argument("--disk-mb", type=int, help="size of the disk-bandwidth file in MiB (default 512)")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per sequence in the training steps (default 64)")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step (default 1)")
    ap.add_argument("--base-steps", type=int, default=3,
                    help="timed steps before and after the asynchronous save (default 3)")
    ap.add_argument("--max-stall-steps", type=int, default=40, help="most steps run during an asynchronous save")
    ap.add_argument("--async-saves", type=int, default=2,
                    help="asynchronous saves in a row per stall measurement (default 2: the first, "
                         "which may allocate, and one that reuses)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900, help="seconds before a run is killed (default 900)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output folder (default benchmarks/results/)")
    ap.add_argument("--scratch", help="where checkpoints are written (default OUT/ckpt-scratch)")
    ap.add_argument("--markdown", help="write the tables here (default OUT/checkpoint.md)")
    ap.add_argument("--worker", choices=["io", "consolidate"], help=argparse.SUPPRESS)
    ap.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--size", choices=list(SIZES), help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--dest", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="sync", help=argparse.SUPPRESS)
    ap.add_argument("--stall", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "io":
        _worker(args)
        return 0
    if args.worker == "consolidate":
        _consolidate_worker(args)
        return 0

    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out = os.path.abspath(args.out)
    scratch = os.path.abspath(args.scratch or os.path.join(args.out, "ckpt-scratch"))
    os.makedirs(scratch, exist_ok=True)
    skipped = {s: why for s in args.systems if (why := _missing(s))}
    for s, why in skipped.items():
        print(f"skipping {s}: {why}", flush=True)

    plan = _plan(args, skipped)
    n_io = sum(1 for p in plan if p[0] == "io")
    runs: list[Run] = []
    disks: list[dict] = []
    kept: dict[tuple, list[tuple[str, str, int]]] = {}  # (rep, size) -> checkpoints to consolidate
    t_start = time.perf_counter()
    done = 0
    for item in plan:
        if item[0] == "disk":
            m = measure_disk(scratch, args.disk_mb << 20)
            m.update(rep=item[1], size=item[2])
            disks.append(m)
            print(f"disk before {item[2]} (rep {item[1] + 1}): write {m['write_gbps']:.2f} GB/s, "
                  f"read {m['read_gbps']:.2f} GB/s", flush=True)
            continue
        if item[0] == "consolidate":
            _, rep, size = item
            for system, folder, world in kept.pop((rep, size), []):
                print(f"      consolidate {size} {system:6s} ...", end=" ", flush=True)
                run = _launch_consolidate(system, size, world, rep, folder, args)
                runs.append(run)
                shutil.rmtree(folder, ignore_errors=True)
                what = (f"peak +{run.rows['peak_over_start_mib']:.0f} MiB, {run.rows['seconds']:.1f} s"
                        if run.rows else f"FAILED: {run.error}")
                print(f"{run.seconds:5.1f} s  {what}", flush=True)
            continue
        _, rep, size, world, system, stall, keep = item
        done += 1
        folder = os.path.join(scratch, f"{size}-w{world}-{system}-rep{rep}")
        shutil.rmtree(folder, ignore_errors=True)
        print(f"[{done}/{n_io}] rep {rep + 1}/{args.reps} {size:>5s} world {world} {system:6s}"
              f"{' +async' if stall else '       '} ...", end=" ", flush=True)
        run = _launch_io(system, size, world, rep, stall, folder, args)
        runs.append(run)
        if keep and run.rows is not None:
            kept.setdefault((rep, size), []).append((system, folder, world))
            for name in os.listdir(folder):
                if name.startswith("async"):
                    shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)
        spent = time.perf_counter() - t_start
        if run.rows:
            r = run.rows
            what = (f"save {max(x['save_s'] for x in r):6.2f} s  load {max(x['load_s'] for x in r):6.2f} s")
            st = r[0].get("stall")
            if st and "stall_s" in st[0]:
                what += "  async stall " + " / ".join(f"{max(x['stall'][n]['stall_s'] for x in r):.2f}"
                                                      for n in range(len(st))) + " s"
        else:
            what = f"FAILED: {run.error}"
        print(f"{run.seconds:5.1f} s  {what}  (elapsed {spent / 60:.1f} min)", flush=True)

    disk = disk_summary(disks)
    io_rows = summarize_io(runs, disk, skipped)
    stall_rows = summarize_stall(runs)
    cons_rows = summarize_consolidate(runs)
    params = {s.size: s.params for s in io_rows if s.params}
    import torch
    versions = [f"torch {torch.__version__}"]
    for pkg in ("deepspeed", "zerodp"):
        try:
            from importlib.metadata import version
            versions.append(f"{pkg} {version(pkg)}")
        except Exception:
            pass
    header = (f"example GPT (fp32, AdamW state; block size {args.block_size}, micro-batch {args.micro_batch}), "
              f"ZeRO stage {args.stage} for zerodp and DeepSpeed, FSDP2 for DCP; {args.reps} repetitions; "
              f"gloo on {os.cpu_count()} CPU cores ({platform.machine()}); checkpoints in {scratch}; "
              f"disk file {args.disk_mb} MiB; {', '.join(versions)}; {source_state()}")
    total = time.perf_counter() - t_start
    lines = verdicts(io_rows, stall_rows, cons_rows)
    systems = "".join(f"* {name}: {DESCRIPTIONS[name]}\n" for name in args.systems if name not in skipped)
    text = (f"{header}\n\n{systems}\n{format_disk(disk)}\n\nSave and load\n\n{format_io(io_rows)}\n\n"
            f"Asynchronous save\n\n{format_stall(stall_rows, params)}\n\n"
            f"Consolidation\n\n{format_consolidate(cons_rows)}\n\n"
            + "".join(f"* {v}\n" for v in lines) + f"\n{LEGEND}\n")
    command = "python benchmarks/checkpoint.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    md_path = args.markdown or os.path.join(args.out, "checkpoint.md")
    with open(md_path, "w") as f:
        f.write(f"`{command.strip()}` ({total / 60:.1f} min)\n\n{text}")
    json_path = os.path.join(args.out, "checkpoint.json")
    with open(json_path, "w") as f:
        json.dump({"command": command.strip(), "header": header, "seconds": total, "disk": disk,
                   "disk_measurements": disks, "verdicts": lines,
                   "io": [dataclasses.asdict(s) for s in io_rows],
                   "stall": [dataclasses.asdict(s) for s in stall_rows],
                   "consolidate": [dataclasses.asdict(s) for s in cons_rows],
                   "runs": [dataclasses.asdict(r) for r in runs]}, f, indent=1)
    try:
        os.rmdir(scratch)
    except OSError:
        pass
    print(f"wrote {md_path}, {json_path}  [{total / 60:.1f} min]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

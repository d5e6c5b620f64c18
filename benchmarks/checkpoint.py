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
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SAVE_TARGET, LOAD_TARGET, STALL_TARGET, CONSOLIDATE_SLACK_MIB = 0.70, 0.70, 0.10, 100.0
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

class Harness:
    """One system around one model: ``step``, ``save`` (returns a handle to ``wait`` on when
    asynchronous), ``load``. ``no_async`` says why a system has no asynchronous save."""

    no_async: Optional[str] = None

    def step(self, x, y) -> float:
        raise NotImplementedError

    def save(self, folder: str, tag: str, asynchronous: bool = False):
        raise NotImplementedError

    def wait(self, handle) -> None:
        pass

    def load(self, folder: str, tag: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ZerodpHarness(Harness):
    def __init__(self, model, gpt, args) -> None:
        import zerodp
        config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
                  "steps_per_print": 10**9, "zero_optimization": {"stage": args.stage}}
        self.engine, _, _, _ = zerodp.initialize(model=model, config=config, unit_classes=(gpt.Block,))

    def step(self, x, y) -> float:
        _, loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def save(self, folder, tag, asynchronous=False):
        self.engine.save_checkpoint(folder, tag=tag, async_save=asynchronous)

    def wait(self, handle) -> None:
        self.engine.wait_for_checkpoint()

    def load(self, folder, tag) -> None:
        path, _ = self.engine.load_checkpoint(folder, tag=tag)
        if path is None:
            raise RuntimeError(f"zerodp found no checkpoint {tag} in {folder}")

    def close(self) -> None:
        self.engine.wait_for_checkpoint()


class DeepSpeedHarness(Harness):
    no_async = ("DeepSpeed's asynchronous writers (decoupled / fast checkpoint engines) build on its "
                "async_io op, which needs CUDA")
    def __init__(self, model, gpt, args) -> None:
        import deepspeed
        config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]),
                                                            "torch_adam": True}},
                  "steps_per_print": 10**9, "wall_clock_breakdown": False,
                  "zero_optimization": {"stage": args.stage}}
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=config)

    def step(self, x, y) -> float:
        _, loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def save(self, folder, tag, asynchronous=False):
        self.engine.save_checkpoint(folder, tag=tag)

    def load(self, folder, tag) -> None:
        path, _ = self.engine.load_checkpoint(folder, tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint {tag} in {folder}")


class DcpHarness(Harness):
    def __init__(self, model, gpt, args) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        self._async_group = None

    def step(self, x, y) -> float:
        _, loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def save(self, folder, tag, asynchronous=False):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        path = os.path.join(folder, tag)
        if not asynchronous:
            dcp.save(self._state(), checkpoint_id=path)
            return None
        if self._async_group is None:  # the background thread's collectives on a group of their own
            self._async_group = dist.new_group(backend="gloo")
        return dcp.async_save(self._state(), checkpoint_id=path, process_group=self._async_group)

    def wait(self, handle) -> None:
        if handle is not None:
            handle.result()

    def load(self, folder, tag) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        state = self._state()
        dcp.load(state, checkpoint_id=os.path.join(folder, tag))
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


HARNESSES = {"zerodp": ZerodpHarness, "ds": DeepSpeedHarness, "dcp": DcpHarness}


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

@dataclasses.dataclass
class IoRow:
    """One row of the save/load table: a system at a size and world size, over repetitions."""

    size: str
    world: int
    system: str
    params: Optional[int] = None
    written_mb: Optional[float] = None     # per rank, mean over ranks
    save_s: Optional[float] = None         # slowest rank's save call
    flush_s: Optional[float] = None        # fsync of what the save left unsynced
    save_gbps: Optional[float] = None      # all ranks' bytes / (save_s + flush_s)
    save_frac: Optional[float] = None      # save_gbps / disk write bandwidth
    save_cpu_s: Optional[float] = None     # CPU time of the busiest rank's process during its save
    read_mb: Optional[float] = None
    load_s: Optional[float] = None
    load_gbps: Optional[float] = None
    load_frac: Optional[float] = None
    load_cpu_s: Optional[float] = None
    reps: int = 0
    note: str = ""


@dataclasses.dataclass
class StallRow:
    size: str
    world: int
    system: str
    save: Optional[int] = None             # 1: the process's first asynchronous save, 2: the next
    sync_s: Optional[float] = None
    call_s: Optional[float] = None
    slowdown_s: Optional[float] = None
    wait_s: Optional[float] = None
    stall_s: Optional[float] = None
    stall_frac: Optional[float] = None
    base_step_s: Optional[float] = None
    extra_cpu_s: Optional[float] = None    # process CPU of the save window over as many plain steps
    sync_cpu_s: Optional[float] = None     # process CPU of the synchronous save
    steps_during: Optional[float] = None
    staging_mib: Optional[float] = None
    file_mib: Optional[float] = None
    reps: int = 0
    note: str = ""


@dataclasses.dataclass
class ConsolidateRow:
    size: str
    system: str
    world: int
    params: Optional[int] = None
    largest_mib: Optional[float] = None
    out_mb: Optional[float] = None
    seconds: Optional[float] = None
    rss_before_mib: Optional[float] = None
    peak_over_mib: Optional[float] = None
    within: Optional[bool] = None
    reps: int = 0
    note: str = ""


def disk_summary(measurements: list[dict]) -> dict:
    """Median and range of the run's disk measurements."""
    out = {"count": len(measurements)}
    for key in ("write_gbps", "read_gbps"):
        vals = [m[key] for m in measurements]
        out[key] = _common.median(vals)
        out[key + "_range"] = (min(vals), max(vals)) if vals else None
    return out


def _failed_note(good: list, bad: list) -> str:
    if not good:
        return f"failed: {bad[0].error}" if bad else "not run"
    return f"{len(bad)} of {len(bad) + len(good)} runs failed: {bad[0].error}" if bad else ""


def _sum_or_none(values) -> Optional[float]:
    vals = list(values)
    return None if any(v is None for v in vals) else float(sum(vals))


def summarize_io(runs: list[Run], disk: dict, skipped: dict[str, str]) -> list[IoRow]:
    """Save/load rows: per run, the slowest rank's time and all ranks' bytes; medians over
    repetitions; throughput against the disk's median bandwidth."""
    keys = list(dict.fromkeys((r.size, r.world, r.system) for r in runs if r.kind == "io"))
    out = []
    for size, world, system in keys:
        s = IoRow(size, world, system)
        out.append(s)
        mine = [r for r in runs if r.kind == "io" and (r.size, r.world, r.system) == (size, world, system)]
        good, bad = [r for r in mine if r.rows], [r for r in mine if not r.rows]
        s.reps, s.note = len(good), skipped.get(system) or _failed_note(good, bad)
        if not good:
            continue
        s.params = good[0].rows[0]["params"]
        save_wall = [max(x["save_s"] for x in r.rows) + r.rows[0]["flush_s"] for r in good]
        load_wall = [max(x["load_s"] for x in r.rows) for r in good]
        written = [_sum_or_none(x["save_write_bytes"] for x in r.rows) for r in good]
        read = [_sum_or_none(x["load_read_bytes"] for x in r.rows) for r in good]
        s.save_s = _common.median(max(x["save_s"] for x in r.rows) for r in good)
        s.flush_s = _common.median(r.rows[0]["flush_s"] for r in good)
        s.load_s = _common.median(load_wall)
        s.save_cpu_s = _common.median(max(x.get("save_cpu_s", 0.0) for x in r.rows) for r in good)
        s.load_cpu_s = _common.median(max(x.get("load_cpu_s", 0.0) for x in r.rows) for r in good)
        if None not in written:
            s.written_mb = _common.median(w / world / 1e6 for w in written)
            s.save_gbps = _common.median(w / t / 1e9 for w, t in zip(written, save_wall))
            s.save_frac = _common.ratio(s.save_gbps, disk.get("write_gbps"))
        if None not in read:
            s.read_mb = _common.median(b / world / 1e6 for b in read)
            s.load_gbps = _common.median(b / t / 1e9 for b, t in zip(read, load_wall))
            s.load_frac = _common.ratio(s.load_gbps, disk.get("read_gbps"))
    return out


def summarize_stall(runs: list[Run]) -> list[StallRow]:
    """Asynchronous-save rows, one per system and save (first, second ...) of the runs that
    measured a stall: per run the worst rank's figures; medians over repetitions."""
    out = []
    measured = [r for r in runs if r.kind == "io" and r.rows and "stall" in r.rows[0]]
    keys = list(dict.fromkeys((r.size, r.world, r.system) for r in measured))
    for size, world, system in keys:
        good = [r for r in measured if (r.size, r.world, r.system) == (size, world, system)]
        errors = [r.rows[0]["stall"][0]["error"] for r in good if "error" in r.rows[0]["stall"][0]]
        good = [r for r in good if "error" not in r.rows[0]["stall"][0]]
        if not good:
            out.append(StallRow(size, world, system, note=f"n/a: {errors[0]}" if errors else "not run"))
            continue
        for n in range(min(len(r.rows[0]["stall"]) for r in good)):
            s = StallRow(size, world, system, save=n + 1, reps=len(good))
            out.append(s)

            def worst(r, key, n=n):
                return max(x["stall"][n][key] for x in r.rows)

            def per_run(fn):
                return _common.median(fn(r) for r in good)

            def sync(r):
                return max(x["save_s"] for x in r.rows) + r.rows[0]["flush_s"]
            s.sync_s = per_run(sync)
            s.call_s = per_run(lambda r: worst(r, "call_s"))
            s.slowdown_s = per_run(lambda r: worst(r, "slowdown_s"))
            s.wait_s = per_run(lambda r: worst(r, "wait_s"))
            s.stall_s = per_run(lambda r: worst(r, "stall_s"))
            s.stall_frac = per_run(lambda r: worst(r, "stall_s") / sync(r))
            s.base_step_s = per_run(lambda r: worst(r, "base_step_s"))
            s.extra_cpu_s = per_run(lambda r: worst(r, "extra_cpu_s"))
            s.sync_cpu_s = per_run(lambda r: max(x.get("save_cpu_s", 0.0) for x in r.rows))
            s.steps_during = per_run(lambda r, n=n: len(r.rows[0]["stall"][n]["steps_during_s"]))
            s.staging_mib = per_run(lambda r: worst(r, "staging_rss_mib"))
            if all(x["save_write_bytes"] is not None for r in good for x in r.rows):
                s.file_mib = per_run(lambda r: max(x["save_write_bytes"] for x in r.rows) / 2**20)
    return out


def summarize_consolidate(runs: list[Run]) -> list[ConsolidateRow]:
    out = []
    keys = list(dict.fromkeys((r.size, r.system) for r in runs if r.kind == "consolidate"))
    params = {r.size: r.rows[0]["params"] for r in runs if r.kind == "io" and r.rows}
    largest = {r.size: r.rows[0]["largest_tensor_bytes"] for r in runs if r.kind == "io" and r.rows}
    for size, system in keys:
        mine = [r for r in runs if r.kind == "consolidate" and (r.size, r.system) == (size, system)]
        good, bad = [r for r in mine if r.rows], [r for r in mine if not r.rows]
        s = ConsolidateRow(size, system, mine[0].world, params=params.get(size))
        out.append(s)
        s.reps, s.note = len(good), _failed_note(good, bad)
        if not good:
            continue
        s.largest_mib = largest[size] / 2**20 if size in largest else None
        s.out_mb = good[0].rows["bytes_out"] / 1e6
        s.seconds = _common.median(r.rows["seconds"] for r in good)
        s.rss_before_mib = _common.median(r.rows["rss_before_mib"] for r in good)
        s.peak_over_mib = max(r.rows["peak_over_start_mib"] for r in good)
        if s.largest_mib is not None:
            s.within = s.peak_over_mib <= s.largest_mib + CONSOLIDATE_SLACK_MIB
        if not all(r.rows["peak_exact"] for r in good):
            s.note = "peak since process start (VmHWM could not be reset)"
    return out


# ---------------------------------------------------------------------------- tables

def fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _params(n: Optional[int], size: str) -> str:
    return size if n is None else f"{n / 1e6:.1f}M"


def format_disk(disk: dict) -> str:
    lines = ["| disk (same filesystem) | median GB/s | range GB/s | measurements |", "|---|---|---|---|"]
    for key, label in (("write_gbps", "sequential write + fsync"), ("read_gbps", "sequential read, page cache evicted")):
        rng = disk.get(key + "_range")
        span = "-" if not rng else f"{rng[0]:.2f}-{rng[1]:.2f}"
        lines.append(f"| {label} | {fmt(disk.get(key), '.2f')} | {span} | {disk.get('count', 0)} |")
    return "\n".join(lines)


def format_io(rows: list[IoRow]) -> str:
    lines = ["| params | world | system | written / rank (MB) | save (s) | + fsync (s) | save GB/s | of disk write "
             "| save CPU / rank (s) | read / rank (MB) | load (s) | load GB/s | of disk read | load CPU / rank (s) "
             "| runs | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        lines.append(
            f"| {_params(s.params, s.size)} | {s.world} | {s.system} | {fmt(s.written_mb, '.0f')} | {fmt(s.save_s, '.2f')} "
            f"| {fmt(s.flush_s, '.2f')} | {fmt(s.save_gbps, '.2f')} | {_pct(s.save_frac)} | {fmt(s.save_cpu_s, '.2f')} "
            f"| {fmt(s.read_mb, '.0f')} | {fmt(s.load_s, '.2f')} | {fmt(s.load_gbps, '.2f')} | {_pct(s.load_frac)} "
            f"| {fmt(s.load_cpu_s, '.2f')} | {s.reps} | {s.note.replace('|', '/')} |")
    return "\n".join(lines)


def format_stall(rows: list[StallRow], params: dict[str, int]) -> str:
    lines = ["| params | world | system | async save | sync save (s) | async call (s) | step slowdown (s) "
             "| final wait (s) | stall (s) | stall / sync save | step (s) | steps during write "
             "| sync save CPU / rank (s) | async extra CPU / rank (s) | RSS growth / rank (MiB) | file / rank (MiB) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        which = "-" if s.save is None else {1: "1st", 2: "2nd", 3: "3rd"}.get(s.save, f"{s.save}th")
        lines.append(
            f"| {_params(params.get(s.size), s.size)} | {s.world} | {s.system} | {which} | {fmt(s.sync_s, '.2f')} "
            f"| {fmt(s.call_s, '.2f')} | {fmt(s.slowdown_s, '.2f')} | {fmt(s.wait_s, '.2f')} | {fmt(s.stall_s, '.2f')} "
            f"| {_pct(s.stall_frac)} | {fmt(s.base_step_s, '.2f')} | {fmt(s.steps_during, '.0f')} "
            f"| {fmt(s.sync_cpu_s, '.2f')} | {fmt(s.extra_cpu_s, '.2f')} "
            f"| {fmt(s.staging_mib, '.0f')} | {fmt(s.file_mib, '.0f')} | {s.note.replace('|', '/')} |")
    return "\n".join(lines)


def format_consolidate(rows: list[ConsolidateRow]) -> str:
    lines = ["| params | system | checkpoint from world | largest tensor (MiB) | written (MB) | time (s) "
             "| RSS before (MiB) | peak RSS over start (MiB) | limit: largest + 100 (MiB) | within | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        limit = None if s.largest_mib is None else s.largest_mib + CONSOLIDATE_SLACK_MIB
        within = "-" if s.within is None else ("yes" if s.within else "**no**")
        lines.append(
            f"| {_params(s.params, s.size)} | {s.system} | {s.world} | {fmt(s.largest_mib, '.1f')} | {fmt(s.out_mb, '.0f')} "
            f"| {fmt(s.seconds, '.2f')} | {fmt(s.rss_before_mib, '.0f')} | {fmt(s.peak_over_mib, '.0f')} "
            f"| {fmt(limit, '.0f')} | {within} | {s.note.replace('|', '/')} |")
    return "\n".join(lines)


LEGEND = """\
What the numbers mean:

* disk: one process writing a file of random bytes sequentially (8 MiB writes) until its fsync
  returns, then reading it back after `posix_fadvise(POSIX_FADV_DONTNEED)` dropped it from the
  page cache; GB = 10^9 bytes. The fractions below use the medians.
* written / read per rank: bytes each rank sent to / fetched from storage during its save / load
  (`write_bytes` / `read_bytes` of `/proc/self/io`, all its threads), mean over ranks. Before
  every load all checkpoint files were fsynced and evicted from the page cache
  (`posix_fadvise(POSIX_FADV_DONTNEED)`), so loads read from the disk.
* save (s): the slowest rank's own `save_checkpoint` call, synchronous. `+ fsync`: the time
  an fsync of every file took afterwards: what the save left in the page cache unwritten
  (DeepSpeed's `torch.save` does not fsync; zerodp and DCP fsync before returning).
* save GB/s = all ranks' bytes written / (save + fsync); load GB/s = all ranks' bytes read /
  the slowest rank's `load_checkpoint` (which includes putting the state in place: at
  stage 1-2 the all-gather of the parameters). "of disk": that over the disk's bandwidth
  above (one sequential stream); target >= 70% for zerodp.
* save / load CPU: CPU time (user + system, all threads) of the busiest rank's process during
  its save / load; close to the wall time, the path is CPU-bound rather than waiting for the disk.
* async stall: in one process, after the synchronous save and load, `step` is the median
  training step (forward, backward, optimizer) without a save in flight, before and after.
  Then two `save_checkpoint(async_save=True)` in a row (DCP: `dcp.async_save` on a gloo
  group of its own), "1st" and "2nd" (the first may allocate host memory that the second
  reuses): "async call" is the time the call took to return, "step slowdown" the extra
  time of the steps that follow (as many as cover a synchronous save) over `step`, "final
  wait" the wait for the write to finish after them; stall = the sum, the training time the
  save cost (it can come out slightly negative from step-time noise). Target < 10% of the
  synchronous save. "async extra CPU": the process's CPU time from the call to the end of the
  write over that of as many plain steps, beside the synchronous save's CPU time: on a
  CPU-only machine training uses every core, so this work is taken from the steps (it is less
  noisy than the wall-time stall). RSS growth: the rank's RSS after the call and its steps
  over before it (the host copy the write runs from, kept or freed), beside the bytes the
  rank writes.
* consolidation: the checkpoint of the largest world size consolidated into safetensors
  weights in a fresh process (`zerodp.checkpoint.consolidate`: safetensors; DeepSpeed's
  `convert_zero_checkpoint_to_fp32_state_dict`: `torch.save`, as its safetensors output refuses
  the tied embedding); peak RSS (`VmHWM`, reset just before) minus the RSS just before it;
  target <= largest tensor (the model's largest parameter) + 100 MiB.
* every figure is the median over the repetitions of each run's figure (the slowest rank's
  time; peak memory: the largest)."""


def verdicts(io_rows: list[IoRow], stall_rows: list[StallRow], cons_rows: list[ConsolidateRow]) -> list[str]:
    """One line per target, for zerodp."""
    out = []
    mine = [s for s in io_rows if s.system == "zerodp"]
    for label, attr, target in (("save", "save_frac", SAVE_TARGET), ("load", "load_frac", LOAD_TARGET)):
        vals = [(getattr(s, attr), s) for s in mine if getattr(s, attr) is not None]
        if not vals:
            continue
        miss = [f"{_params(s.params, s.size)} w{s.world} {_pct(v)}" for v, s in vals if v < target]
        lo = min(v for v, _ in vals)
        out.append(f"zerodp {label} >= {target:.0%} of disk bandwidth: "
                   + ("met everywhere" if not miss else f"missed in {len(miss)} of {len(vals)}: " + ", ".join(miss))
                   + f" (lowest {lo:.0%})")
    stalls = [s for s in stall_rows if s.system == "zerodp" and s.stall_frac is not None]
    if stalls:
        worst = max(s.stall_frac for s in stalls)
        out.append(f"zerodp async stall < {STALL_TARGET:.0%} of a sync save: "
                   + ("met" if worst < STALL_TARGET else "missed") + " ("
                   + ", ".join(f"{_params(None, s.size)} w{s.world} save {s.save}: {_pct(s.stall_frac)}"
                               for s in stalls) + ")")
    cons = [s for s in cons_rows if s.system == "zerodp" and s.within is not None]
    if cons:
        out.append("zerodp consolidation peak <= largest tensor + 100 MiB: "
                   + ("met at every size" if all(s.within for s in cons) else "missed at "
                      + ", ".join(_params(s.params, s.size) for s in cons if not s.within))
                   + " (peaks " + ", ".join(f"{s.peak_over_mib:.0f}" for s in cons) + " MiB)")
    return out


# ---------------------------------------------------------------------------- main

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

"""zerodp against its peers on the example GPT: the same model, data and optimizer under

* ``ddp``              torch DistributedDataParallel, AdamW on every rank
* ``ddp-zro``          DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer`` (AdamW states sharded)
* ``fsdp2``            ``torch.distributed.fsdp.fully_shard`` per transformer block and on the root,
                       ``reshard_after_forward=True``
* ``fsdp2-noreshard``  the same with ``reshard_after_forward=False``
* ``ds1`` ``ds2`` ``ds3``          DeepSpeed ZeRO stages 1-3
* ``zero0`` .. ``zero3``           zerodp stages 0-3
* ``zero3-noreshard``             zerodp stage 3 with ``stage3_max_reuse_distance`` at its default
                                   (DeepSpeed's, 1e9): sharded between steps, each unit gathered once
                                   per step (``zero3`` and ``ds3`` set 0: gathered again for backward)
* ``zero3-tp2`` ``fsdp2-tp2``      tensor parallelism over pairs of ranks, with zerodp stage 3 or
                                   FSDP2 over the data-parallel ranks (a 2-D mesh)
* ``zero3-tp2-sp``                 ``zero3-tp2`` with sequence and loss parallelism
* ``zero1-pp2`` ``zero3-pp2`` ``zero1-pp2-tp2`` ``ds1-pp2``  pipeline parallelism (2 stages, 1F1B),
                                   zerodp's at stages 1 and 3 (and with TP 2), DeepSpeed's pipeline
                                   engine at ZeRO stage 1 (the most it allows)
* with ``--systems``, also offload: ``ds2-offload`` ``ds3-offload`` (DeepSpeed ZeRO-Offload),
  ``zero2-offload`` ``zero3-offload`` ``zero3-nvme`` (zerodp; ``benchmarks/offload.py`` runs them)

Every system trains in fp32 from the same initial weights (same seed) on the same
micro-batches per rank, with torch's AdamW (same lr, betas, eps, weight decay) and the same
global-norm gradient clipping (``--clip``; the coefficient is ``clip / (norm + 1e-6)`` in
all of them). Each (repetition, world size, system) runs in a fresh ``torchrun`` process
group, and the systems are interleaved round-robin within every repetition, so machine noise
falls on all of them alike.

Per world size and system the table gives the median optimizer-step time and its ratio to
DDP's, peak RSS per rank (from runs of their own, below), bytes communicated per step per rank (two ways, below), the
gradient norm of the first step (before clipping) and the loss at the last step. Systems
must agree on both; a row that does not is marked and a warning printed.

Step times and memory come from separate runs. The timed runs keep glibc's own allocator
settings, as a user's process has them. Peak RSS and RSS after set-up come from one more
run per world size and system (``--memory-reps``, warm-up and one step) with
``MALLOC_MMAP_THRESHOLD_=65536``: glibc then returns freed memory to the OS, so RSS shows
what a system keeps, but every large allocation faults its pages in afresh, which slows
every system (DDP's step by about a fifth at world size 2 here) and the ones that free and
allocate again inside a step the most (stage 3's gathered parameters).

Bytes communicated, counted inside each worker:

* "comm": every ``torch.distributed`` collective called from Python is wrapped, and each
  call is charged what the ring algorithm sends per rank for it (all-reduce of B bytes
  2B(N-1)/N; reduce-scatter, all-gather, broadcast or reduce of a B-byte buffer B(N-1)/N;
  a send B; an all-to-all what it sends to the other ranks), whatever the backend really
  runs. DDP's gradient all-reduces are issued from C++ and are taken from DDP's own bucket
  sizes instead.
* "socket": bytes this process wrote to its sockets during the timed steps
  (``wchar`` in ``/proc/self/io``), i.e. what gloo really sent, with its own algorithms.

    python benchmarks/peers.py                                  # world sizes 2 and 4
    python benchmarks/peers.py --worlds 2 --reps 2 --model small --systems ddp fsdp2 ds2 zero2

Peers that are not installed appear as rows saying how to install them
(``pip install -e '.[bench]'``); a run that fails appears as a row with its reason and the
others still run. Output (``--out``, default ``benchmarks/results/``): ``peers.md``,
``peers.png``, ``peers.json`` and one log per run under ``logs/``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from _peer_systems import BY_NAME, SYSTEMS, System, build, norm_value, ranks_needed, stands_for  # noqa: E402

# Agreement with the reference system (DDP) at the same world size; measurements behind
# these numbers are in docs/benchmarks.md:
# * step 1's gradient norm: correct systems differ only in how they sum in fp32 (6e-6
#   relative here between torch's clip_grad_norm_ and a float64 sum; a norm accumulated in
#   fp32 over a multi-million-element buffer on CPU drifts by up to ~2e-4), while gradients
#   summed instead of averaged are off by up to a factor N.
# * the loss after the run: correct systems agree to 3e-6; training without the clipping
#   moved it by 1.6e-2, gradients summed in part of the model by 3.5e-3. (With Adam and no
#   clipping, summed gradients leave the loss almost unchanged: the norm check catches them.)
GRAD_NORM_RTOL = 1e-3
LOSS_ATOL = 1e-4


# ============================================================================ worker side

class CollectiveCounter:
    """Wraps the ``torch.distributed`` collectives of this process and charges each call its
    ring-algorithm bytes per rank (see the module docstring). Only the outermost call counts
    (an object collective that calls ``all_gather`` inside is one call), and only while
    ``enabled``."""

    def __init__(self) -> None:
        self.enabled = False
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._local = threading.local()

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def install(self) -> None:
        import inspect

        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        def nbytes(t) -> int:
            return t.numel() * t.element_size()

        def frac(a) -> float:
            n = dist.get_world_size(a.get("group"))
            return (n - 1) / n

        def a2a_sent(a) -> float:  # what goes to the other ranks (split sizes: not the own part)
            t, splits = a["input"], a.get("input_split_sizes")
            if not splits:
                return nbytes(t) * frac(a)
            row = nbytes(t) // max(t.shape[0], 1)
            return (sum(splits) - splits[dist.get_rank(a.get("group"))]) * row

        def p2p_sent(a) -> float:
            ops = a["p2p_op_list"]
            return sum(nbytes(op.tensor) for op in ops if getattr(op.op, "__name__", "") in ("isend", "send"))

        costs: dict[str, Callable[[dict], float]] = {
            "all_reduce": lambda a: 2 * nbytes(a["tensor"]) * frac(a),
            "all_reduce_coalesced": lambda a: 2 * sum(map(nbytes, a["tensors"])) * frac(a),
            "reduce": lambda a: nbytes(a["tensor"]) * frac(a),
            "broadcast": lambda a: nbytes(a["tensor"]) * frac(a),
            "all_gather": lambda a: sum(map(nbytes, a["tensor_list"])) * frac(a),
            "all_gather_coalesced": lambda a: sum(nbytes(t) for lst in a["output_tensor_lists"]
                                                  for t in lst) * frac(a),
            "all_gather_into_tensor": lambda a: nbytes(a["output_tensor"]) * frac(a),
            "_all_gather_base": lambda a: nbytes(a["output_tensor"]) * frac(a),
            "all_gather_single": lambda a: nbytes(a["output_tensor"]) * frac(a),
            "reduce_scatter": lambda a: sum(map(nbytes, a["input_list"])) * frac(a),
            "reduce_scatter_tensor": lambda a: nbytes(a["input"]) * frac(a),
            "_reduce_scatter_base": lambda a: nbytes(a["input"]) * frac(a),
            "reduce_scatter_single": lambda a: nbytes(a["input"]) * frac(a),
            "all_to_all": lambda a: sum(map(nbytes, a["input_tensor_list"])) * frac(a),
            "all_to_all_single": a2a_sent,
            "gather": lambda a: nbytes(a["tensor"]) * frac(a),
            "scatter": lambda a: nbytes(a["tensor"]) * frac(a),
            "send": lambda a: nbytes(a["tensor"]),
            "isend": lambda a: nbytes(a["tensor"]),
            "recv": lambda a: 0.0,
            "irecv": lambda a: 0.0,
            "batch_isend_irecv": p2p_sent,
        }
        for name, cost in costs.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(name, original, inspect.signature(original), cost)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)
        # DTensor (tensor parallelism) communicates through the functional collectives
        from torch.distributed import _functional_collectives as funcol

        def group_size(group) -> int:
            if isinstance(group, tuple):  # (mesh, dim)
                return group[0].size(group[1])
            if hasattr(group, "size") and hasattr(group, "mesh_dim_names"):
                return group.size()
            return dist.get_world_size(group)

        def fc_frac(a) -> float:
            n = group_size(a["group"])
            return (n - 1) / n

        functional = {
            "all_reduce": lambda a: 2 * nbytes(a["self"]) * fc_frac(a),
            "all_gather_tensor": lambda a: nbytes(a["self"]) * group_size(a["group"]) * fc_frac(a),
            "reduce_scatter_tensor": lambda a: nbytes(a["self"]) * fc_frac(a),
            "all_gather_single": lambda a: nbytes(a["self"]) * group_size(a["group"]) * fc_frac(a),
            "reduce_scatter_single": lambda a: nbytes(a["self"]) * fc_frac(a),
        }
        for name, cost in functional.items():
            original = getattr(funcol, name, None)
            if original is not None:
                setattr(funcol, name, self._wrap(f"functional.{name}", original, inspect.signature(original),
                                                 cost))

    def _wrap(self, name, original, signature, cost):
        counter, local = self, self._local

        def wrapper(*args, **kwargs):
            depth = getattr(local, "depth", 0)
            if counter.enabled and depth == 0:
                try:
                    counter.bytes[name] += cost(signature.bind(*args, **kwargs).arguments)
                except Exception:  # an unexpected call form: count the call, not its bytes
                    pass
                counter.calls[name] += 1
            local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                local.depth = depth

        wrapper.__name__ = name
        wrapper.__wrapped__ = original
        return wrapper


def _socket_bytes_written() -> Optional[int]:
    """Bytes this process has written through write-like system calls (sockets included)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _worker(args: argparse.Namespace) -> None:
    rss_start = _common.rss_now_mib()
    import torch
    import torch.distributed as dist

    counter = CollectiveCounter()
    counter.install()  # before any system binds the collectives it will use
    # the system's modules, imported up front (torch.distributed.fsdp and
    # torch.distributed.optim each add 45-50 MiB; DDP's constructor imports as much lazily)
    for module in BY_NAME[args.system].imports:
        importlib.import_module(module)
    if args.system.startswith("ds"):
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gpt = _common.load_example_gpt()
    torch.manual_seed(args.seed)
    model = gpt.build_gpt(args.model)
    n_params = model.num_parameters()
    # a rank of a tensor-parallel or pipeline grid stands for several data-parallel ranks of the
    # other systems: it trains on their batches (concatenated, or one micro-batch each in a pipeline)
    per_rank = [_common.make_batches(gpt, model.config.block_size, args.micro_batch, args.warmup + args.steps,
                                     args.seed, r) for r in stands_for(args.system, rank, world)]
    if "-pp2" in args.system:
        batches = [tuple(list(parts) for parts in zip(*step)) for step in zip(*per_rank)]
    else:
        batches = [tuple(torch.cat(parts) for parts in zip(*step)) for step in zip(*per_rank)]
    rss_model = _common.rss_now_mib()
    trainer = build(args.system, model, gpt, args, world)
    rss_ready = _common.rss_now_mib()

    times, losses, norms = [], [], []
    wire0 = None
    for i, (x, y) in enumerate(batches):
        if i == args.warmup:
            counter.reset()
            counter.enabled = True
            wire0 = _socket_bytes_written()
        t0 = time.perf_counter()
        loss, norm = trainer.step(x, y)
        elapsed = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(elapsed)
        losses.append(loss.item())
        norms.append(norm_value(norm))
    counter.enabled = False
    wire1 = _socket_bytes_written()
    extra_bytes, extra_calls = trainer.extra_comm()
    own = trainer.own_comm_bytes()
    row = {
        "rank": rank, "world": world, "params": n_params, "seq_len": model.config.block_size,
        "step_s": statistics.median(times), "step_times_s": times,
        "peak_rss_mib": _common.peak_rss_mib(), "rss_start_mib": rss_start,
        "rss_model_mib": rss_model, "rss_ready_mib": rss_ready,
        "comm_bytes_per_step": sum(counter.bytes.values()) / args.steps + extra_bytes,
        "comm_calls_per_step": sum(counter.calls.values()) / args.steps + extra_calls,
        "comm_bytes_by_call": {k: v / args.steps for k, v in sorted(counter.bytes.items())},
        "comm_calls_by_call": {k: v / args.steps for k, v in sorted(counter.calls.items())},
        "socket_bytes_per_step": (wire1 - wire0) / args.steps if wire0 is not None and wire1 is not None else None,
        "own_comm_bytes_last_step": own,
        "own_comm_by_group_last_step": trainer.own_comm_by_group(),
        "losses": losses, "grad_norms": norms,
    }
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(_common.RESULT_PREFIX + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ driver side

def _missing(system: System) -> Optional[str]:
    """Why ``system`` cannot run here (not installed), or None."""
    if system.family == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "not installed: pip install deepspeed"
    if system.family == "zerodp" and importlib.util.find_spec("zerodp") is None:
        return "not installed: pip install -e ."
    if system.name.startswith("fsdp2"):
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            import torch
            return f"not available in torch {torch.__version__}: pip install 'torch>=2.6'"
    return None


@dataclasses.dataclass
class Run:
    system: str
    world: int
    rep: int
    rows: Optional[list] = None      # one dict per rank
    error: Optional[str] = None
    seconds: float = 0.0
    kind: str = "time"               # "time": step times, glibc's defaults; "memory": RSS (MALLOC_MMAP_THRESHOLD_)


def _launch(system: str, world: int, rep: int, args, log_dir: str, kind: str = "time") -> Run:
    extra = {"DS_ACCELERATOR": "cpu"} if BY_NAME[system].family == "deepspeed" else {}
    steps = args.steps if kind == "time" else 1
    cmd = ["--worker", "--system", system, "--model", args.model, "--steps", str(steps),
           "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch),
           "--bucket-mb", str(args.bucket_mb), "--clip", str(args.clip), "--seed", str(args.seed),
           "--nvme-path", args.nvme_path or tempfile.gettempdir()]
    if args.prefetch_mb is not None:
        cmd += ["--prefetch-mb", str(args.prefetch_mb)]
    env = _common.worker_env(world, extra, memory=kind == "memory")
    launch = _common.torchrun(__file__, world, cmd, env, timeout=args.timeout)
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, f"w{world}-{system}-{kind}-rep{rep}.log"), "w") as f:
        f.write(f"exit {launch.returncode}, {launch.seconds:.1f} s\n--- stdout\n{launch.stdout}\n"
                f"--- stderr\n{launch.stderr}\n")
    rows = launch.result()
    if rows is None:
        return Run(system, world, rep, error=_common.failure_reason(launch), seconds=launch.seconds, kind=kind)
    return Run(system, world, rep, rows=rows, seconds=launch.seconds, kind=kind)


@dataclasses.dataclass
class Summary:
    """One table row: a system at a world size, over its repetitions."""

    world: int
    system: str
    step_s: Optional[float] = None
    step_range_s: Optional[tuple[float, float]] = None  # the fastest and slowest run's step time
    vs_ddp: Optional[float] = None
    peak_rss_mib: Optional[float] = None
    rss_ready_mib: Optional[float] = None
    comm_mib: Optional[float] = None
    socket_mib: Optional[float] = None
    calls: Optional[float] = None
    grad_norm: Optional[float] = None
    loss: Optional[float] = None
    reps: int = 0
    note: str = ""
    ok: bool = True


def summarize(runs: list[Run], worlds: list[int], systems: list[str], skipped: dict[str, str]) -> list[Summary]:
    """Table rows: medians over repetitions of per-run figures (a run's step time is the
    slowest rank's median step; its RSS the largest rank's; bytes are averaged over ranks),
    the ratio to DDP at the same world size, and agreement checks against DDP (or, without
    DDP, the first system that ran). Step times, bytes and losses come from the timed runs,
    RSS from the memory runs (``Run.kind``), whose first gradient norm must be the timed runs'."""
    out: list[Summary] = []
    for world in worlds:
        rows_w: list[Summary] = []
        for system in systems:
            s = Summary(world, system)
            rows_w.append(s)
            if system in skipped:
                s.note, s.ok = skipped[system], False
                continue
            mine = [r for r in runs if r.world == world and r.system == system]
            good = [r for r in mine if r.rows and r.kind == "time"]
            bad = [r for r in mine if not r.rows]
            memory = [r for r in mine if r.rows and r.kind == "memory"]
            s.reps = len(good)
            if memory:
                s.peak_rss_mib = _common.median(max(r["peak_rss_mib"] for r in run.rows) for run in memory)
                s.rss_ready_mib = _common.median(max(r["rss_ready_mib"] for r in run.rows) for run in memory)
            if not good:
                s.ok = bool(memory) and not bad
                s.note = f"failed: {bad[0].error}" if bad else "memory runs only" if memory else "not run"
                continue
            if bad:
                s.note = f"{len(bad)} of {len(bad) + len(good) + len(memory)} runs failed: {bad[0].error}"
            per_run = [max(r["step_s"] for r in run.rows) for run in good]
            s.step_s = _common.median(per_run)
            s.step_range_s = (min(per_run), max(per_run))
            s.comm_mib = _common.median(statistics.fmean(r["comm_bytes_per_step"] for r in run.rows) / 2**20
                                        for run in good)
            s.socket_mib = _common.median(
                statistics.fmean(r["socket_bytes_per_step"] for r in run.rows) / 2**20
                for run in good if all(r["socket_bytes_per_step"] is not None for r in run.rows))
            s.calls = _common.median(statistics.fmean(r["comm_calls_per_step"] for r in run.rows) for run in good)
            s.grad_norm = good[0].rows[0]["grad_norms"][0]
            for run in memory:
                if abs(run.rows[0]["grad_norms"][0] - s.grad_norm) > GRAD_NORM_RTOL * abs(s.grad_norm):
                    s.ok = False
                    s.note = _join(s.note, f"DISAGREES: the memory run's step-1 grad norm "
                                           f"{run.rows[0]['grad_norms'][0]:.6g} vs the timed runs' {s.grad_norm:.6g}")
            finals = [statistics.fmean(r["losses"][-1] for r in run.rows) for run in good]
            s.loss = finals[0]
            if max(finals) - min(finals) > LOSS_ATOL:
                s.note = _join(s.note, f"final loss varies between repetitions ({min(finals):.4f}..{max(finals):.4f})")
        ref = next((s for s in rows_w if s.system == "ddp" and s.step_s is not None),
                   next((s for s in rows_w if s.step_s is not None), None))
        for s in rows_w:
            if s.step_s is None or ref is None:
                continue
            s.vs_ddp = _common.ratio(s.step_s, ref.step_s) if ref.system == "ddp" else None
            if s is ref:
                continue
            if abs(s.grad_norm - ref.grad_norm) > GRAD_NORM_RTOL * abs(ref.grad_norm):
                s.ok = False
                s.note = _join(s.note, f"DISAGREES: step-1 grad norm {s.grad_norm:.6g} vs {ref.system} "
                                       f"{ref.grad_norm:.6g} (x{s.grad_norm / ref.grad_norm:.3g})")
            if abs(s.loss - ref.loss) > LOSS_ATOL:
                s.ok = False
                s.note = _join(s.note, f"DISAGREES: final loss {s.loss:.4f} vs {ref.system} {ref.loss:.4f}")
        out.extend(rows_w)
    return out


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[Summary]) -> str:
    """The Markdown table of ``rows``."""
    lines = ["| world | system | step (ms, median) | runs' range (ms) | vs DDP | peak RSS / rank (MiB) "
             "| RSS after setup (MiB) | comm / step / rank (MiB) | socket writes / step / rank (MiB) "
             "| collectives / step / rank | grad norm, step 1 | final loss | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        system = s.system if s.ok or s.step_s is None else f"**{s.system}** (!)"
        span = "-" if s.step_range_s is None else f"{s.step_range_s[0] * 1e3:.0f}-{s.step_range_s[1] * 1e3:.0f}"
        lines.append(
            f"| {s.world} | {system} | {_fmt(s.step_s and s.step_s * 1e3, '.1f')} | {span} | {_fmt(s.vs_ddp, '.2f')} "
            f"| {_fmt(s.peak_rss_mib, '.0f')} | {_fmt(s.rss_ready_mib, '.0f')} | {_fmt(s.comm_mib, '.1f')} "
            f"| {_fmt(s.socket_mib, '.1f')} | {_fmt(s.calls, '.0f')} | {_fmt(s.grad_norm, '.5f')} "
            f"| {_fmt(s.loss, '.4f')} | {s.note.replace('|', '/')} |")
    return "\n".join(lines)


def plot(rows: list[Summary], worlds: list[int], path: str) -> Optional[str]:
    """Bar charts of the step-time ratio to DDP and of peak RSS per rank, one column per
    world size. Returns why no chart was written, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not installed: pip install matplotlib"
    colors = {"torch": "#4C72B0", "deepspeed": "#DD8452", "zerodp": "#55A868"}
    fig, axes = plt.subplots(2, len(worlds), figsize=(5.5 * len(worlds), 7.5), squeeze=False)
    for col, world in enumerate(worlds):
        rs = [s for s in rows if s.world == world]
        names = [s.system for s in rs]
        bar_colors = [colors[BY_NAME[s.system].family] for s in rs]
        for row, (attr, label) in enumerate([("vs_ddp", "step time / DDP's"), ("peak_rss_mib", "peak RSS per rank (MiB)")]):
            ax = axes[row][col]
            vals = [getattr(s, attr) or 0.0 for s in rs]
            bars = ax.bar(range(len(rs)), vals, color=bar_colors)
            for bar, s in zip(bars, rs):
                x = bar.get_x() + bar.get_width() / 2
                if getattr(s, attr) is None:
                    ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=8)
                    continue
                if not s.ok:
                    bar.set_hatch("//")
                ax.text(x, bar.get_height(), format(getattr(s, attr), ".2f" if attr == "vs_ddp" else ".0f"),
                        ha="center", va="bottom", fontsize=7)
            if attr == "vs_ddp":
                ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            else:
                present = [v for v in vals if v]
                if present:  # the axis starts near the smallest bar, to show the differences
                    ax.set_ylim(min(present) * 0.9, max(present) * 1.05)
            ax.set_xticks(range(len(rs)))
            ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(f"world size {world}")
            ax.grid(axis="y", alpha=0.3)
    handles = [matplotlib.patches.Patch(color=c, label=f) for f, c in colors.items()]
    handles.append(matplotlib.patches.Patch(facecolor="white", edgecolor="black", hatch="//",
                                            label="disagrees with DDP"))
    fig.legend(handles=handles, loc="upper center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _header(args, params: Optional[int], seq_len: Optional[int]) -> str:
    import torch
    versions = [f"torch {torch.__version__}"]
    for pkg in ("deepspeed", "zerodp"):
        try:
            from importlib.metadata import version
            versions.append(f"{pkg} {version(pkg)}")
        except Exception:
            pass
    p = f"{params / 1e6:.2f}M parameters, " if params else ""
    seq = f" x {seq_len} tokens" if seq_len else ""
    return (f"model `{args.model}` ({p}fp32), micro-batch {args.micro_batch}{seq} per rank, "
            f"{args.warmup} warm-up + {args.steps} timed steps, {args.reps} repetitions "
            f"(RSS: {args.memory_reps} run{'s' if args.memory_reps != 1 else ''} of {args.warmup} + 1 steps "
            f"with MALLOC_MMAP_THRESHOLD_={_common.MMAP_THRESHOLD}), "
            f"{args.bucket_mb:g} MiB buckets, stage-3 prefetch "
            f"{'one block' if args.prefetch_mb is None else f'{args.prefetch_mb:g} MiB'}, gradient clipping {args.clip:g}, gloo on "
            f"{os.cpu_count()} CPU cores ({platform.machine()}), {', '.join(versions)}")


def main(argv: Optional[list[str]] = None) -> int:
    names = [s.name for s in SYSTEMS]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every run, interleaved (default 3)")
    default = [n for n in names if not n.endswith(("-offload", "-nvme")) and "-tp2" not in n and "-pp2" not in n]
    ap.add_argument("--systems", nargs="+", default=default, choices=names, metavar="SYSTEM",
                    help=f"systems to run, in this order (default: {' '.join(default)}; also "
                         f"{' '.join(n for n in names if n not in default)})")
    ap.add_argument("--model", default="medium", choices=["tiny", "small", "medium"], help="example GPT size (default medium)")
    ap.add_argument("--steps", type=int, default=4, help="timed optimizer steps per run (default 4)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step (default 2)")
    ap.add_argument("--bucket-mb", type=float, default=25.0,
                    help="gradient bucket size in MiB for every system that has one (default 25)")
    ap.add_argument("--prefetch-mb", type=float, default=None,
                    help="stage 3's prefetch (zerodp and DeepSpeed stage3_prefetch_bucket_size) in MiB "
                         "(default: one transformer block's parameters, the depth FSDP2 prefetches)")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="global gradient-norm clipping for every system; 0 disables (default 1.0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nvme-path", default=None,
                    help="directory for zero3-nvme's swap files (default: the system's temporary directory)")
    ap.add_argument("--memory-reps", type=int, default=1,
                    help="runs per world size and system that measure RSS (MALLOC_MMAP_THRESHOLD_, warm-up "
                         "and one step) apart from the timed runs; 0 leaves the RSS columns empty (default 1)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds before a run is killed (default 900)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                    help="output folder (default benchmarks/results/)")
    ap.add_argument("--markdown", help="write the table here (default OUT/peers.md)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", choices=names, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0

    os.makedirs(args.out, exist_ok=True)
    log_dir = os.path.join(args.out, "logs")
    skipped = {s: why for s in args.systems if (why := _missing(BY_NAME[s]))}
    for s, why in skipped.items():
        print(f"skipping {s}: {why}", flush=True)
    runs_of = {"time": args.reps, "memory": args.memory_reps}
    plan = [(rep, world, system, kind) for rep in range(max(runs_of.values())) for world in args.worlds
            for system in args.systems if system not in skipped and world % ranks_needed(system) == 0
            for kind in runs_of if rep < runs_of[kind]]
    runs: list[Run] = []
    t_start = time.perf_counter()
    for i, (rep, world, system, kind) in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] rep {rep + 1}/{runs_of[kind]} world {world} {system:16s} {kind:6s} ...",
              end=" ", flush=True)
        run = _launch(system, world, rep, args, log_dir, kind)
        runs.append(run)
        spent = time.perf_counter() - t_start
        eta = spent / i * (len(plan) - i)
        if run.rows:
            step = max(r["step_s"] for r in run.rows)
            loss = statistics.fmean(r["losses"][-1] for r in run.rows)
            what = f"step {step * 1e3:8.1f} ms  loss {loss:.4f}"
        else:
            what = f"FAILED: {run.error}"
        print(f"{run.seconds:5.1f} s  {what}  (elapsed {spent / 60:.1f} min, ~{eta / 60:.1f} min left)", flush=True)

    rows = summarize(runs, args.worlds, args.systems, skipped)
    first = next((run.rows[0] for run in runs if run.rows), {})
    header = _header(args, first.get("params"), first.get("seq_len"))
    table = format_table(rows)
    command = "python benchmarks/peers.py " + " ".join(sys.argv[1:] if argv is None else argv)
    total = time.perf_counter() - t_start
    print(f"\n{header}\n\n{table}\n")
    for s in rows:
        if "DISAGREES" in s.note:
            print(f"WARNING: world {s.world} {s.system}: {s.note}", flush=True)
    md_path = args.markdown or os.path.join(args.out, "peers.md")
    with open(md_path, "w") as f:
        f.write(f"`{command.strip()}` ({total / 60:.1f} min)\n\n{header}\n\n{table}\n")
    with open(os.path.join(args.out, "peers.json"), "w") as f:
        json.dump({"command": command.strip(), "header": header, "seconds": total,
                   "summary": [dataclasses.asdict(s) for s in rows],
                   "runs": [dataclasses.asdict(r) for r in runs]}, f, indent=1)
    png = os.path.join(args.out, "peers.png")
    why = plot(rows, args.worlds, png)
    print(f"wrote {md_path}, {os.path.join(args.out, 'peers.json')}"
          + (f", {png}" if why is None else f" (no chart: {why})") + f"  [{total / 60:.1f} min]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

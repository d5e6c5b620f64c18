"""Offload benchmark: the CPU Adam, step times, the disk tile walk, the largest model under a cap.

``--part adam`` (the optimizer step on the CPU). A CPU Adam step is memory-bound: per fp32
parameter it reads the parameter, its gradient and the two moments and writes the parameter and
the moments back, 28 bytes. This measures, on the same tensors and in one run (interleaved
repetitions, medians):

* this machine's memory bandwidth with a STREAM-like copy (``b.copy_(a)``: 8 bytes per element
  moved) and triad (``a = b + s * c``: 12 bytes), the limit for any Adam kernel;
* ``torch.optim.AdamW`` as torch builds it by default on CPU (a loop over tensors), with
  ``foreach=True`` and with ``fused=True``, on one flat tensor and on 200 pieces (zerodp hands
  the optimizer one piece per parameter);
* ``zerodp.ops.adam.DeepSpeedCPUAdam`` and the optimizer zerodp builds from a config's
  ``{"type": "AdamW"}`` block (``zerodp.core.assemble.build_optimizer``), on the 200 pieces.

``--part steps``: the example GPT's step time with no offload, optimizer offload to host
memory and to disk, against DeepSpeed's ZeRO-Offload, through ``benchmarks/peers.py`` (same
model, data, clipping; each system's own CPU Adam), at world size 2.

``--part disk``: the disk's sequential write and read bandwidth (page cache flushed and
dropped, ``posix_fadvise``), three ways of reading a swap file into memory (threads issuing
``preadv`` of ``aio.block_size`` blocks, into fresh or reused memory; ``O_DIRECT``; ``mmap``
then a copy), and zerodp's tile walk (``zerodp.offload.swap``: read tile k+1 while tile k is
written back) against reading and then writing the same bytes.

``--part cap``: the largest stack of 512 x 512 bf16 layers that trains (two ranks, ``--cap-ranks``) under a
per-rank memory cap (peak RSS over the process's start, ``MALLOC_MMAP_THRESHOLD_`` set) at stage
0, stage 3, stage 3 with the optimizer in host memory and stage 3 with it (and the parameter
shards) on disk: two sizes
measured per setting, the largest size under the cap predicted from them, then run to confirm.

Usage::

    python benchmarks/offload.py [--part adam steps disk cap] [--params 25e6] [--threads 2] [--reps 5]
                                 [--cap-mib 256] [--cap-ranks 2] [--disk-dir DIR]

Prints tables and writes them to ``benchmarks/results/offload.md``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _offload_parts import cap_section, disk_section, step_times  # noqa: E402

BYTES_PER_PARAM = 28  # read p, g, m, v; write p, m, v (fp32)
PIECES = 200


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _adam_case(n: int, pieces: int, build: Callable[[list], torch.optim.Optimizer]) -> Callable[[], object]:
    flat = torch.randn(n)
    grad = torch.randn(n) * 1e-2
    size = -(-n // pieces)
    params = [torch.nn.Parameter(flat[i:i + size]) for i in range(0, n, size)]
    for p, i in zip(params, range(0, n, size)):
        p.grad = grad[i:i + size]
    opt = build(params)
    opt.step()  # state allocated outside the timing
    return opt.step


def _zerodp_config_adamw(params: list) -> torch.optim.Optimizer:
    from zerodp.core.assemble import build_optimizer
    from zerodp.config import load_config
    cfg = load_config({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    return build_optimizer(cfg, [{"params": params}], [params], None)


def _deepspeed_cpu_adam(params: list) -> torch.optim.Optimizer:
    from zerodp.ops.adam import DeepSpeedCPUAdam
    return DeepSpeedCPUAdam(params, lr=1e-3)


def cases(n: int) -> dict[str, tuple[str, Callable[[], object], int]]:
    """name -> (what, step function, bytes moved per call)."""
    a, b, c = torch.randn(n), torch.empty(n), torch.randn(n)
    adam = BYTES_PER_PARAM * n
    return {
        "copy": ("memory: b.copy_(a)", lambda: b.copy_(a), 8 * n),
        "triad": ("memory: torch.add(b, c, alpha=s, out=a)", lambda: torch.add(c, a, alpha=0.5, out=b), 12 * n),
        "default-flat": ("torch AdamW, default (CPU: a loop over tensors), 1 tensor",
                         _adam_case(n, 1, lambda ps: torch.optim.AdamW(ps, lr=1e-3)), adam),
        "foreach-flat": ("torch AdamW foreach=True, 1 tensor",
                         _adam_case(n, 1, lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)), adam),
        "fused-flat": ("torch AdamW fused=True, 1 tensor",
                       _adam_case(n, 1, lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)), adam),
        "default-pieces": (f"torch AdamW, default, {PIECES} pieces",
                           _adam_case(n, PIECES, lambda ps: torch.optim.AdamW(ps, lr=1e-3)), adam),
        "foreach-pieces": (f"torch AdamW foreach=True, {PIECES} pieces",
                           _adam_case(n, PIECES, lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)), adam),
        "fused-pieces": (f"torch AdamW fused=True, {PIECES} pieces",
                         _adam_case(n, PIECES, lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)), adam),
        "zerodp-config": (f"zerodp, config {{\"type\": \"AdamW\"}}, {PIECES} pieces",
                          _adam_case(n, PIECES, _zerodp_config_adamw), adam),
        "zerodp-cpuadam": (f"zerodp.ops.adam.DeepSpeedCPUAdam, {PIECES} pieces",
                           _adam_case(n, PIECES, _deepspeed_cpu_adam), adam),
    }


def run(n: int, reps: int) -> list[dict]:
    table = cases(n)
    times: dict[str, list[float]] = {k: [] for k in table}
    for _ in range(reps):  # interleaved, so load on the machine hits every case alike
        for name, (_, fn, _) in table.items():
            times[name].append(_timed(fn))
    copy_bw = table["copy"][2] / statistics.median(times["copy"])
    rows = []
    for name, (what, _, nbytes) in table.items():
        t = statistics.median(times[name])
        rows.append({"name": name, "what": what, "ms": t * 1e3, "gbs": nbytes / t / 1e9,
                     "gparams": (n / t / 1e9) if nbytes == BYTES_PER_PARAM * n else None,
                     "of_copy": nbytes / t / copy_bw})
    return rows


def format_rows(rows: list[dict], n: int, threads: int, reps: int) -> str:
    lines = [f"Optimizer step on CPU: {n / 1e6:.0f}M fp32 parameters, {threads} threads, median of {reps}; "
             f"torch {torch.__version__}",
             "",
             "| case | ms | G params/s | GB/s | of copy bandwidth |",
             "|---|---|---|---|---|"]
    for r in rows:
        gp = f"{r['gparams']:.2f}" if r["gparams"] is not None else ""
        lines.append(f"| {r['what']} | {r['ms']:.1f} | {gp} | {r['gbs']:.1f} | {100 * r['of_copy']:.0f}% |")
    lines += ["", "GB/s: bytes moved per call over its time; Adam moves 28 bytes per parameter (reads "
              "parameter, gradient, two moments; writes parameter, two moments); copy moves 8 per element, "
              "triad 12. \"of copy bandwidth\": that over the copy's GB/s, the target being >= 70% for the "
              "step zerodp runs."]
    return "\n".join(lines)


PARTS = ("adam", "steps", "disk", "cap")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", nargs="+", choices=PARTS, default=list(PARTS), help="what to run (default all)")
    ap.add_argument("--params", type=float, default=25e6, help="adam: fp32 parameters (default 25e6)")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="adam: torch threads (default 2)")
    ap.add_argument("--reps", type=int, default=5, help="adam: repetitions, interleaved (default 5); the "
                                                         "steps part runs each system 3 times")
    ap.add_argument("--disk-dir", default=None, help="disk, steps, cap: directory on the disk to measure and "
                                                     "swap to (default: the system's temporary directory)")
    ap.add_argument("--disk-mib", type=int, default=1024, help="disk: bytes of swap files (default 1024 MiB)")
    ap.add_argument("--cap-mib", type=int, default=256, help="cap: per-rank memory cap (default 256 MiB)")
    ap.add_argument("--cap-ranks", type=int, default=2, help="cap: ranks (default 2)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if args.params < 1000 or args.reps < 1:
        ap.error("--params must be >= 1000 and --reps >= 1")
    disk_dir = args.disk_dir or tempfile.gettempdir()
    sections = []
    if "adam" in args.part:
        torch.set_num_threads(args.threads)
        n = int(args.params)
        sections.append(format_rows(run(n, args.reps), n, args.threads, args.reps))
        print(sections[-1], flush=True)
    if "steps" in args.part:
        sections.append(step_times(args, disk_dir))
        print(sections[-1], flush=True)
    if "disk" in args.part:
        sections.append(disk_section(disk_dir, args.disk_mib))
        print(sections[-1], flush=True)
    if "cap" in args.part:
        sections.append(cap_section(disk_dir, args.cap_mib, args.cap_ranks))
        print(sections[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "offload.md"), "w") as f:
        f.write(f"`python benchmarks/offload.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n")
        f.write("\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

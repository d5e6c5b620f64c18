"""Llama-3 8B and 70B simulated at 8 to 1,024 ranks (``zerodp simulate``), beside the estimate.

Each row runs ``zerodp simulate --json`` in a process of its own (one fake process group per
process) as rank 0 of the job, bf16 with AdamW, micro-batch 1 of ``--seq`` tokens, two optimizer
steps (the second measured). A row whose estimated peak exceeds the memory this machine has free
is not run, and the table says so. Prints a Markdown table (docs/benchmarks.md).

    python benchmarks/simulate_table.py [--seq 16] [--rows 8b-8,70b-64] [--json out.json] [--force]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {"8b": os.path.join(HERE, "models", "llama3-8b.json"), "70b": os.path.join(HERE, "models", "llama3-70b.json")}
#: name -> (model, world, stage, tp, pp)
ROWS = {
    "8b-8": ("8b", 8, 3, 1, 1), "8b-64": ("8b", 64, 3, 1, 1), "8b-1024": ("8b", 1024, 3, 1, 1),
    "70b-8": ("70b", 8, 3, 1, 1), "70b-64": ("70b", 64, 3, 1, 1), "70b-128": ("70b", 128, 3, 1, 1),
    "70b-1024": ("70b", 1024, 3, 1, 1),
    "8b-tp8-dp8": ("8b", 64, 3, 8, 1), "8b-tp8-dp128": ("8b", 1024, 3, 8, 1),
    "70b-tp8-dp128": ("70b", 1024, 3, 8, 1),
    "8b-tp8-pp4-dp32": ("8b", 1024, 3, 8, 4), "70b-tp8-pp4-dp32": ("70b", 1024, 3, 8, 4),
}
GIB = 2 ** 30


def available() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def needed(model: str, world: int, stage: int, tp: int, pp: int, seq: int) -> int:
    """What the rank would allocate, by the estimate; with tensor parallelism, the rank's slice is
    built whole before initialize shards it (twice: the slice and the flat buffers)."""
    from zerodp.estimator import estimate
    e = estimate(MODELS[model], ranks_per_node=world, tp=tp, pp=pp, micro_batch=1, seq_len=seq)
    row = e.row(stage)
    if tp > 1:
        return max(row.device_total, 2 * 2 * e.model.params)  # (e.model: one rank's slice)
    return row.device_total


def run(name: str, seq: int, force: bool = False) -> dict:
    model, world, stage, tp, pp = ROWS[name]
    need, free = needed(model, world, stage, tp, pp, seq), available()
    base = {"row": name, "model": model, "world": world, "stage": stage, "tp": tp, "pp": pp}
    if need > free and not force:
        return {**base, "skipped": f"needs about {need / GIB:.1f} GiB, {free / GIB:.1f} GiB free"}
    cmd = [sys.executable, "-m", "zerodp.tools.cli", "simulate", "--model", MODELS[model], "--world", str(world),
           "--stage", str(stage), "--tp", str(tp), "--pp", str(pp), "--seq", str(seq), "--json"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    if out.returncode != 0:
        return {**base, "skipped": f"failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"}
    return {**json.loads(out.stdout), **base, "wall_s": time.perf_counter() - t0}


def _g(n) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def table(results: list[dict]) -> str:
    head = ("| model | N | grid (TP x PP x DP) | model states sim / est GiB | gathered peak sim / est | "
            "buckets peak sim / est | peak sim / est GiB | collectives/step | GiB sent/step |")
    lines = [head, "|" + "---|" * 9]
    for r in results:
        grid = f"{r['tp']} x {r['pp']} x {r['world'] // (r['tp'] * r['pp'])}"
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['world']} | {grid} | not run: {r['skipped']} | | | | | |")
            continue
        e = r["estimated"]
        lines.append(f"| {r['model']} | {r['world']} | {grid} | {_g(r['model_states'])} / {_g(e['model_states'])} | "
                     f"{_g(r['gathered_parameters_peak'])} / {_g(e['gathered_parameters'])} | "
                     f"{_g(r['gradient_buckets_peak'])} / {_g(e['gradient_buckets'])} | "
                     f"{_g(r['peak'])} / {_g(e['device_total'])} | {r['collectives_per_step']} | "
                     f"{r['bytes_per_step'] / GIB:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--force", action="store_true", help="run rows the estimate says do not fit (its buffers "
                    "are bounds; the process may be killed for memory)")
    args = ap.parse_args()
    results = []
    for name in args.rows.split(","):
        print(f"[simulate_table] {name} ...", file=sys.stderr, flush=True)
        results.append(run(name, args.seq, args.force))
        r = results[-1]
        print(f"[simulate_table] {name}: {r.get('skipped') or _g(r['peak']) + ' GiB peak'}",
              file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    print(table(results))


if __name__ == "__main__":
    main()

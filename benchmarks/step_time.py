"""The step-time model against measurements on this machine: ``zerodp estimate --time --cluster
local`` beside ``benchmarks/peers.py``'s step times, same model, micro-batch, buckets, one thread
per rank, gloo.

    python benchmarks/step_time.py                           # world sizes 2, 4, 8 (runs peers.py)
    python benchmarks/step_time.py --from results/peers.json # a peers.py run already made

For each world size and system it prints the measured step (peers.py's median), the predicted one,
their ratio and the prediction's parts. The systems: ``ddp`` (predicted as stage 0), ``zero1``,
``zero2``, ``zero3``, ``zero2-offload``, ``zero3-tp2`` and ``zero1-pp2``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import zerodp

#: peers.py system -> (stage, offload, tp, pp)
SYSTEMS = {"ddp": (0, "none", 1, 1), "zero1": (1, "none", 1, 1), "zero2": (2, "none", 1, 1),
           "zero3": (3, "none", 1, 1), "zero2-offload": (2, "optimizer", 1, 1),
           "zero3-tp2": (3, "none", 2, 1), "zero1-pp2": (1, "none", 1, 2)}
SEQ = 256  # the example GPT's block size, peers.py's sequence


def measure(worlds: list[int], reps: int, model: str, micro_batch: int, bucket_mb: float, out: str) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, os.path.join(here, "peers.py"), "--worlds", *map(str, worlds), "--reps", str(reps),
           "--model", model, "--micro-batch", str(micro_batch), "--bucket-mb", str(bucket_mb), "--memory-reps", "0",
           "--systems", *SYSTEMS, "--out", out]
    print("running:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, "peers.json")) as f:
        return json.load(f)


def predict(system: str, world: int, model: str, micro_batch: int, bucket_mb: float, recalibrate: bool):
    stage, offload, tp, pp = SYSTEMS[system]
    est = zerodp.estimate("zerodp.examples.gpt:build_gpt", model_kwargs={"preset": model}, ranks_per_node=world,
                          precision="fp32", tp=tp, pp=pp, micro_batch=micro_batch * tp, seq_len=SEQ,
                          gradient_accumulation=pp, reduce_bucket_size=int(bucket_mb * 2**20 / 4),
                          cluster="local", recalibrate=recalibrate)
    return est.row(stage, offload).step_time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model", default="medium", choices=["tiny", "small", "medium"])
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--from", dest="source", default=None, help="a peers.json to read instead of running peers.py")
    ap.add_argument("--recalibrate", action="store_true", help="probe this machine again (else the cache)")
    args = ap.parse_args(argv)
    if args.source:
        with open(args.source) as f:
            data = json.load(f)
    else:
        data = measure(args.worlds, args.reps, args.model, args.micro_batch, args.bucket_mb,
                       tempfile.mkdtemp(prefix="step_time_"))
    cluster = zerodp.estimator.resolve_cluster("local", recalibrate=args.recalibrate)
    per_thread = cluster.cpu_optimizer_rate / (cluster.shared_cores or 1)
    print(f"\ncluster local: {cluster.description}; fp32 {cluster.flops['fp32'] / 1e9:.0f} GFLOP/s per thread "
          f"(a transformer layer reaches {cluster.gemm_efficiency:.2f} of it), gloo "
          f"{cluster.intra_bandwidth / 1e9:.2f} GB/s and {cluster.intra_latency * 1e6:.0f} us per ring step, "
          f"AdamW {per_thread / 1e6:.0f}M elements/s per thread\n")
    rows = []
    print("| world | system | measured (ms) | predicted (ms) | predicted / measured | compute | exposed comm | "
          "optimizer | offload | bubble |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in data["summary"]:
        if s["system"] not in SYSTEMS or s.get("step_s") is None:
            continue
        t = predict(s["system"], s["world"], args.model, args.micro_batch, args.bucket_mb, False)
        ratio = t.step_time_s / s["step_s"]
        rows.append((s["world"], s["system"], ratio))
        print(f"| {s['world']} | {s['system']} | {1e3 * s['step_s']:.0f} | {1e3 * t.step_time_s:.0f} | {ratio:.2f} | "
              f"{1e3 * t.compute_s:.0f} | {1e3 * t.communication_s:.0f} | {1e3 * t.optimizer_s:.0f} | "
              f"{1e3 * t.offload_s:.0f} | {1e3 * t.bubble_s:.0f} |")
    within = sum(abs(r - 1) <= 0.15 for _, _, r in rows)
    print(f"\n{within} of {len(rows)} predictions within 15% of the measured step")
    return 0


if __name__ == "__main__":
    sys.exit(main())

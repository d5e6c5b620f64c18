"""Muon's cost at 2, 4 and 8 ranks: the bytes each rank moves per step to bring its matrices whole to
their owners and the updates back, beside the gradients' own reduce-scatter and all-gather; the
Newton-Schulz FLOPs each rank spends (each about 1/N of the total); and the update's time beside
AdamW's on the same model and batches.

Each world size runs one ``torchrun`` job holding two engines built alike on the example GPT, one with
the config's ``"type": "Muon"`` and one with ``"AdamW"``; after a warm-up step each, the timed steps run
interleaved (one of each in turn, so that the machine's drift falls on both); the median is reported.
"update" is the wall time of ``engine.step()`` (the update and its collectives), "step" forward,
backward and update. Bytes are what the engine counted in the last step, per rank (the largest over
ranks); FLOPs are the owners' Newton-Schulz multiply-adds x 2 (``muon_math.ns_flops``).

    python benchmarks/muon.py                       # world 2, 4 and 8, stage 2, CPU
    python benchmarks/muon.py --stage 3 --preset medium --worlds 2 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def worker(stage: int, preset: str, micro: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import zerodp
    from zerodp.optim.muon_math import ns_flops

    cuda = _common.start_worker()
    rank = dist.get_rank()
    gpt = _common.load_example_gpt()

    def build():
        torch.manual_seed(0)
        return gpt.build_gpt(preset, dropout=0.0)

    def engine_for(optimizer: dict):
        config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9, "gradient_clipping": 1.0,
                  "optimizer": optimizer, "zero_optimization": {"stage": stage}}
        model = build()
        engine, opt, _, _ = zerodp.initialize(model=model, config=config, unit_classes=(type(model.blocks[0]),))
        return engine, opt

    engines = {"AdamW": engine_for({"type": "AdamW", "params": {"lr": 3e-4}}),
               "Muon": engine_for({"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-4}})}
    probe = build()
    matrices = [p for n, p in probe.named_parameters() if p.dim() >= 2 and "embed" not in n and "lm_head" not in n]
    total_flops = sum(ns_flops(p.shape) for p in matrices)
    params, block = sum(p.numel() for p in probe.parameters()), probe.config.block_size
    del probe
    batches = _common.make_batches(gpt, block, micro, 1 + steps, seed=0, rank=rank)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def one(name: str, x, y) -> tuple[float, float]:
        engine = engines[name][0]
        sync()
        t0 = time.perf_counter()
        _, loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        sync()
        t1 = time.perf_counter()
        engine.step()
        sync()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    times = {name: {"step": [], "update": []} for name in engines}
    for name in engines:  # warm-up
        one(name, *batches[0])
    for x, y in batches[1:]:
        for name in engines:
            step, update = one(name, x, y)
            times[name]["step"].append(step)
            times[name]["update"].append(update)
    mine = {"work": engines["Muon"][1].work(),
            "bytes": {name: dict(e.comm.counter.last_step) for name, (e, _) in engines.items()},
            "times": {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        print(_common.RESULT_PREFIX + json.dumps({"ranks": everyone, "total_flops": total_flops,
                                                  "matrices": len(matrices), "params": params}), flush=True)
    for engine, _ in engines.values():
        engine.destroy()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="world sizes (default 2 4 8)")
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2, 3), help="ZeRO stage (default 2)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--preset", default="small", help="example GPT size: tiny, small, medium (default small)")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step (default 4)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps (default 6)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # stage, preset
    args = ap.parse_args()
    if args.worker:
        worker(int(args.worker[0]), args.worker[1], args.micro_batch, args.steps)
        return
    t_start = time.perf_counter()
    rows = {}
    for world in args.worlds:
        env = _common.worker_env(world, memory=False)
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        launch = _common.torchrun(__file__, world, ["--worker", str(args.stage), args.preset, "--micro-batch",
                                                    str(args.micro_batch), "--steps", str(args.steps)],
                                  env, timeout=args.timeout)
        rows[world] = launch.result() or _common.failure_reason(launch)
        print(f"world {world}: " + ("done" if isinstance(rows[world], dict) else rows[world]), flush=True)
    print(f"\n`python benchmarks/muon.py --worlds {' '.join(map(str, args.worlds))} --stage {args.stage} "
          f"--device {args.device} --preset {args.preset} --micro-batch {args.micro_batch} --steps {args.steps}` "
          f"({(time.perf_counter() - t_start) / 60:.1f} min)\n")
    print("| ranks | matrices per rank | NS GFLOP per rank (max) | max / (total / N) | Muon exchange per rank "
          "(KiB, max) | gradients per rank (KiB) | AdamW update (ms) | Muon update (ms) | Muon / AdamW step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world, r in rows.items():
        if not isinstance(r, dict):
            print(f"| {world} | failed: {r} |  |  |  |  |  |  |  |")
            continue
        ranks = r["ranks"]
        counts = [x["work"]["matrices"] for x in ranks]
        flops = [x["work"]["flops"] for x in ranks]
        muon_bytes = max(x["bytes"]["Muon"].get("muon_gather", 0) + x["bytes"]["Muon"].get("muon_scatter", 0)
                         for x in ranks)
        grad_bytes = max(sum(v for k, v in x["bytes"]["AdamW"].items() if k in ("reduce_scatter", "all_gather",
                                                                               "all_reduce")) for x in ranks)
        t = ranks[0]["times"]
        print(f"| {world} | {min(counts)}-{max(counts)} of {r['matrices']} | {max(flops) / 1e9:.3f} "
              f"| {max(flops) / (r['total_flops'] / world):.2f} | {muon_bytes / 1024:,.0f} | {grad_bytes / 1024:,.0f} "
              f"| {t['AdamW']['update'] * 1e3:.1f} | {t['Muon']['update'] * 1e3:.1f} "
              f"| {t['Muon']['step'] / t['AdamW']['step']:.2f} |")


if __name__ == "__main__":
    main()

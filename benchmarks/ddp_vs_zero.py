"""Step time and memory: plain DDP against zerodp stages 0-3 on the example GPT.

Each (system, repetition) runs in a fresh set of processes (``torchrun``), so peak RSS is
that system's own; the systems are interleaved within every repetition, so machine noise
falls on all of them alike. The table reports, per world size and system, the median
optimizer-step time over all repetitions, its ratio to DDP's, peak RSS per rank (max over
ranks, median over repetitions), model-state bytes per rank, bytes communicated per step,
and the loss after the run (every system must reach the same loss). Stage 3 runs with each
GPT block as a unit, released after every use (``stage3_max_reuse_distance`` 0, so it moves
the full 3 x Psi), with prefetching (one 25 MiB bucket ahead) and without; its column
"waiting for gathers" is the time per step spent blocked on all-gathers, and the share of it
that prefetching removes is printed below the table.

    python benchmarks/ddp_vs_zero.py                     # world sizes 2 and 4, 3 repetitions
    python benchmarks/ddp_vs_zero.py --worlds 2 --reps 5 --model small --micro-batch 8

Step times come from the timed runs, which keep glibc's own allocator settings (as a user's
process has them). Peak RSS comes from one more run per world size and system (warm-up and
one step) with ``MALLOC_MMAP_THRESHOLD_=65536``, without which glibc keeps freed memory and
peak RSS hides the savings; that setting also makes every large allocation fault its pages
in afresh, which slows every system and stage 3 (which frees and gathers again within a
step) the most, so it is kept out of the timed runs (``_common.worker_env``).
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

SYSTEMS = ["ddp", "zero0", "zero1", "zero2", "zero3", "zero3-noprefetch"]


# ---------------------------------------------------------------------------- worker side

def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import zerodp
    from zerodp import accelerator
    from zerodp.core.collectives import all_gather_numbers
    from zerodp.examples import gpt
    from zerodp.examples.gpt import Block, build_gpt

    accelerator.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = accelerator.default_device()
    torch.manual_seed(args.seed)
    model = build_gpt(args.model).to(device)
    batches = _common.make_batches(gpt, model.config.block_size, args.micro_batch,
                                   args.warmup + args.steps, args.seed, rank)
    bucket_elems = int(args.bucket_mb * 2**20 / 4)
    adamw = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

    if args.system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model, bucket_cap_mb=args.bucket_mb)
        opt = torch.optim.AdamW(model.parameters(), **adamw)

        def train_step(x, y):
            _, loss = net(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        comm_bytes = 2 * sum(p.numel() * 4 for p in model.parameters()) * (world - 1) / world

        def model_state_bytes():
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            states = sum(v.numel() * v.element_size() for s in opt.state.values()
                         for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
            return 2 * params + states  # params + grads (DDP keeps grads allocated) + moments
    else:
        stage = int(args.system[len("zero")])
        prefetch = 0 if args.system.endswith("noprefetch") else bucket_elems
        config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
                  "steps_per_print": 10**9,
                  "zero_optimization": {"stage": stage, "overlap_comm": True,
                                        "reduce_bucket_size": bucket_elems,
                                        "allgather_bucket_size": bucket_elems,
                                        "stage3_prefetch_bucket_size": prefetch,
                                        "stage3_max_reuse_distance": 0}}
        # DDP's optimizer exactly (torch's default AdamW), not the fused one zerodp builds from
        # an "optimizer" config block, so the step times compare the engines alone
        engine, _, _, _ = zerodp.initialize(model=model, config=config, unit_classes=(Block,),
                                            optimizer=lambda groups: torch.optim.AdamW(groups, **adamw))

        def train_step(x, y):
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss
        comm_bytes = None

        def model_state_bytes():
            return engine.memory_breakdown()["model_states"]

    times, losses, waits = [], [], []
    for i, (x, y) in enumerate(batches):
        wait0 = engine.prefetcher.gather_wait_s if args.system.startswith("zero3") else 0.0
        x, y = x.to(device), y.to(device)
        accelerator.synchronize(device)
        t0 = time.perf_counter()
        loss = train_step(x, y)
        accelerator.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            if args.system.startswith("zero3"):
                waits.append(engine.prefetcher.gather_wait_s - wait0)
        losses.append(loss.item())
    if comm_bytes is None:
        comm_bytes = engine.comm_stats()["total"]
    # mean of this step's per-rank losses = the global-batch loss
    final = torch.tensor(losses[-1], device=device)
    dist.all_reduce(final)
    row = {"rank": rank, "step_s": statistics.median(times), "rss_mib": _common.peak_rss_mib(),
           "model_state_mib": model_state_bytes() / 2**20, "comm_mib": comm_bytes / 2**20,
           "final_loss": final.item() / world,
           "gather_wait_s": statistics.median(waits) if waits else 0.0}
    rows = all_gather_numbers(row, device=device)
    if rank == 0:
        print(_common.RESULT_PREFIX + json.dumps(rows), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- driver side

def _launch(system: str, world: int, args: argparse.Namespace, memory: bool = False) -> list[dict]:
    """One run: timed (glibc's defaults, ``--steps``), or for RSS (``memory``: warm-up and one step)."""
    cmd = ["--worker", "--system", system, "--model", args.model,
           "--steps", str(1 if memory else args.steps), "--warmup", str(args.warmup),
           "--micro-batch", str(args.micro_batch), "--bucket-mb", str(args.bucket_mb), "--seed", str(args.seed)]
    launch = _common.torchrun(__file__, world, cmd, _common.worker_env(world, memory=memory))
    rows = launch.result()
    if rows is None:
        raise RuntimeError(f"{system} at world {world} failed (exit {launch.returncode}):\n{launch.stderr[-3000:]}")
    return rows


def _table(results: dict, worlds: list[int], systems: list[str], memory: dict) -> str:
    hidden: list[str] = []
    lines = ["| world | system | step time (ms, median) | vs DDP | peak RSS / rank (MiB) | "
             "model states / rank (MiB) | comm / step / rank (MiB) | waiting for gathers (ms/step) "
             "| final loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for world in worlds:
        ddp_t = statistics.median(r["step_s"] for reps in results[(world, "ddp")] for r in reps)
        for system in systems:
            reps = results[(world, system)]
            step = statistics.median(r["step_s"] for rows in reps for r in rows)
            rss = statistics.median(max(r["rss_mib"] for r in rows) for rows in memory[(world, system)])
            ms = max(r["model_state_mib"] for r in reps[0])
            comm = max(r["comm_mib"] for r in reps[0])
            loss = reps[-1][0]["final_loss"]
            wait = statistics.median(max(r["gather_wait_s"] for r in rows) for rows in reps)
            wait_text = f"{wait * 1e3:.1f}" if system.startswith("zero3") else "-"
            lines.append(f"| {world} | {system} | {step * 1e3:.1f} | {step / ddp_t:.3f} | {rss:.0f} | "
                         f"{ms:.1f} | {comm:.1f} | {wait_text} | {loss:.4f} |")
        if {"zero3", "zero3-noprefetch"} <= set(systems):
            on = statistics.median(max(r["gather_wait_s"] for r in rows) for rows in results[(world, "zero3")])
            off = statistics.median(max(r["gather_wait_s"] for r in rows)
                                    for rows in results[(world, "zero3-noprefetch")])
            hidden.append(f"world {world}: prefetching hides {100 * (1 - on / off):.0f}% of the time "
                          f"stage 3 waits for all-gathers ({off * 1e3:.1f} -> {on * 1e3:.1f} ms per step)")
    return "\n".join(lines) + ("\n\n" + "\n".join(hidden) if hidden else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every system (interleaved)")
    ap.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS,
                    help="systems to run (ddp first: the ratios are to it)")
    ap.add_argument("--model", default="medium", help="example GPT preset (tiny, small, medium)")
    ap.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--bucket-mb", type=float, default=25.0,
                    help="gradient bucket size in MiB for DDP and zerodp alike")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", help="also write the table to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    results: dict = {(w, s): [] for w in args.worlds for s in args.systems}
    memory: dict = {(w, s): [] for w in args.worlds for s in args.systems}
    for rep in range(args.reps):
        for world in args.worlds:
            for system in args.systems:
                rows = _launch(system, world, args)
                results[(world, system)].append(rows)
                print(f"rep {rep + 1}/{args.reps} world {world} {system:6s} "
                      f"step {statistics.median(r['step_s'] for r in rows) * 1e3:8.1f} ms", flush=True)
                if rep == 0:
                    rows = _launch(system, world, args, memory=True)
                    memory[(world, system)].append(rows)
                    print(f"rep 1/{args.reps} world {world} {system:6s} "
                          f"peak RSS {max(r['rss_mib'] for r in rows):6.0f} MiB", flush=True)
    table = _table(results, args.worlds, args.systems, memory)
    print(f"\nmodel={args.model} micro_batch={args.micro_batch} steps={args.steps} reps={args.reps} "
          f"bucket={args.bucket_mb} MiB, CPU/gloo; peak RSS from one run of warm-up + 1 step with "
          f"MALLOC_MMAP_THRESHOLD_={_common.MMAP_THRESHOLD}\n")
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()

"""Step time and memory: plain DDP against zerodp stages 0-3 on the example GPT.

Step times come from *paired* runs: in one set of processes (``torchrun``) every system
trains its own copy of the model, one optimizer step each in turn (the order rotating from
step to step, the ranks meeting at a barrier before each), so the machine's load falls on all
of them alike; a step's time is its slowest rank's. The table reports, per world size and
system, the median step time over every repetition, and its ratio to DDP's as the median of
its per-step ratios to DDP's step time at that moment (interpolated between the DDP steps just
before and after it, at most five steps away), with their quartiles; peak RSS per rank
(max over ranks), model-state bytes per rank, bytes communicated per step, and the loss after
the run (every system must reach the same loss). Stage 3 runs with each GPT block as a unit,
released after every use (``stage3_max_reuse_distance`` 0, so it moves the full 3 x Psi less
the last block of forward, which backward uses next), with prefetching (one 25 MiB bucket
ahead) and without; its column "waiting for gathers" is the time per step spent blocked on
all-gathers, and the share of it that prefetching removes is printed below the table.

    python benchmarks/ddp_vs_zero.py                     # world sizes 2 and 4, 3 repetitions
    python benchmarks/ddp_vs_zero.py --worlds 2 --reps 5 --model small --micro-batch 8
    python benchmarks/ddp_vs_zero.py --systems ddp zero3 --reps 6

Peak RSS comes from one more run per world size and system, that system alone in its
processes (warm-up and one step), with ``MALLOC_MMAP_THRESHOLD_=65536``, without which glibc
keeps freed memory and peak RSS hides the savings; that setting also makes every large
allocation fault its pages in afresh, which slows every system and stage 3 (which frees and
gathers again within a step) the most, so it is kept out of the timed runs
(``_common.worker_env``), which keep glibc's own allocator settings (as a user's process has them).
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
#: also runnable: the same without hang detection (comms_timeout_s "off"), to price it
EXTRA = ["zero2-nowatch", "zero3-nowatch"]


# ---------------------------------------------------------------------------- worker side

def _build(system: str, args: argparse.Namespace, device, world: int) -> dict:
    """One system on its own copy of the model (the same initial weights for every system):
    its ``step(x, y) -> loss`` and what the table reads from it afterwards."""
    import torch

    import zerodp
    from zerodp.examples.gpt import Block, build_gpt

    torch.manual_seed(args.seed)
    model = build_gpt(args.model).to(device)
    bucket_elems = int(args.bucket_mb * 2**20 / 4)
    adamw = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model, bucket_cap_mb=args.bucket_mb)
        opt = torch.optim.AdamW(model.parameters(), **adamw)

        def step(x, y):
            _, loss = net(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        def model_state_bytes():
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            states = sum(v.numel() * v.element_size() for s in opt.state.values()
                         for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
            return 2 * params + states  # params + grads (DDP keeps grads allocated) + moments
        comm = 2 * sum(p.numel() * 4 for p in model.parameters()) * (world - 1) / world
        return {"step": step, "model_state_bytes": model_state_bytes, "comm_bytes": lambda: comm,
                "gather_wait_s": lambda: 0.0}

    stage = int(system[len("zero")])
    prefetch = 0 if system.endswith("noprefetch") else bucket_elems
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "comms_timeout_s": "off" if system.endswith("nowatch") else "auto",
              "zero_optimization": {"stage": stage, "overlap_comm": True,
                                    "reduce_bucket_size": bucket_elems,
                                    "allgather_bucket_size": bucket_elems,
                                    "stage3_prefetch_bucket_size": prefetch,
                                    "stage3_max_reuse_distance": 0}}
    # DDP's optimizer exactly (torch's default AdamW), not the fused one zerodp builds from
    # an "optimizer" config block, so the step times compare the engines alone
    engine, _, _, _ = zerodp.initialize(model=model, config=config, unit_classes=(Block,),
                                        optimizer=lambda groups: torch.optim.AdamW(groups, **adamw))

    def step(x, y):
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss
    return {"step": step, "model_state_bytes": lambda: engine.memory_breakdown()["model_states"],
            "comm_bytes": lambda: engine.comm_stats()["total"],
            "gather_wait_s": lambda: engine.sharded.gather_wait_s if stage == 3 else 0.0}


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from zerodp import accelerator
    from zerodp.core.collectives import all_gather_numbers
    from zerodp.examples import gpt

    accelerator.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = accelerator.default_device()
    systems = args.side_by_side.split(",")
    built = {s: _build(s, args, device, world) for s in systems}
    batches = _common.make_batches(gpt, gpt.GPT_PRESETS[args.model].block_size, args.micro_batch,
                                   args.warmup + args.steps, args.seed, rank)
    times = {s: [] for s in systems}
    at = {s: [] for s in systems}  # each timed step's place in the run's sequence of steps
    waits = {s: [] for s in systems}
    losses = {s: 0.0 for s in systems}
    for i, (x, y) in enumerate(batches):
        x, y = x.to(device), y.to(device)
        order = systems[i % len(systems):] + systems[:i % len(systems)]  # a rotating order
        for place, s in enumerate(order):
            dist.barrier()
            wait0 = built[s]["gather_wait_s"]()
            accelerator.synchronize(device)
            t0 = time.perf_counter()
            loss = built[s]["step"](x, y)
            accelerator.synchronize(device)
            if i >= args.warmup:
                times[s].append(time.perf_counter() - t0)
                at[s].append(i * len(systems) + place)
                waits[s].append(built[s]["gather_wait_s"]() - wait0)
            losses[s] = loss.item()
    out = {}
    for s in systems:
        slowest = torch.tensor(times[s] or [0.0], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
        final = torch.tensor(losses[s], device=device)
        dist.all_reduce(final)  # the mean of this step's per-rank losses = the global-batch loss
        mine = {"rss_mib": _common.peak_rss_mib(), "model_state_mib": built[s]["model_state_bytes"]() / 2**20,
                "comm_mib": built[s]["comm_bytes"]() / 2**20,
                "gather_wait_s": statistics.median(waits[s]) if waits[s] else 0.0}
        rows = all_gather_numbers(mine, device=device)
        out[s] = {"step_s": slowest.tolist(), "at": at[s], "final_loss": final.item() / world,
                  "rss_mib": max(r["rss_mib"] for r in rows),
                  "model_state_mib": max(r["model_state_mib"] for r in rows),
                  "comm_mib": max(r["comm_mib"] for r in rows),
                  "gather_wait_s": max(r["gather_wait_s"] for r in rows)}
    if rank == 0:
        print(_common.RESULT_PREFIX + json.dumps(out), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- driver side

def _launch(systems: list[str], world: int, args: argparse.Namespace, memory: bool = False) -> dict:
    """One run of ``systems`` side by side: timed (glibc's defaults, ``--steps``), or for RSS
    (``memory``: one system, warm-up and one step)."""
    cmd = ["--worker", "--side-by-side", ",".join(systems), "--model", args.model,
           "--steps", str(1 if memory else args.steps), "--warmup", str(args.warmup),
           "--micro-batch", str(args.micro_batch), "--bucket-mb", str(args.bucket_mb), "--seed", str(args.seed)]
    launch = _common.torchrun(__file__, world, cmd, _common.worker_env(world, memory=memory))
    out = launch.result()
    if out is None:
        raise RuntimeError(f"{systems} at world {world} failed (exit {launch.returncode}):\n{launch.stderr[-3000:]}")
    return out


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def _ratios_to_ddp(run: dict, system: str) -> list[float]:
    """Each step of ``system`` over DDP's step time at its place in the run: interpolated
    between the DDP steps before and after it (the nearest one at the ends)."""
    ddp = sorted(zip(run["ddp"]["at"], run["ddp"]["step_s"]))
    out = []
    for place, t in zip(run[system]["at"], run[system]["step_s"]):
        before = [d for d in ddp if d[0] <= place]
        after = [d for d in ddp if d[0] >= place]
        if before and after and after[0][0] > before[-1][0]:
            (p0, t0), (p1, t1) = before[-1], after[0]
            out.append(t / (t0 + (t1 - t0) * (place - p0) / (p1 - p0)))
        else:
            out.append(t / (before[-1] if before else after[0])[1])
    return out


def _table(results: dict, worlds: list[int], systems: list[str], memory: dict) -> str:
    hidden: list[str] = []
    lines = ["| world | system | step time (ms, median) | vs DDP (median of paired steps) | quartiles | "
             "peak RSS / rank (MiB) | model states / rank (MiB) | comm / step / rank (MiB) | "
             "waiting for gathers (ms/step) | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for world in worlds:
        runs = results[world]
        for system in systems:
            steps = [t for run in runs for t in run[system]["step_s"]]
            ratios = [r for run in runs for r in _ratios_to_ddp(run, system)]
            q1, q2, q3 = _quartiles(ratios)
            mem = memory[(world, system)][system]
            wait = statistics.median(run[system]["gather_wait_s"] for run in runs)
            wait_text = f"{wait * 1e3:.1f}" if system.startswith("zero3") else "-"
            lines.append(f"| {world} | {system} | {statistics.median(steps) * 1e3:.1f} | {q2:.3f} | "
                         f"{q1:.3f}-{q3:.3f} | {mem['rss_mib']:.0f} | {runs[0][system]['model_state_mib']:.1f} | "
                         f"{runs[0][system]['comm_mib']:.1f} | {wait_text} | {runs[-1][system]['final_loss']:.4f} |")
        if {"zero3", "zero3-noprefetch"} <= set(systems):
            on = statistics.median(run["zero3"]["gather_wait_s"] for run in runs)
            off = statistics.median(run["zero3-noprefetch"]["gather_wait_s"] for run in runs)
            hidden.append(f"world {world}: prefetching hides {100 * (1 - on / off):.0f}% of the time "
                          f"stage 3 waits for all-gathers ({off * 1e3:.1f} -> {on * 1e3:.1f} ms per step)")
    return "\n".join(lines) + ("\n\n" + "\n".join(hidden) if hidden else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=3, help="paired runs per world size")
    ap.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS + EXTRA,
                    help="systems to run (ddp is always among them: the ratios are to it)")
    ap.add_argument("--model", default="medium", help="example GPT preset (tiny, small, medium)")
    ap.add_argument("--steps", type=int, default=8, help="timed optimizer steps per system and run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--bucket-mb", type=float, default=25.0,
                    help="gradient bucket size in MiB for DDP and zerodp alike")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", help="also write the table to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side-by-side", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    systems = ["ddp"] + [s for s in args.systems if s != "ddp"]
    results: dict = {w: [] for w in args.worlds}
    memory: dict = {}
    for world in args.worlds:
        for system in systems:
            memory[(world, system)] = _launch([system], world, args, memory=True)
            print(f"world {world} {system:16s} peak RSS {memory[(world, system)][system]['rss_mib']:6.0f} MiB",
                  flush=True)
    for rep in range(args.reps):
        for world in args.worlds:
            run = _launch(systems, world, args)
            results[world].append(run)
            ddp = run["ddp"]["step_s"]
            print(f"rep {rep + 1}/{args.reps} world {world}: " + ", ".join(
                f"{s} {statistics.median(_ratios_to_ddp(run, s)):.3f}" for s in systems[1:])
                + f" (median step time over DDP's; DDP {statistics.median(ddp) * 1e3:.0f} ms)", flush=True)
    table = _table(results, args.worlds, systems, memory)
    print(f"\nmodel={args.model} micro_batch={args.micro_batch} steps={args.steps} reps={args.reps} "
          f"bucket={args.bucket_mb} MiB, CPU/gloo; systems side by side, one step each in turn; peak RSS "
          f"from one run per system of warm-up + 1 step with MALLOC_MMAP_THRESHOLD_={_common.MMAP_THRESHOLD}\n")
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()

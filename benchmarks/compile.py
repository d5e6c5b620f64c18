"""Step time of the example GPT compiled (``torch.compile``, inductor) over the same run uncompiled, at
each ZeRO stage, with the compile time apart and dynamo's counts; and FSDP2 with its blocks compiled
(``fully_shard`` per block, torchtitan's recipe) on the same model and batches.

Each system and stage runs in fresh ``torchrun`` processes that hold one model per mode, built alike: each
is warmed up in turn with two steps (at stage 3 the first runs uncompiled, recording the units' order; the
compilation happens in the second), then the ``--steps`` timed steps run interleaved, one of each mode in
turn, so that the machine's drift falls on all alike; the median is reported. "compile (s)" is the warm-up's
time over two steps of the eager twin. "graphs" and "frames" are what dynamo compiled in the row's warm-up,
"recompiled" what it compiled during the timed steps of the job (0 is the goal), "breaks" its graph
breaks in the warm-up (at stage 3: where a unit's hooks run). tokens/s and, on a GPU, MFU
(6 x parameters x tokens / step time / peak, ``--peak-tflops``) are per rank.

    python benchmarks/compile.py                              # stages 0-3 and FSDP2, world 2, CPU
    python benchmarks/compile.py --device cuda --world 1 --preset gpt2 --micro-batch 8 --bf16 --peak-tflops 989

Modes: ``eager``; ``engine`` (``engine.compile()``, as Accelerate calls it); ``blocks`` (each block
compiled in place before ``initialize``: at stage 3 each is one unit, and no graph breaks inside it).
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

#: shapes beyond the example's presets: GPT-2 small's, for a GPU
EXTRA = {"gpt2": ("medium", {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024})}


def worker(system: str, stage: int, modes: list[str], preset: str, micro: int, steps: int, bf16: bool) -> None:
    """One model per mode, built alike, trained side by side on the same batches: each warmed up in
    turn (its compile counted apart), then the timed steps interleaved, one of each mode in turn."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    cuda = _common.start_worker()
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    gpt = _common.load_example_gpt()
    base, shapes = EXTRA.get(preset, (preset, {}))

    def build():
        torch.manual_seed(0)
        return gpt.build_gpt(base, dropout=0.0, **shapes)

    def fsdp2_step(mode: str):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        model = build().to(device)
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
        for b in model.blocks:
            if mode != "eager":
                b.compile()
            fully_shard(b, **kw)
        fully_shard(model, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x, y):
            _, loss = model(x.to(device), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
        return step

    def zerodp_step(mode: str):
        import zerodp
        model = build()
        if mode == "blocks":
            for b in model.blocks:
                b.compile()
        config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9, "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage},
                  "bf16": {"enabled": bf16}}
        engine, *_ = zerodp.initialize(model=model, config=config, unit_classes=(type(model.blocks[0]),))
        if mode == "engine":
            engine.compile()

        def step(x, y):
            _, loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
        return step

    def sync():
        if cuda:
            torch.cuda.synchronize()

    probe = build()
    params, block = sum(p.numel() for p in probe.parameters()), probe.config.block_size
    del probe
    batches = _common.make_batches(gpt, block, micro, 2 + steps, seed=0, rank=rank)
    runs = {}
    for mode in modes:  # set up and warm up each mode in turn: its compile is counted on its own
        step = (fsdp2_step if system == "fsdp2" else zerodp_step)(mode)
        before = (counters["stats"]["unique_graphs"], counters["frames"]["total"],
                  sum(counters["graph_break"].values()))
        sync()
        t0 = time.perf_counter()
        for x, y in batches[:2]:
            step(x, y)
        sync()
        runs[mode] = {"step": step, "warm_s": time.perf_counter() - t0, "times": [],
                      "graphs": counters["stats"]["unique_graphs"] - before[0],
                      "frames": counters["frames"]["total"] - before[1],
                      "breaks": sum(counters["graph_break"].values()) - before[2]}
    settled = counters["frames"]["total"]
    for x, y in batches[2:]:
        for mode in modes:
            t0 = time.perf_counter()
            runs[mode]["step"](x, y)
            sync()
            runs[mode]["times"].append(time.perf_counter() - t0)
    rows = {mode: {"warm_s": r["warm_s"], "step_s": statistics.median(r["times"]), "params": params,
                   "tokens": micro * block, "graphs": r["graphs"], "frames": r["frames"], "breaks": r["breaks"],
                   "recompiled": counters["frames"]["total"] - settled} for mode, r in runs.items()}
    if rank == 0:
        print(_common.RESULT_PREFIX + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


#: (system, stage, the modes run side by side in one job)
JOBS = [("zerodp", 0, ["eager", "engine"]), ("zerodp", 1, ["eager", "engine"]), ("zerodp", 2, ["eager", "engine"]),
        ("zerodp", 3, ["eager", "engine", "blocks"]), ("fsdp2", 3, ["eager", "blocks"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--preset", default="small", help="example GPT size: tiny, small, medium, or gpt2 (GPT-2 small's "
                                                      "shapes) (default small)")
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision (FSDP2: bf16 parameters, fp32 reduction)")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step (default 8)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps (default 8)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="the device's peak, for MFU (default: none)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)  # system, stage, modes (a,b), preset
    args = ap.parse_args()
    if args.worker:
        system, stage, modes, preset = args.worker
        worker(system, int(stage), modes.split(","), preset, args.micro_batch, args.steps, args.bf16)
        return
    t_start = time.perf_counter()
    got = {}
    for system, stage, modes in JOBS:
        env = _common.worker_env(args.world, memory=False)
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        worker_args = ["--worker", system, str(stage), ",".join(modes), args.preset, "--micro-batch",
                       str(args.micro_batch), "--steps", str(args.steps)] + (["--bf16"] if args.bf16 else [])
        launch = _common.torchrun(__file__, args.world, worker_args, env, timeout=args.timeout)
        rows = launch.result()
        for mode in modes:
            got[(system, stage, mode)] = rows[mode] if rows else _common.failure_reason(launch)
        print(f"{system} stage {stage}: " + (", ".join(f"{m} {rows[m]['step_s'] * 1000:.1f} ms/step" for m in modes)
                                             if rows else _common.failure_reason(launch)), flush=True)
    bf16 = " --bf16" if args.bf16 else ""
    print(f"\n`python benchmarks/compile.py --device {args.device} --world {args.world} --preset {args.preset} "
          f"--micro-batch {args.micro_batch} --steps {args.steps}{bf16}` "
          f"({(time.perf_counter() - t_start) / 60:.1f} min)\n")
    print("| system | stage | mode | step (ms) | over eager | tokens/s per rank | MFU | compile (s) | graphs | frames "
          "| recompiled | breaks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for system, stage, mode in [(system, stage, m) for system, stage, modes in JOBS for m in modes]:
        r = got[(system, stage, mode)]
        if not isinstance(r, dict):
            print(f"| {system} | {stage} | {mode} | failed: {r} |  |  |  |  |  |  |  |  |")
            continue
        eager = got.get((system, stage, "eager"))
        eager = eager if isinstance(eager, dict) else None
        over = f"{r['step_s'] / eager['step_s']:.2f}" if eager else "-"
        compile_s = f"{r['warm_s'] - 2 * eager['step_s']:.1f}" if eager and mode != "eager" else "-"
        tps = r["tokens"] / r["step_s"]
        mfu = f"{6 * r['params'] * tps / (args.peak_tflops * 1e12):.1%}" if args.peak_tflops else "-"
        print(f"| {system} | {stage} | {mode} | {r['step_s'] * 1000:.1f} | {over} | {tps:,.0f} | {mfu} | {compile_s} "
              f"| {r['graphs']} | {r['frames']} | {r['recompiled']} | {r['breaks']} |")


if __name__ == "__main__":
    main()

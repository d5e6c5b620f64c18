"""ZeRO++ hpZ against plain stage 3 on the example GPT: memory per rank and bytes per step by group.

Each run trains the example GPT at stage 3 (each block a unit, released after every use:
``stage3_max_reuse_distance`` 0) on ``--world`` ranks, with ``zero_hpz_partition_size`` 1 (plain)
and ``--hpz`` K, for 1 and 2 micro-batches per step, in fp32 or bf16. Per run, rank 0's figures of
the last step: model-state bytes by category (the secondary copy at its peak: a trained group's is
dropped by the update), the bytes this rank sent over the whole data-parallel group and within the
hpZ group, and the step time (median; both systems run in turn in one set of processes, so the
machine's load falls on both alike), with the final loss (hpZ must give plain stage 3's).

    python benchmarks/hpz.py                          # world 4, K = 2, fp32
    python benchmarks/hpz.py --world 8 --hpz 4 --precision bf16

On one machine every group is "inside a node": the step time shows what the copies and the
extra collective calls cost, not the cross-node traffic hpZ saves (``zerodp estimate --time --hpz``
models that on a described cluster).
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

STATES = ("parameters", "gradients", "master_weights", "optimizer_states")


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import zerodp
    from zerodp.examples.gpt import Block, build_gpt

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gpt = _common.load_example_gpt()
    engines = {}
    for hpz in (1, args.hpz):
        torch.manual_seed(0)
        model = build_gpt(args.model)
        cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.gas,
               "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3, "zero_hpz_partition_size": hpz, "stage3_max_reuse_distance": 0}}
        if args.precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        engines[hpz], *_ = zerodp.initialize(model=model, config=cfg, unit_classes=(Block,))
    batches = _common.make_batches(gpt, engines[1].module.config.block_size, args.micro_batch,
                                   args.steps * args.gas, seed=0, rank=rank)
    times = {hpz: [] for hpz in engines}
    losses = {}
    for step in range(args.steps):
        for hpz in (engines if step % 2 == 0 else reversed(list(engines))):
            engine = engines[hpz]
            dist.barrier()
            t0 = time.perf_counter()
            for m in range(args.gas):
                x, y = batches[step * args.gas + m]
                _, loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            times[hpz].append(time.perf_counter() - t0)
            losses[hpz] = loss.item()
    out = {}
    for hpz, engine in engines.items():
        mem = engine.memory_breakdown()
        by_group = engine.comm_stats(by_group=True)
        out[hpz] = {**{k: mem[k] for k in STATES}, "copy": mem["secondary_parameters_peak"],
                    "data": by_group["data"]["total"],
                    "within": by_group.get("secondary", {}).get("total", 0),
                    "seconds": statistics.median(times[hpz][1:]), "loss": losses[hpz]}
        engine.destroy()
    if rank == 0:
        print(_common.RESULT_PREFIX + json.dumps(out), flush=True)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--hpz", type=int, default=2)
    parser.add_argument("--model", default="tiny", help="the example GPT's preset (default tiny)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--gas", type=int, default=None, help="one run with this many micro-batches (default: 1 and 2)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    print(f"example GPT '{args.model}', stage 3, world {args.world}, hpZ groups of {args.hpz}, {args.precision}, "
          f"micro-batch {args.micro_batch}; rank 0, last step (MiB)")
    head = ("gas", "system", "params", "grads", "master", "optim", "hpZ copy", "states", "sent: all ranks",
            "within group", "step s", "loss")
    print("  ".join(f"{h:>15}" if i > 1 else f"{h:<7}" for i, h in enumerate(head)))
    for gas in ([args.gas] if args.gas else [1, 2]):
        script_args = ["--worker", "--hpz", str(args.hpz), "--model", args.model, "--micro-batch",
                       str(args.micro_batch), "--steps", str(args.steps), "--precision", args.precision,
                       "--gas", str(gas)]
        launch = _common.torchrun(__file__, args.world, script_args, _common.worker_env(args.world, memory=False),
                                  timeout=1800)
        found = launch.result()
        if found is None:
            print(f"{gas:<7}  failed: {_common.failure_reason(launch)}")
            continue
        for hpz, label in (("1", "plain"), (str(args.hpz), f"hpZ {args.hpz}")):
            r = found[hpz]
            states = sum(r[k] for k in STATES) + r["copy"]
            row = [str(gas), label] + [_mib(r[k]) for k in (*STATES, "copy")]
            row += [_mib(states), _mib(r["data"]), _mib(r["within"]), f"{r['seconds']:.3f}", f"{r['loss']:.6f}"]
            print("  ".join(f"{c:>15}" if i > 1 else f"{c:<7}" for i, c in enumerate(row)))
        plain, hpz = found["1"], found[str(args.hpz)]
        print(f"        hpZ / plain: bytes over all ranks {hpz['data'] / plain['data']:.3f}, "
              f"step time {hpz['seconds'] / plain['seconds']:.3f}, model states "
              f"{(sum(hpz[k] for k in STATES) + hpz['copy']) / sum(plain[k] for k in STATES):.3f}")


if __name__ == "__main__":
    main()

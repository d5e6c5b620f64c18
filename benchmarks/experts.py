"""Expert parallelism against leaf-module ZeRO-3 on a small mixture-of-experts model at world 4.

transformers' Qwen3-MoE (8 experts, top-2) trains at ZeRO stage 3, fp32, AdamW, on 4 ranks, each
configuration in fresh ``torchrun`` processes: expert-parallel size 1 (every rank holds and gathers
every expert; the sparse MoE block is a leaf, DeepSpeed's default), 2 and 4 (the config's
``expert_parallel.autoep_size``: a rank holds 1/ep of the experts whole, tokens travel to them by
all-to-all). Per configuration: the median step time over the timed steps, each rank's resident
high-water mark over its RSS after set-up (glibc returning freed memory; the largest rank), and the
bytes rank 0 sent in the last step by group (``engine.comm_stats``: the data-parallel gathers and
reductions, the expert-data group's, and the token all-to-alls).

    python benchmarks/experts.py                 # ep 1 2 4, 2 warm-up and 3 timed steps
    python benchmarks/experts.py --eps 1 4 --steps 5 --device cuda     # one rank per GPU
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

HIDDEN, LAYERS, EXPERTS, TOP_K, MOE_WIDTH, VOCAB, SEQ, BATCH = 256, 4, 8, 2, 512, 4096, 256, 2


def worker(ep: int, steps: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import zerodp
    from zerodp.core.collectives import all_gather_numbers

    cuda = _common.start_worker()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, moe_intermediate_size=MOE_WIDTH,
        num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, max_position_embeddings=SEQ, attn_implementation="sdpa"))
    config = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1}}
    if ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(engine.device)

    def step() -> None:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    meter = _common.AddedPeak(cuda)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        meter.sync()
        t0 = time.perf_counter()
        step()
        meter.sync()
        times.append(time.perf_counter() - t0)
    peak = meter.mib()
    sent = {group: kinds["total"] for group, kinds in engine.comm_stats(by_group=True).items()}
    rows = all_gather_numbers({"peak": peak, "seconds": statistics.median(times)})
    if rank == 0:
        print(_common.RESULT_PREFIX + json.dumps({"peak_mib": max(r["peak"] for r in rows),
                                                  "seconds": max(r["seconds"] for r in rows), "sent": sent}),
              flush=True)
    engine.destroy()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4], help="expert-parallel sizes (default 1 2 4)")
    ap.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one rank per GPU (NCCL)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds before a run is killed (default 900)")
    ap.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    t0 = time.perf_counter()
    rows = []
    for ep in args.eps:
        env = _common.worker_env(args.world, memory=args.device == "cpu")
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        launch = _common.torchrun(__file__, args.world, ["--worker", str(ep), str(args.steps), str(args.warmup)],
                                  env, timeout=args.timeout)
        got = launch.result()
        print(f"ep {ep}: " + (json.dumps(got) if got else _common.failure_reason(launch)), flush=True)
        rows.append((ep, got))
    print(f"\n`python benchmarks/experts.py --eps {' '.join(map(str, args.eps))} --world {args.world} --steps "
          f"{args.steps} --device {args.device}` ({(time.perf_counter() - t0) / 60:.1f} min)\n")
    print(f"Qwen3-MoE {LAYERS} layers, hidden {HIDDEN}, {EXPERTS} experts of width {MOE_WIDTH}, top-{TOP_K}, "
          f"vocabulary {VOCAB}; {BATCH} x {SEQ} tokens per rank; ZeRO stage 3, fp32, AdamW; world {args.world}\n")
    base = next((g for ep, g in rows if ep == 1 and g), None)

    def ratio(value: float, base_value) -> str:
        return f"{value / base_value:.2f}x" if base_value else "-"
    print("| expert-parallel size | step (s) | vs ep 1 | peak added per rank (MiB) | vs ep 1 | MiB sent per step "
          "(rank 0) | vs ep 1 | of which all-to-all |")
    print("|---|---|---|---|---|---|---|---|")
    for ep, got in rows:
        if not got:
            print(f"| {ep} | failed | | | | | | |")
            continue
        sent = sum(got["sent"].values()) / 2**20
        a2a = got["sent"].get("expert", 0) / 2**20
        base_sent = sum(base["sent"].values()) / 2**20 if base else None
        print(f"| {ep} | {got['seconds']:.2f} | {ratio(got['seconds'], base and base['seconds'])} | "
              f"{got['peak_mib']:.0f} | {ratio(got['peak_mib'], base and base['peak_mib'])} | {sent:.1f} | "
              f"{ratio(sent, base_sent)} | {a2a:.1f} |")


if __name__ == "__main__":
    main()

"""One GPU, Llama-shaped models in bf16: tokens/s and MFU of zerodp against FSDP2, with CPU offload,
and the largest model that still trains a step with its optimizer and parameters offloaded.

    python benchmarks/gpu_throughput.py [--size 1b] [--seq 2048] [--batch 4] [--steps 4]
                                        [--largest 3b,7b] [--budget 300] [--json OUT]

Systems, each in a process of its own (world size 1, NCCL), the same model, batch and sequence:

* ``zerodp 0``: stage 0, everything on the GPU (the reference);
* ``zerodp 3 + opt offload``: stage 3, fp32 masters and AdamW states in pinned host memory (the step
  runs on the CPU);
* ``zerodp 3 + opt+param offload``: and the bf16 parameter shards in host memory too;
* ``FSDP2 + CPU offload``: torch's ``fully_shard`` per decoder layer and the root with
  ``CPUOffloadPolicy`` (parameters, gradients and the AdamW step on the CPU) and a bf16
  ``MixedPrecisionPolicy`` with fp32 reduction.

MFU counts 6N + 12 L d s FLOPs per token (N parameters, L layers, width d, sequence s; the
attention term of the PaLM paper) against the GPU's dense bf16 peak. ``--largest`` tries each size
with ``zerodp 3 + opt+param offload`` and reports whether one step ran, its time, the peak GPU memory
and the peak host memory (VmHWM) of the process. A size whose process is killed (out of host memory)
is reported as such; the next sizes are still tried while ``--budget`` seconds last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

#: Llama shapes: (hidden, intermediate, layers, heads, kv heads, vocab)
SIZES = {
    "tiny": (256, 688, 2, 4, 4, 32000),
    "1b": (2048, 5632, 16, 16, 16, 32000),
    "3b": (3200, 8640, 26, 32, 32, 32000),
    "7b": (4096, 11008, 32, 32, 32, 32000),
    "8b": (4096, 14336, 32, 32, 8, 128256),
    "13b": (5120, 13824, 40, 40, 40, 32000),
}
SYSTEMS = ["zerodp 0", "zerodp 3 + opt offload", "zerodp 3 + opt+param offload", "FSDP2 + CPU offload"]
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, SXM


def llama(size: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    h, inter, layers, heads, kv, vocab = SIZES[size]
    cfg = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=4096,
                      attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(cfg)


def zerodp_config(stage: int, offload: str, batch: int) -> dict:
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if offload in ("opt", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}}}


def host_peak_gib() -> float:
    from _common import proc_status_mib
    return proc_status_mib("VmHWM") / 1024


def worker(system: str, size: str, seq: int, batch: int, steps: int) -> dict:
    """One system in this process: build, train ``steps`` steps after two untimed ones (``steps``
    0: one step, timed). ``BENCH_ON_CPU=1`` runs it on the CPU with gloo (a check of this script)."""
    import torch
    import torch.distributed as dist
    on_cpu = os.environ.get("BENCH_ON_CPU") == "1"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    dist.init_process_group("gloo" if on_cpu else "nccl", rank=0, world_size=1)
    device = torch.device("cpu") if on_cpu else torch.device("cuda", 0)
    sync = (lambda: None) if on_cpu else torch.cuda.synchronize
    if not on_cpu:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    with torch.device(device):  # initialized on the GPU: seconds, not minutes
        model = llama(size)
    n_params = sum(p.numel() for p in model.parameters())
    if system.startswith("zerodp"):
        import zerodp
        stage = int(system.split()[1])
        offload = "all" if "param" in system else "opt" if "offload" in system else "none"
        engine, *_ = zerodp.initialize(model=model, config=zerodp_config(stage, offload, batch),
                                       unit_classes=(LlamaDecoderLayer,))
        del model

        def step(x):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        off = CPUOffloadPolicy(pin_memory=not on_cpu)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp, offload_policy=off)
        fully_shard(model, mp_policy=mp, offload_policy=off)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

        def step(x):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    built = time.perf_counter() - t0
    g = torch.Generator(device="cpu").manual_seed(1)
    times = []
    for i in range(steps + 2 if steps else 1):
        x = torch.randint(0, SIZES[size][5], (batch, seq), generator=g).to(device)
        sync()
        t = time.perf_counter()
        step(x)
        sync()
        if i >= 2 or steps == 0:
            times.append(time.perf_counter() - t)
    return {"system": system, "size": size, "params": n_params, "build_s": built, "step_times": times,
            "gpu_peak_gib": 0.0 if on_cpu else torch.cuda.max_memory_allocated() / 2**30,
            "host_peak_gib": host_peak_gib(), "device": "cpu" if on_cpu else torch.cuda.get_device_name(0)}


def run_one(system: str, size: str, seq: int, batch: int, steps: int, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, "--size", size, "--seq", str(seq),
           "--batch", str(batch), "--steps", str(steps)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return {"system": system, "size": size, "error": f"not done in {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[7:])
            out["wall_s"] = time.perf_counter() - t0
            return out
    killed = proc.returncode in (-9, 137)
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    why = next((line for line in reversed(lines) if "Error" in line), " | ".join(lines[-2:]))  # the exception
    return {"system": system, "size": size, "error": "killed (out of host memory?)" if killed
            else f"exit {proc.returncode}: {why[-300:]}"}


def flops_per_token(size: str, n_params: int, seq: int) -> float:
    h, _, layers, *_ = SIZES[size]
    return 6 * n_params + 12 * layers * h * seq


def table(results: list[dict], args, tokens: int) -> None:
    print(f"\n{args.size} Llama {SIZES[args.size]}, bf16, micro-batch {args.batch} x sequence {args.seq} "
          f"= {tokens} tokens per step, one GPU")
    print("| system | step s (median) | tokens/s | MFU | GPU peak GiB | host peak GiB | vs zerodp 0 |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for r in results:
        if "error" in r:
            print(f"| {r['system']} | {r['error']} | | | | | |")
            continue
        t = statistics.median(r["step_times"])
        peak = next((v for k, v in PEAK_BF16.items() if k in r["device"]), None)
        mfu = flops_per_token(args.size, r["params"], args.seq) * tokens / t / peak if peak else None
        base = base or (t if r["system"] == "zerodp 0" else None)
        print(f"| {r['system']} | {t:.3f} | {tokens / t:,.0f} | {f'{mfu:.1%}' if mfu else 'n/a'} | "
              f"{r['gpu_peak_gib']:.1f} | {r['host_peak_gib']:.1f} | {f'{t / base:.2f}x' if base else ''} |")
    done = [r for r in results if "device" in r]
    if done:
        print(f"device: {done[0]['device']}; parameters: {done[0]['params'] / 1e9:.2f} B")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1b", choices=sorted(SIZES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="timed steps after two untimed ones")
    ap.add_argument("--systems", nargs="*", default=SYSTEMS)
    ap.add_argument("--largest", default="", help="comma-separated sizes to try with everything offloaded")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        out = worker(args.worker, args.size, args.seq, args.batch, args.steps)
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(0)
    end = time.perf_counter() + args.budget
    results = [run_one(s, args.size, args.seq, args.batch, args.steps, end - time.perf_counter())
               for s in args.systems]
    tokens = args.batch * args.seq
    if results:
        table(results, args, tokens)
    largest = []
    for size in [s for s in args.largest.split(",") if s]:
        left = end - time.perf_counter()
        if left < 30:
            largest.append({"size": size, "error": "not tried: out of time"})
            continue
        largest.append(run_one("zerodp 3 + opt+param offload", size, args.seq, 1, 0, left))
    if largest:
        print("\nLargest model, zerodp stage 3 with optimizer and parameters in host memory, micro-batch 1")
        print("| size | parameters | one step | step s | GPU peak GiB | host peak GiB |")
        print("|---|---|---|---|---|---|")
        for r in largest:
            if "error" in r:
                print(f"| {r['size']} | | {r['error']} | | | |")
            else:
                print(f"| {r['size']} | {r['params'] / 1e9:.2f} B | ran | {r['step_times'][0]:.1f} | "
                      f"{r['gpu_peak_gib']:.1f} | {r['host_peak_gib']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"throughput": results, "largest": largest}, f, indent=1)


if __name__ == "__main__":
    main()

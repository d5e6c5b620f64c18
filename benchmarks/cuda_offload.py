"""Optimizer and parameter offload on a CUDA device: the GPU code paths, device memory, step time.

Run on a machine with one GPU (NCCL, world size 1):

    torchrun --standalone --nproc-per-node 1 benchmarks/cuda_offload.py [--out DIR] [--layers N]

1. Correctness: the example GPT trained a few steps at stages 1-3 in fp32 and bf16 with no
   offload (twice: is the GPU run deterministic?), the optimizer in pinned host memory
   (``cpu``), in files (``nvme``), and at stage 3 also the parameter shards there. After one
   step the fp32 masters must equal those of the run without offload within 1e-6 (the step
   runs on the CPU there, on the GPU without offload: the two AdamW kernels round
   differently); after four steps the difference is printed (in bf16 a master that rounds to
   the other side changes the next forward, and Adam's normalized update turns tiny gradient
   differences into steps of up to lr). A checkpoint saved with disk offload loads into an
   engine without it, exactly.
2. Memory and time for a larger GPT (bf16, stage 3): peak device memory over the start
   (``torch.cuda.max_memory_allocated``), the ledger's model states on the device, and the
   median step time with no offload, host offload and disk offload.
3. Streamed inference (``zerodp.inference``): the same GPT's weights streamed from a
   safetensors file give the whole model's logits; device memory and forward time.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import zerodp  # noqa: E402
from zerodp.examples.gpt import Block, build_gpt  # noqa: E402


def config(stage: int, dtype: str, offload: str, swap: str, params: bool = False, sub_group: int = 10**9) -> dict:
    z = {"stage": stage, "sub_group_size": sub_group}
    if offload != "none":
        z["offload_optimizer"] = {"device": offload, "pin_memory": True, "nvme_path": swap}
    if params:  # the parameter shards where the optimizer goes
        z["offload_param"] = {"device": offload, "pin_memory": True, "nvme_path": swap}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
           "zero_optimization": z}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def engine_for(cfg: dict, seed: int = 0, preset: str = "tiny", **gpt):
    torch.manual_seed(seed)
    engine, *_ = zerodp.initialize(model=build_gpt(preset, **gpt), config=cfg, unit_classes=(Block,))
    return engine


def batch(step: int, device, block: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (4, block), generator=g)
    return x.to(device), torch.roll(x, -1, 1).to(device)


def train(engine, first: int, last: int, block: int = 64) -> list[float]:
    times = []
    for step in range(first, last):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, loss = engine(*batch(step, engine.device, block))
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def params(engine) -> dict[str, torch.Tensor]:
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}


def masters(engine) -> dict[str, torch.Tensor]:
    """The fp32 weights the optimizer updates, by parameter name (world size 1: whole groups)."""
    out = {}
    for g in engine.trainable:
        with g.swapped_in():
            flat = (g.optim.master if g.optim.master is not None else g.shard).detach().float().cpu().clone()
        for i, slot in enumerate(g.slots):
            out[slot.name] = g.view(flat, i)
    return out


def max_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def check_correctness(root: Path) -> tuple[list[str], bool]:
    rows, ok = [], True
    for dtype in ("fp32", "bf16"):
        for stage in (1, 2, 3):
            want = None
            for _ in range(2):  # twice: is the GPU run deterministic?
                e = engine_for(config(stage, dtype, "none", ""))
                train(e, 0, 1)
                got = [masters(e)]
                train(e, 1, 4)
                got.append(masters(e))
                e.destroy()
                if want is None:
                    want = got
            floor = [max_diff(a, b) for a, b in zip(got, want)]
            rows.append(f"| {dtype} | {stage} | none, run again | {floor[0]:.3g} | {floor[1]:.3g} |")
            runs = [("cpu", False), ("nvme", False)] + ([("cpu", True), ("nvme", True)] if stage == 3 else [])
            for off, with_params in runs:
                e = engine_for(config(stage, dtype, off, str(root / "swap"), with_params, sub_group=20_000))
                assert e.offload is not None and (off != "cpu" or e.offload._grad_stage[0].is_pinned())
                train(e, 0, 1)
                d1 = max_diff(masters(e), want[0])
                train(e, 1, 4)
                d = max_diff(masters(e), want[1])
                ok &= d1 <= 1e-6  # one step: only the rounding of the CPU and GPU AdamW kernels
                rows.append(f"| {dtype} | {stage} | {off}{' + params' if with_params else ''} | {d1:.3g} | {d:.3g} |")
                if off == "nvme" and stage == 2:
                    e.save_checkpoint(root / "ckpt", tag="t")
                    saved = params(e)
                    other = engine_for(config(3, dtype, "none", ""), seed=5)
                    other.load_checkpoint(root / "ckpt", tag="t")
                    d2 = max_diff(params(other), saved)
                    ok &= d2 == 0.0
                    rows.append(f"| {dtype} | 2 nvme -> 3 none | checkpoint load | | {d2:.3g} |")
                    other.destroy()
                e.destroy()
    return rows, ok


def _free(engine) -> None:
    engine.destroy()
    gc.collect()  # the engine's reference cycles hold device memory until collected
    torch.cuda.empty_cache()


def memory_and_time(root: Path, layers: int) -> list[str]:
    rows = []
    gpt = dict(n_layer=layers, n_head=16, n_embd=1024, block_size=256)
    for off, with_params in (("none", False), ("cpu", False), ("cpu", True), ("nvme", False), ("nvme", True)):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        e = engine_for(config(3, "bf16", off, str(root / "swap"), with_params, sub_group=50_000_000),
                       preset="medium", **gpt)
        times = train(e, 0, 6, block=256)
        mem = e.memory_breakdown()
        on_device = mem.get("model_states_on_compute", mem["model_states"])
        n = sum(g.numel for g in e.flat_groups) if off == "none" else None
        _free(e)
        del e
        peak = torch.cuda.max_memory_allocated() - before
        rows.append(f"| {off}{' + params' if with_params else ''} | {peak / 2**30:.2f} | "
                    f"{on_device / 2**30:.2f} | {statistics.median(times[2:]) * 1e3:.0f} |" + (f" ({n / 1e6:.0f}M params)" if n else ""))
    return rows


def check_streamed(root: Path) -> tuple[list[str], bool]:
    """Streamed inference on the GPU: the logits of the whole model, and the device memory."""
    from safetensors.torch import save_file

    from zerodp.inference import stream
    torch.manual_seed(0)
    gpt = dict(n_layer=12, n_head=16, n_embd=1024, block_size=256)
    ref = build_gpt("medium", **gpt).eval()
    seen, weights = set(), {}
    for name, p in ref.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            weights[name] = p.detach().contiguous()
    save_file(weights, str(root / "stream.safetensors"))
    x = torch.randint(0, 256, (4, 256)).cuda()
    ref = ref.cuda()
    with torch.no_grad():
        want, _ = ref(x)
    whole = sum(t.numel() * t.element_size() for t in weights.values())
    del ref
    gc.collect()
    torch.cuda.empty_cache()
    with zerodp.zero.Init():
        meta = build_gpt("medium", **gpt).eval()
    model = stream(meta, root / "stream.safetensors")
    got = None
    for _ in range(2):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got, _ = model(x)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - before
    same = torch.equal(got, want)
    return [f"| streamed GPT ({whole / 2**20:.0f} MiB of fp32 weights) | logits equal the whole model's: {same} | "
            f"streamed weights on the device at most {model.peak_streamed_bytes / 2**20:.1f} MiB | "
            f"peak device memory over start {peak / 2**20:.0f} MiB | forward {dt * 1e3:.0f} ms |"], same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()
    zerodp.init_distributed()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        rows, ok = check_correctness(root)
        print("| dtype | stage | offload | fp32 masters: max abs diff vs no offload, 1 step | 4 steps |\n|---|---|---|---|---|")
        print("\n".join(rows), flush=True)
        print(f"correctness: {'PASS' if ok else 'FAIL'}", flush=True)
        print(f"\nbf16, stage 3, GPT {args.layers} layers x 1024, micro-batch 4 x 256 tokens, "
              f"{torch.cuda.get_device_name()}")
        print("| offload | peak device GiB (over start) | model states on device GiB | step ms |\n|---|---|---|---|")
        print("\n".join(memory_and_time(root, args.layers)), flush=True)
        rows, same = check_streamed(root)
        print("\n" + "\n".join(rows), flush=True)
        print(f"streamed inference: {'PASS' if same else 'FAIL'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

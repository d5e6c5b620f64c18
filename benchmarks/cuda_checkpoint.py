"""Checkpoints on a CUDA device: correctness of the device paths and their timings.

Run on a machine with one GPU (NCCL, world size 1):

    torchrun --standalone --nproc-per-node 1 benchmarks/cuda_checkpoint.py [--out DIR] [--big-layers N]

1. For ZeRO stages 0-3 in fp32 and bf16: train the example GPT a few steps on the GPU, save
   (synchronously, then asynchronously from pinned host copies while training goes on), load
   into a fresh engine at another stage and check that the resumed run ends bit-identical to an
   uninterrupted one; consolidate and check the weights against the engine's.
2. Time save, asynchronous save (call time: the training stall) and load for a larger GPT, and
   the pinned staging copy, against the disk's sequential write bandwidth measured in the run.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import zerodp  # noqa: E402
from zerodp.checkpoint import consolidate  # noqa: E402
from zerodp.checkpoint.tensorfile import load_file  # noqa: E402
from zerodp.examples.gpt import Block, build_gpt  # noqa: E402


def config(stage: int, dtype: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def engine_for(stage: int, dtype: str, seed: int = 0, **gpt):
    torch.manual_seed(seed)
    model = build_gpt("tiny", **gpt)
    engine, *_ = zerodp.initialize(model=model, config=config(stage, dtype), unit_classes=(Block,))
    return engine


def batch(step: int, device, block: int = 64):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (4, block), generator=g)
    return x.to(device), torch.roll(x, -1, 1).to(device)


def train(engine, first: int, last: int) -> None:
    for step in range(first, last):
        _, loss = engine(*batch(step, engine.device))
        engine.backward(loss)
        engine.step()


def params(engine) -> dict[str, torch.Tensor]:
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}


def check_correctness(root: Path) -> list[str]:
    rows = []
    for dtype in ("fp32", "bf16"):
        for stage in range(4):
            other = (stage + 2) % 4
            d = root / f"{dtype}-z{stage}"
            whole = engine_for(stage, dtype)
            train(whole, 0, 6)
            want = params(whole)
            whole.destroy()
            a = engine_for(stage, dtype)
            train(a, 0, 3)
            at3 = params(a)
            a.save_checkpoint(d, tag="sync")
            a.save_checkpoint(d, async_save=True)  # global_step3, written while training goes on
            train(a, 3, 5)
            a.wait_for_checkpoint()
            a.destroy()
            b = engine_for(stage, dtype, seed=1)
            b.load_checkpoint(d)  # latest: the asynchronous one
            train(b, 3, 6)
            same = all(torch.equal(want[n], v) for n, v in params(b).items())
            b.destroy()
            c = engine_for(other, dtype, seed=2)
            c.load_checkpoint(d, tag="sync")
            train(c, 3, 6)
            moved = max((want[n] - v).abs().max().item() for n, v in params(c).items())
            c.destroy()
            consolidate(d, d / "weights")  # the asynchronous save: the state at step 3
            full = load_file(d / "weights" / "model.safetensors")
            low = torch.bfloat16 if dtype == "bf16" else torch.float32
            ok_file = all(torch.equal(full[n].to(low).float(), v) for n, v in at3.items())
            rows.append(f"| {dtype} | {stage} | {'yes' if same else 'NO'} | {other} | {moved:.2e} | "
                        f"{'yes' if ok_file else 'NO'} |")
    return rows


def disk_write_bandwidth(path: Path, nbytes: int = 1 << 30) -> float:
    buf = os.urandom(64 << 20)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for _ in range(nbytes // len(buf)):
        os.write(fd, buf)
    os.fsync(fd)
    os.close(fd)
    dt = time.perf_counter() - t0
    os.remove(path)
    return nbytes / dt


def timings(root: Path, layers: int) -> list[str]:
    engine = engine_for(2, "bf16", n_layer=layers, n_embd=1024, n_head=16, block_size=64)
    train(engine, 0, 2)
    n = sum(p.numel() for g in engine.flat_groups for p in g.params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.save_checkpoint(root / "big", tag="sync")
    sync_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in (root / "big" / "sync").iterdir())
    bw = disk_write_bandwidth(root / "bw.bin", size // (64 << 20) * (64 << 20))  # as much as the checkpoint
    engine.save_checkpoint(root / "big", tag="async0", async_save=True)  # allocates the pinned buffer
    engine.wait_for_checkpoint()
    t0 = time.perf_counter()
    engine.save_checkpoint(root / "big", tag="async", async_save=True)
    stall_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    train(engine, 2, 4)
    torch.cuda.synchronize()
    during = time.perf_counter() - t0
    engine.wait_for_checkpoint()
    t0 = time.perf_counter()
    train(engine, 4, 6)
    torch.cuda.synchronize()
    after = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.load_checkpoint(root / "big", tag="sync")
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    engine.destroy()
    return [f"| parameters | {n / 1e6:.0f}M (bf16, fp32 masters and Adam at stage 2) |",
            f"| checkpoint size | {size / 2**30:.2f} GiB |",
            f"| disk write bandwidth (fsync) | {bw / 2**30:.2f} GiB/s |",
            f"| sync save | {sync_s:.2f} s ({size / sync_s / bw:.0%} of disk bandwidth) |",
            f"| async save: call (training stall; pinned buffer reused) | {stall_s:.3f} s ({stall_s / sync_s:.1%} of sync save) |",
            f"| 2 training steps while writing / after | {during:.3f} s / {after:.3f} s |",
            f"| load | {load_s:.2f} s ({size / load_s / 2**30:.2f} GiB/s) |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--big-layers", type=int, default=24, help="layers of the timed GPT (width 1024)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    zerodp.accelerator.init_distributed()
    root = Path(args.out or tempfile.mkdtemp(prefix="zerodp-cuda-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, backend {dist.get_backend()}")
    print("| dtype | stage | resumed bit-identical | loaded at stage | max |diff| vs uninterrupted | consolidated |")
    print("|---|---|---|---|---|---|")
    for row in check_correctness(root):
        print(row, flush=True)
    print()
    print("| measure | value |")
    print("|---|---|")
    for row in timings(root, args.big_layers):
        print(row, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

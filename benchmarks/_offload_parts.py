"""The parts of ``benchmarks/offload.py`` beyond the CPU Adam: step times against DeepSpeed's
ZeRO-Offload, the disk and the tile walk, and the largest model under a per-rank memory cap."""
from __future__ import annotations

import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from _common import evict, read_file, write_file

HERE = Path(__file__).resolve().parent
WORKER = HERE.parent / "tests" / "offload_memory_worker.py"
MIB = 1 << 20

# ------------------------------------------------------------------------------ step times

STEP_SYSTEMS = ["zero2", "zero2-offload", "ds2-offload", "zero3", "zero3-offload", "zero3-nvme", "ds3-offload"]


def step_times(args, disk_dir: str, reps: int = 3) -> str:
    """The example GPT (medium) through ``peers.py`` at world size 2; its table."""
    import peers
    out = os.path.join(args.out, "offload_steps")
    peers.main(["--worlds", "2", "--reps", str(reps), "--model", "medium", "--systems", *STEP_SYSTEMS,
                "--nvme-path", disk_dir, "--out", out])
    table = Path(out, "peers.md").read_text().split("\n", 2)[2]
    return ("Step time with offload: the example GPT through `benchmarks/peers.py` (its table; "
            "`vs DDP` is to DDP when it ran, else to the first row), world size 2\n\n" + table.strip())


# ------------------------------------------------------------------------------ the disk

def _read_threads(swap, path: str, nbytes: int, reuse: torch.Tensor | None) -> float:
    t0 = time.perf_counter()
    out = reuse if reuse is not None else torch.empty(nbytes, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        swap.transfer(fd, [out], [0], write=False)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _read_direct(path: str, nbytes: int, block: int = 8 * MIB) -> float:
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        pos = 0
        while pos < nbytes:
            n = os.preadv(fd, [buf], pos)
            if n <= 0:
                break
            pos += n
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _read_mmap(path: str, nbytes: int, out: torch.Tensor) -> float:
    t0 = time.perf_counter()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ) as mm, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer, only read here
        out.copy_(torch.frombuffer(mm, dtype=torch.uint8))
    return time.perf_counter() - t0


def _tile_walk(swap, nbytes: int, tile: int) -> tuple[float, int]:
    """Write ``nbytes`` of tiles, evict them, then walk: read tile k+1 while tile k is written
    back. Returns the walk's seconds (writes flushed to the disk included) and its tiles."""
    from zerodp.offload.swap import PagedTensors
    tiles = []
    for i in range(nbytes // tile):
        page = PagedTensors(swap, f"walk{i}")
        page.add(torch.randint(0, 255, (tile,), dtype=torch.uint8))
        page.page_out(wait=True)
        tiles.append(page)
    for page in tiles:
        evict(str(page.path))
    t0 = time.perf_counter()
    tiles[0].page_in(wait=False)
    for k, page in enumerate(tiles):
        page.wait()
        if k + 1 < len(tiles):
            tiles[k + 1].page_in(wait=False)
        page.page_out(wait=False)
    for page in tiles:
        page.wait()
        os.fsync(page.fd)
    return time.perf_counter() - t0, len(tiles)


def disk_section(disk_dir: str, mib: int, reps: int = 3) -> str:
    from zerodp.offload.swap import SwapDir
    nbytes = mib * MIB
    swap = SwapDir(disk_dir, 0, block_size=MIB, queue_depth=8)
    path = str(swap.dir / "bandwidth.bin")
    reuse = torch.empty(nbytes, dtype=torch.uint8)
    reuse.fill_(0)
    cases = {"sequential write (8 MiB writes, fsync)": lambda: write_file(path, nbytes)[1],
             "sequential read (8 MiB reads into a reused buffer)": lambda: read_file(path)[1],
             "threads + preadv, 1 MiB blocks, 8 in flight, into fresh memory (zerodp's page-in)":
                 lambda: _read_threads(swap, path, nbytes, None),
             "threads + preadv, 1 MiB blocks, 8 in flight, into reused memory":
                 lambda: _read_threads(swap, path, nbytes, reuse),
             "O_DIRECT, 8 MiB reads, one thread": lambda: _read_direct(path, nbytes),
             "mmap, then a copy into reused memory": lambda: _read_mmap(path, nbytes, reuse),
             "tile walk": lambda: _tile_walk(swap, nbytes, 64 * MIB)[0]}
    times: dict[str, list[float]] = {k: [] for k in cases}
    try:
        for _ in range(reps):  # interleaved: the disk's ups and downs fall on every case
            for what, fn in cases.items():
                if what != "tile walk" and not what.startswith("sequential write"):
                    evict(path)
                try:
                    times[what].append(fn())
                except OSError as e:
                    print(f"disk: {what} failed: {e}", flush=True)
                if what == "tile walk":
                    for f in swap.dir.glob("walk*.swp"):
                        f.unlink()
    finally:
        swap.close()
    med = {k: statistics.median(v) if v else float("nan") for k, v in times.items()}
    lines = [f"Disk: {mib} MiB under `{disk_dir}` (page cache dropped before every read), median of {reps} "
             "interleaved repetitions", "", "| what | GB/s | runs' range |", "|---|---|---|"]
    for what, t in med.items():
        if what != "tile walk":
            lo, hi = (nbytes / max(times[what]), nbytes / min(times[what])) if times[what] else (0, 0)
            lines.append(f"| {what} | {nbytes / t / 1e9:.2f} | {lo / 1e9:.2f}-{hi / 1e9:.2f} |")
    walk = med["tile walk"]
    both = med["sequential write (8 MiB writes, fsync)"] + med["sequential read (8 MiB reads into a reused buffer)"]
    lines += ["", f"Tile walk (`zerodp.offload.swap`): {nbytes // (64 * MIB)} tiles of 64 MiB read and written "
              f"back, the next tile read while the previous is written (writes flushed): {walk:.2f} s, reading "
              f"and writing {nbytes / walk / 1e9:.2f} GB/s each; reading then writing the same bytes "
              f"sequentially takes {both:.2f} s, so the walk runs at {100 * both / walk:.0f}% of the disk's "
              "sequential read-then-write time (above 100%: reads and writes overlapped)."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ largest model under a cap

SETTINGS = (("stage0", "stage 0"), ("stage3", "stage 3"), ("cpu", "stage 3 + optimizer in host memory"),
            ("disk", "stage 3 + optimizer on disk"), ("disk+params", "stage 3 + optimizer and parameters on disk"))


def _measure(setting: str, layers: int, disk_dir: str, ranks: int = 2) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(dir=disk_dir) as swap:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(ranks), str(WORKER), swap, str(layers), setting],
                              env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"{setting} with {layers} layers failed (exit {proc.returncode}): {proc.stderr[-800:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    r["over"] = r["rss_peak"] - r["rss_before"]
    return r


def cap_section(disk_dir: str, cap_mib: int, ranks: int = 2, small: int = 16, large: int = 64) -> str:
    cap = cap_mib * MIB
    rows, best = [], {}
    for setting, what in SETTINGS:
        print(f"cap: {what} ...", flush=True)
        a, b = _measure(setting, small, disk_dir, ranks), _measure(setting, large, disk_dir, ranks)
        per_layer = (b["over"] - a["over"]) / (large - small)
        fixed = a["over"] - per_layer * small
        n = max(1, int((cap - fixed) / per_layer))
        for _ in range(3):  # confirm; step down while over the cap
            r = _measure(setting, n, disk_dir, ranks)
            if r["over"] <= cap:
                break
            n = int(n * 0.9)
        best[setting] = n if r["over"] <= cap else 0
        mem = r["memory"]
        device = mem.get("model_states_on_compute", mem["model_states"])
        rows.append(f"| {what} | {per_layer / MIB:.2f} | {fixed / MIB:.0f} | {n} | {r['params'] / 1e6:.0f}M | "
                    f"{r['over'] / MIB:.0f} | {device / MIB:.0f} | {'yes' if r['over'] <= cap else 'NO'} |")
    ratio = best["disk+params"] / best["stage0"] if best.get("stage0") else float("nan")
    ratio_opt = best["disk"] / best["stage0"] if best.get("stage0") else float("nan")
    return "\n".join([
        f"Largest model under a cap of {cap_mib} MiB per rank (peak RSS over the process's start; {ranks} ranks, "
        "bf16 with fp32 masters and AdamW, layers of 512 x 512 = 262,144 parameters)", "",
        "| setting | MiB per layer | fixed MiB | layers | parameters | peak RSS over start at that size (MiB) "
        "| model states on the compute device (MiB) | under the cap |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        f"Disk offload trains a model {ratio:.1f}x the largest at stage 0 with the parameter shards on disk "
        f"too, {ratio_opt:.1f}x with the optimizer alone. On this machine the compute device is the CPU, so "
        "host-memory offload holds the same bytes in the same memory as stage 3 (the model-states column "
        "shows what would stay on a GPU); disk offload moves the fp32 masters and Adam moments (and the "
        "16-bit parameter shards) off the memory, leaving each rank its gradient shard."])

"""The machines a step-time prediction is for: a :class:`Cluster` (device FLOP/s, memory and its
bandwidth, the links inside and between nodes, host and disk bandwidth, the CPU optimizer's
rate), presets for common GPU nodes, a JSON file, or ``local``: this machine, measured by a
short probe (:func:`probe_local`, cached).

Preset figures are the vendors' dense peak FLOP/s and the bandwidths collectives reach in
practice (NCCL's bus bandwidth), not the links' nominal rates; ``gemm_efficiency`` is the
fraction of peak a transformer's matrix multiplications reach. docs/estimate.md lists them with
their sources.
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Union

from .inputs import GB, EstimateError

GBps = 1e9  # bandwidths are in bytes/s; presets are written in GB/s


@dataclass(frozen=True)
class Cluster:
    """What the step-time model needs to know about the machines (per device unless said)."""

    name: str
    devices_per_node: int
    flops: dict = field(default_factory=dict)
    """Peak dense FLOP/s per device by compute dtype: ``"fp32"``, ``"bf16"``, ``"fp16"``."""
    gemm_efficiency: float = 0.6
    """Fraction of the peak that a transformer's matrix multiplications reach."""
    efficiency_by_width: dict = field(default_factory=dict)
    """Measured efficiency by a layer's hidden width on one rank (``local``): narrow matmuls (a
    tensor-parallel rank's share) reach less of the peak. Empty: ``gemm_efficiency`` at any width."""
    device_memory: Optional[int] = None
    memory_bandwidth: float = 2000 * GBps
    """Device memory bytes/s (the optimizer step is bound by it)."""
    intra_bandwidth: float = 200 * GBps
    """Bus bandwidth of a collective among the devices of one node."""
    intra_latency: float = 10e-6
    """Seconds per step of a ring inside a node."""
    inter_bandwidth: float = 20 * GBps
    """Bus bandwidth per device of a collective that crosses nodes."""
    inter_latency: float = 20e-6
    host_bandwidth: float = 20 * GBps
    """Host <-> device bytes/s per device (offload)."""
    disk_bandwidth: float = 3 * GBps
    """Bytes/s of a node's disks (offload to NVMe)."""
    cpu_optimizer_rate: float = 2e9
    """Adam updates (elements) per second of one node's CPUs (offloaded optimizer)."""
    cpu_memory: Optional[int] = None
    overlap: float = 1.0
    """How much of the communication a schedule can overlap with compute actually hides (1: all,
    as on GPUs with their own copy engines; 0: none)."""
    shared_cores: Optional[int] = None
    """``local``: the ranks are processes sharing this many CPU cores, so compute and copies
    slow down once there are more ranks than cores."""
    description: str = ""

    def efficiency(self, width: Optional[int] = None) -> float:
        """The efficiency at a layer width (interpolated in log-width between measured widths)."""
        table = sorted((int(w), float(e)) for w, e in self.efficiency_by_width.items())
        if width is None or not table:
            return self.gemm_efficiency
        if width <= table[0][0]:
            return table[0][1]
        for (w0, e0), (w1, e1) in zip(table, table[1:]):
            if width <= w1:
                f = math.log(width / w0) / math.log(w1 / w0)
                return e0 + f * (e1 - e0)
        return table[-1][1]

    def peak(self, dtype: str) -> float:
        try:
            return float(self.flops[dtype])
        except KeyError:
            raise EstimateError("cluster", f"{self.name} gives no FLOP/s for {dtype} "
                                           f"(it has {', '.join(sorted(self.flops))})") from None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, name: Optional[str] = None) -> "Cluster":
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise EstimateError("cluster", f"unknown keys {unknown}; a cluster file has {sorted(known)}")
        if "devices_per_node" not in data or "flops" not in data:
            raise EstimateError("cluster", "a cluster file needs at least devices_per_node and flops "
                                           '(e.g. {"bf16": 989e12})')
        return cls(**{"name": name or data.get("name", "custom"), **data})


def _node(name: str, description: str, gpus: int, bf16: float, fp32: float, memory_gb: float, hbm: float,
          nvlink: float, ib_per_gpu: float, pcie: float, efficiency: float) -> Cluster:
    return Cluster(name=name, devices_per_node=gpus, flops={"bf16": bf16, "fp16": bf16, "fp32": fp32},
                   gemm_efficiency=efficiency, device_memory=int(memory_gb * GB), memory_bandwidth=hbm * GBps,
                   intra_bandwidth=nvlink * GBps, intra_latency=8e-6, inter_bandwidth=ib_per_gpu * GBps,
                   inter_latency=15e-6, host_bandwidth=pcie * GBps, disk_bandwidth=6 * GBps,
                   cpu_optimizer_rate=4e9, cpu_memory=int(2000 * GB), overlap=1.0, description=description)


#: Preset nodes. FLOP/s: dense peak (fp32 column: TF32 tensor cores, as torch's matmuls use when
#: allowed, else the plain fp32 rate). Bandwidths: what NCCL's all-reduce reaches (bus bandwidth).
#: Efficiency: H100 and H200 0.40, measured (zerodp stage 0 on one H200, eager PyTorch with SDPA
#: attention, a 0.95B Llama in bf16, 4 x 2048 tokens: 0.140 s per step, docs/benchmarks.md); V100
#: and A100 round assumptions (0.55, 0.62) from runs with fused kernels of their time.
PRESETS: dict[str, Cluster] = {
    "v100-dgx2": _node("v100-dgx2", "DGX-2: 16 V100 32 GB, NVSwitch, 8 x 100 Gb/s InfiniBand per node",
                       16, 125e12, 15.7e12, 32, 900, 120, 5.5, 12, 0.55),
    "a100-80gb-8x": _node("a100-80gb-8x", "DGX A100: 8 A100 80 GB SXM, NVLink 3, 8 x 200 Gb/s HDR InfiniBand",
                          8, 312e12, 156e12, 80, 2039, 230, 23, 24, 0.62),
    "h100-8x": _node("h100-8x", "DGX H100: 8 H100 80 GB SXM, NVLink 4, 8 x 400 Gb/s NDR InfiniBand",
                     8, 989e12, 494e12, 80, 3350, 370, 45, 50, 0.40),
    "h200-8x": _node("h200-8x", "HGX H200: 8 H200 141 GB SXM, NVLink 4, 8 x 400 Gb/s NDR InfiniBand",
                     8, 989e12, 494e12, 141, 4800, 370, 45, 50, 0.40),
}

CACHE_ENV = "ZERODP_CLUSTER_CACHE"


def resolve_cluster(cluster: Union[str, Cluster, dict, None], recalibrate: bool = False) -> Optional[Cluster]:
    """A :class:`Cluster` from a preset name, ``"local"`` (probed), a JSON file's path or a dict."""
    if cluster is None or isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, dict):
        return Cluster.from_dict(cluster)
    if cluster == "local":
        return probe_local(use_cache=not recalibrate)
    if cluster in PRESETS:
        return PRESETS[cluster]
    path = Path(cluster)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise EstimateError("cluster", f"{path}: not JSON ({e})") from None
        return Cluster.from_dict(data, name=data.get("name", path.stem))
    raise EstimateError("cluster", f"{cluster!r} is neither a preset ({', '.join(PRESETS)}), 'local', "
                                   "nor a JSON file")


# -- this machine -------------------------------------------------------------------------------

def _cache_path() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "zerodp")
    return Path(root) / f"cluster-local-{platform.node()}.json"


def _timed_together(fn, calls: int) -> float:
    """Seconds per call of ``fn``, which holds a collective: every rank makes the same number of
    calls (a loop that stops on its own clock could end one call apart on two ranks and leave one
    waiting in a collective the other never joins); best of three rounds, each begun together."""
    import torch.distributed as dist
    fn()
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _timed(fn, min_time: float = 0.25) -> float:
    """Seconds per call of ``fn`` (best of a few rounds of at least ``min_time``)."""
    fn()
    best = float("inf")
    for _ in range(3):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time / 3:
                break
        best = min(best, elapsed / n)
    return best


def _probe_compute() -> dict:
    """One thread's rates: fp32 and bf16 matmuls, a transformer layer's forward and backward,
    AdamW over tensors of a layer's size, a memory copy."""
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    fp32 = 2 * 512 * 1024 * 1024 / _timed(lambda: a @ b)
    a16, b16 = a[:128].bfloat16(), b[:, :256].bfloat16()
    bf16 = 2 * 128 * 1024 * 256 / _timed(lambda: a16 @ b16)
    # a transformer layer's forward and backward: matmuls with what surrounds them (norms,
    # softmax, activations), the rate the efficiency is measured by, at three widths
    widths = {}
    for h in (128, 256, 512):
        seq, batch = 256, 4
        layer = torch.nn.TransformerEncoderLayer(h, 4, 4 * h, dropout=0.0, batch_first=True)
        x = torch.randn(batch, seq, h)
        layer_flops = 3 * (2 * 12 * h * h * batch * seq + 4 * batch * seq * seq * h)
        widths[h] = layer_flops / _timed(lambda layer=layer, x=x: layer(x).sum().backward(), 0.4)
    params = [torch.zeros(1 << 18, requires_grad=True) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    adam = 8 * (1 << 18) / _timed(opt.step)
    src = torch.randn(1 << 23)
    dst = torch.empty_like(src)
    copy = src.numel() * 4 / _timed(lambda: dst.copy_(src))
    return {"fp32": fp32, "bf16": bf16, "adam": adam, "copy": copy, "layer": widths[256], "widths": widths}


def _probe_worker(rank: int, world: int, port: int, out) -> None:
    """Every core's rank measures its compute at the same time (as ranks run), then the ranks'
    gloo all-reduce."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.barrier()
    compute = _probe_compute()
    dist.barrier()
    small, big = torch.zeros(256), torch.zeros(1 << 21)
    t_small = _timed_together(lambda: dist.all_reduce(small), 100)
    t_big = _timed_together(lambda: dist.all_reduce(big), 10)
    if rank == 0:
        out.put((compute, t_small, t_big, big.numel() * 4))
        out.close()
        out.join_thread()
    dist.barrier()
    os._exit(0)  # gloo's teardown can abort after the work is done; nothing is left to lose


def _probe_ranks(world: int) -> tuple[dict, float, float]:
    """``world`` processes of one thread: their compute rates measured at once, and the bus
    bandwidth and per-step latency of their gloo all-reduce."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_probe_worker, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    compute, t_small, t_big, nbytes = out.get(timeout=300)
    for p in procs:
        p.join(timeout=30)
    steps = 2 * (world - 1)
    latency = t_small / steps
    bandwidth = 2 * (world - 1) / world * nbytes / max(t_big - t_small, 1e-9)
    return compute, bandwidth, latency


def probe_local(use_cache: bool = True) -> Cluster:
    """This machine as a cluster of one node whose "devices" are processes of one thread each
    sharing its cores (as the test suite and ``benchmarks/peers.py`` run), measured in about ten
    seconds by one such process per core, all at once (cores that are hyper-threads of one
    physical core slow each other, as ranks do): matmul FLOP/s (fp32, bf16), a transformer
    layer's rate, AdamW's update rate, memory copy, and their gloo all-reduce. Cached per machine
    (``~/.cache/zerodp``, or ``$ZERODP_CLUSTER_CACHE``)."""
    import torch
    path = _cache_path()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    key = {"torch": torch.__version__, "cores": cores}
    if use_cache and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                return Cluster.from_dict(data["cluster"])
        except (ValueError, KeyError, EstimateError):
            pass
    c, bandwidth, latency = _probe_ranks(max(2, cores))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    cluster = Cluster(name="local", devices_per_node=cores, flops={"fp32": c["fp32"], "bf16": c["bf16"],
                                                                    "fp16": c["bf16"]},
                      gemm_efficiency=min(1.0, c["layer"] / c["fp32"]), device_memory=memory,
                      efficiency_by_width={w: min(1.0, r / c["fp32"]) for w, r in c["widths"].items()},
                      memory_bandwidth=c["adam"] * 32,
                      intra_bandwidth=bandwidth, intra_latency=latency, inter_bandwidth=bandwidth,
                      inter_latency=latency, host_bandwidth=c["copy"], disk_bandwidth=1 * GBps,
                      cpu_optimizer_rate=c["adam"] * cores, cpu_memory=memory, overlap=0.0,
                      shared_cores=cores,
                      description=f"this machine: {cores} cores, one thread per rank, gloo (probed)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "cluster": cluster.to_dict()}, indent=1))
    except OSError:
        pass
    return cluster

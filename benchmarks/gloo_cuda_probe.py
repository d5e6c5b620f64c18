"""Which collectives gloo runs on CUDA tensors: each one tried by two fresh processes sharing GPU 0.

    python benchmarks/gloo_cuda_probe.py

zerodp's tests put several ranks on one GPU over gloo (NCCL refuses two ranks on one device). This
prints, for each collective zerodp or torch's DTensor issues, whether gloo ran it on CUDA tensors
with the right result, raised an error (its first line), or ended the process (a signal).
"""
from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N = 8


def _ops():
    def all_reduce(r, d):
        t = torch.full((N,), float(r + 1), device=d)
        dist.all_reduce(t)
        return torch.equal(t, torch.full_like(t, 3.0))

    def broadcast(r, d):
        t = torch.full((N,), float(r), device=d)
        dist.broadcast(t, 0)
        return torch.equal(t, torch.zeros_like(t))

    def all_gather(r, d):
        out = [torch.empty(N, device=d) for _ in range(2)]
        dist.all_gather(out, torch.full((N,), float(r), device=d))
        return all(torch.equal(o, torch.full_like(o, float(i))) for i, o in enumerate(out))

    def all_gather_into_tensor(r, d):
        out = torch.empty(2 * N, device=d)
        dist.all_gather_into_tensor(out, torch.full((N,), float(r), device=d))
        return torch.equal(out, torch.arange(2, device=d).float().repeat_interleave(N))

    def reduce_scatter_tensor(r, d):
        out = torch.empty(N, device=d)
        dist.reduce_scatter_tensor(out, torch.ones(2 * N, device=d))
        return torch.equal(out, torch.full_like(out, 2.0))

    def all_to_all_single(r, d):
        out = torch.empty(2 * N, device=d)
        dist.all_to_all_single(out, torch.full((2 * N,), float(r), device=d))
        return torch.equal(out, torch.arange(2, device=d).float().repeat_interleave(N))

    def send_recv(r, d):
        t = torch.full((N,), float(r), device=d)
        if r == 0:
            dist.send(t, 1)
            return True
        dist.recv(t, 0)
        return torch.equal(t, torch.zeros_like(t))

    def dtensor_redistribute(r, d):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
        mesh = DeviceMesh.from_group(dist.group.WORLD, d.type)
        x = DTensor.from_local(torch.full((N,), float(r), device=d), mesh, [Shard(0)])
        whole = x.redistribute(mesh, [Replicate()]).to_local()
        p = DTensor.from_local(torch.ones(2 * N, device=d), mesh, [Partial()])
        part = p.redistribute(mesh, [Shard(0)]).to_local()
        return torch.equal(whole, torch.arange(2, device=d).float().repeat_interleave(N)) and \
            torch.equal(part, torch.full_like(part, 2.0))

    return {f.__name__: f for f in (all_reduce, broadcast, all_gather, all_gather_into_tensor,
                                    reduce_scatter_tensor, all_to_all_single, send_recv, dtensor_redistribute)}


def _run(rank: int, port: int, name: str, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    d = torch.device("cpu") if os.environ.get("PROBE_ON_CPU") == "1" else torch.device("cuda", 0)
    if d.type == "cuda":
        torch.cuda.set_device(d)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ok = _ops()[name](rank, d)
        if d.type == "cuda":
            torch.cuda.synchronize()
        q.put((rank, "ok" if ok else "wrong result"))
    except Exception as e:  # reported, not raised: the probe goes on
        q.put((rank, f"error: {str(e).strip().splitlines()[0][:120]}"))
    q.close()
    q.join_thread()  # the result is sent before the process ends (without gloo's teardown)
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    if not torch.cuda.is_available() and os.environ.get("PROBE_ON_CPU") != "1":  # (a check of this script)
        raise SystemExit("needs a CUDA device")
    ctx = mp.get_context("spawn")
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, {where}: gloo, 2 processes on one device\n")
    print("| collective | result |\n|---|---|")
    for name in _ops():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        q = ctx.Queue()
        procs = [ctx.Process(target=_run, args=(r, port, name, q)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
        got = {}
        for _ in range(2):
            try:
                r, what = q.get(timeout=1)
            except Exception:  # queue.Empty: a rank ended without a word
                break
            got[r] = what
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        if len(got) == 2 and len(set(got.values())) == 1:
            result = got[0]
        else:
            result = "; ".join(f"rank {r}: {got.get(r, f'ended, exit code {c}')}" for r, c in enumerate(codes))
        print(f"| {name} | {result} |", flush=True)


if __name__ == "__main__":
    main()

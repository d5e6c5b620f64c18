"""Worker tasks for ``test_collectives.py``: ``Comm``'s reduce-scatter and all-gather in both of
gloo's forms (the tensor form below ``GLOO_OWNER_MIN_BYTES`` per chunk, one operation per owner at
and above it), checked against sums computed on every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

from zerodp.core.collectives import GLOO_OWNER_MIN_BYTES, Comm


def rank_values(rank: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * (rank + 1) + rank


def both_forms(group, chunk_elements: int) -> dict:
    comm = Comm(group)
    n, r = comm.world_size, comm.rank
    full = rank_values(r, chunk_elements * n)
    comm.reduce_scatter_sum(full)
    want = sum(rank_values(k, chunk_elements * n) for k in range(n))
    rs_ok = torch.equal(full.chunk(n)[r], want.chunk(n)[r])
    gathered = torch.zeros(chunk_elements * n)
    gathered.chunk(n)[r].copy_(rank_values(r, chunk_elements))
    comm.all_gather(gathered, async_op=True).wait()
    ag_ok = all(torch.equal(gathered.chunk(n)[k], rank_values(k, chunk_elements)) for k in range(n))
    comm.counter.close_step()
    return {"reduce_scatter": rs_ok, "all_gather": ag_ok, "calls": comm.counter.last_calls.get("data", 0),
            "owner_form": chunk_elements * 4 >= GLOO_OWNER_MIN_BYTES, "backend": dist.get_backend(group)}

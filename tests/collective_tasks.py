"""Worker tasks for ``test_collectives.py``: ``Comm``'s reduce-scatter and all-gather in each of
gloo's forms (``ZERODP_GLOO_COLLECTIVES``: by chunk size, all-to-all, one operation per owner,
the tensor form),
checked against sums computed on every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

from zerodp.core.collectives import GLOO_FORMS_ENV, Comm


def rank_values(rank: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * (rank + 1) + rank


def each_form(group, chunk_elements: int, form: str) -> dict:
    import os
    os.environ[GLOO_FORMS_ENV] = form
    try:
        comm = Comm(group)
    finally:
        del os.environ[GLOO_FORMS_ENV]
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
            "form": comm.form(full.chunk(n)[0]), "backend": dist.get_backend(group)}

"""Worker tasks for ``test_collectives.py``: ``Comm``'s reduce-scatter and all-gather in each of
gloo's forms (``ZERODP_GLOO_COLLECTIVES``: ``auto`` and the all-to-all, one operation per owner,
the tensor form), and the all-to-all's pooled buffers, checked against sums computed on every
rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

from zerodp.core.collectives import GLOO_FORMS_ENV, SCRATCH, Comm


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
    # the same sum delivered into a tensor of its own (a gradient shard), asynchronously
    out = torch.full((chunk_elements,), float("nan"))
    comm.reduce_scatter_sum(rank_values(r, chunk_elements * n), async_op=True, out=out).wait()
    rs_out_ok = torch.equal(out, want.chunk(n)[r])
    gathered = torch.zeros(chunk_elements * n)
    gathered.chunk(n)[r].copy_(rank_values(r, chunk_elements))
    comm.all_gather(gathered, async_op=True).wait()
    ag_ok = all(torch.equal(gathered.chunk(n)[k], rank_values(k, chunk_elements)) for k in range(n))
    comm.counter.close_step()
    return {"reduce_scatter": rs_ok, "reduce_scatter_out": rs_out_ok, "all_gather": ag_ok,
            "calls": comm.counter.last_calls.get("data", 0),
            "form": comm.form(), "backend": dist.get_backend(group)}


def pooled_operations(group) -> dict:
    """Two rounds of five operations in flight at once (reduce-scatters and all-gathers of
    three sizes, fp32 and bf16) through the all-to-all."""
    comm = Comm(group)
    assert comm.form() == "all_to_all", comm.form()
    n, r = comm.world_size, comm.rank
    SCRATCH.release()
    held, ok, lent = [], [], []
    for _ in range(2):
        ops = []
        for chunk, dtype in [(3000, torch.float32), (1000, torch.bfloat16), (5000, torch.float32)]:
            full = rank_values(r, chunk * n).to(dtype)
            ops.append(("rs", chunk, dtype, full, comm.reduce_scatter_sum(full, async_op=True)))
        for chunk, dtype in [(2000, torch.float32), (1000, torch.bfloat16)]:
            full = torch.zeros(chunk * n, dtype=dtype)
            full.chunk(n)[r].copy_(rank_values(r, chunk).to(dtype))
            ops.append(("ag", chunk, dtype, full, comm.all_gather(full, async_op=True)))
        lent.append(SCRATCH.lent_buffers)
        for kind, chunk, dtype, full, handle in ops:
            handle.wait()
            if kind == "rs":
                want = sum(rank_values(k, chunk * n).to(dtype).float() for k in range(n)).to(dtype)
                ok.append(torch.equal(full.chunk(n)[r], want.chunk(n)[r]))
            else:
                ok.append(all(torch.equal(full.chunk(n)[k], rank_values(k, chunk).to(dtype)) for k in range(n)))
        held.append(SCRATCH.held_bytes)
    return {"results_ok": ok, "lent_in_flight": lent, "held_after_first": held[0],
            "held_after_second": held[1], "lent_after": SCRATCH.lent_buffers}

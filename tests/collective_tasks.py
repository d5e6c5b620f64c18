"""Worker tasks for ``test_collectives.py``: ``Comm``'s reduce-scatter and all-gather in each of
gloo's forms (``ZERODP_GLOO_COLLECTIVES``: ``auto`` and the all-to-all, one operation per owner,
the tensor form), and the all-to-all's pooled buffers, checked against sums computed on every
rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

from zerodp.core.collectives import GLOO_FORMS_ENV, SCRATCH, Comm, ScratchPool


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


def capped_pool_operations(group) -> dict:
    """Five operations issued at once through a pool of capacity one: each waits for the one
    holding the buffer, so one buffer (of the largest operation) is lent at any time."""
    pool = ScratchPool(capacity=1)
    comm = Comm(group).using(pool)
    default_before = SCRATCH.held_bytes
    n, r = comm.world_size, comm.rank
    ops, lent, ok = [], [], []
    for kind, chunk in [("rs", 3000), ("ag", 5000), ("rs", 1000), ("ag", 2000), ("rs", 4000)]:
        if kind == "rs":
            full = rank_values(r, chunk * n)
            ops.append((kind, chunk, full, comm.reduce_scatter_sum(full, async_op=True)))
        else:
            full = torch.zeros(chunk * n)
            full.chunk(n)[r].copy_(rank_values(r, chunk))
            ops.append((kind, chunk, full, comm.all_gather(full, async_op=True)))
        lent.append(pool.lent_buffers)
    for kind, chunk, full, handle in ops:
        handle.wait()
        if kind == "rs":
            want = sum(rank_values(k, chunk * n) for k in range(n))
            ok.append(torch.equal(full.chunk(n)[r], want.chunk(n)[r]))
        else:
            ok.append(all(torch.equal(full.chunk(n)[k], rank_values(k, chunk)) for k in range(n)))
    return {"results_ok": ok, "lent_in_flight": lent, "held": pool.held_bytes, "lent_after": pool.lent_buffers,
            "default_pool_grew": SCRATCH.held_bytes - default_before}


# the collectives of torch.distributed a training step may call (looked up there at call time)
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single", "broadcast",
                "reduce", "reduce_scatter_tensor", "all_gather_object", "gather_object", "barrier",
                "send", "recv", "isend", "irecv", "batch_isend_irecv")


def collectives_per_step(group, stage: int, form: str = "auto") -> dict:
    """Train the tiny example GPT (a unit per block, clipping on) for three steps and count the
    ``torch.distributed`` calls of the third, by name, on this rank."""
    import os

    import zerodp
    from zerodp.examples.gpt import Block, build_gpt
    os.environ[GLOO_FORMS_ENV] = form
    try:
        torch.manual_seed(0)
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 50_000,
                                     "stage3_prefetch_bucket_size": 50_000, "stage3_max_reuse_distance": 0}}
        engine, _, _, _ = zerodp.initialize(model=build_gpt("tiny"), config=cfg, process_group=group,
                                            unit_classes=(Block,))
    finally:
        del os.environ[GLOO_FORMS_ENV]
    rank = dist.get_rank(group)
    counts: dict[str, int] = {}
    for step in range(3):
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(10 * step + rank))
        saved = {}
        if step == 2:
            for name in _COLLECTIVES:
                original = getattr(dist, name, None)
                if original is None:
                    continue

                def counted(*args, _original=original, _name=name, **kwargs):
                    counts[_name] = counts.get(_name, 0) + 1
                    return _original(*args, **kwargs)
                saved[name] = original
                setattr(dist, name, counted)
        try:
            _, loss = engine(x, x)
            engine.backward(loss)
            engine.step()
        finally:
            for name, original in saved.items():
                setattr(dist, name, original)
    engine.destroy()
    return counts

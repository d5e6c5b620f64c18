"""Worker tasks for ``test_axes.py``: flat groups that shard and reduce over an axis of their own
(``core/axes.py``), beside groups on the data axis, through the real ``build_flat_groups``,
``GradReducer`` and stage-3 gather."""
from __future__ import annotations

import torch
from torch import nn

from zerodp.config import load_config
from zerodp.core.assemble import build_flat_groups
from zerodp.core.axes import DATA, ShardAxes
from zerodp.core.collectives import Comm
from zerodp.core.precision import PrecisionPolicy
from zerodp.core.reduce import GradReducer
from zerodp.core.stages import policy_for
from zerodp.parallel.grid import new_axis


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def reduce_over_own_axis(group, stage: int) -> dict:
    """The last layer shards over pairs of ranks ({0, 1}, {2, 3}), the first over all four: each
    group's partitions are its axis' ranks, and its reduced gradient shard is the sum over them."""
    data = Comm(group)
    me = data.rank
    pair = new_axis("pair", [[0, 1], [2, 3]], me).comm(label="pair")
    axes = ShardAxes({DATA: data, "pair": pair})
    model = _model()
    last = {id(p) for p in model[2].parameters()}
    groups = [{"params": list(model.parameters())}]
    flat = build_flat_groups(model, groups, {}, 10**6, axes=axes, sharding=True,
                             device=torch.device("cpu"), axis_of={i: "pair" for i in last})
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(100 + me))
    policy = policy_for(stage)
    for g in flat:
        g.grads.allocate(keep_full=policy.full_gradient_buffer)
    reducer = GradReducer(axes, flat, policy, PrecisionPolicy.from_config(load_config({"train_batch_size": 4})),
                          reduce_scatter=True, overlap_comm=False)
    hooks = [p.register_post_accumulate_grad_hook(lambda p, t=t, i=i: reducer.on_grad(t, i, p))
             for t, g in enumerate(flat) for i, p in enumerate(g.params)]
    reducer.begin(True)
    model(x).square().sum().backward()
    reducer.finish()
    for h in hooks:
        h.remove()
    # the sums each group should hold: every rank's own gradient, from a model of its own
    mine = _model()
    mine(x).square().sum().backward()
    own = {n: p.grad.reshape(-1) for n, p in mine.named_parameters()}
    out = []
    for g in flat:
        comm = axes.of(g)
        local = torch.zeros(g.padded_numel)
        for s in g.slots:
            local[s.offset:s.offset + s.numel] = own[s.name]
        comm.all_reduce_sum(local)
        out.append({"axis": g.axis, "partitions": g.partitions, "rank": g.rank,
                    "ok": torch.allclose(g.grads.shard, g.shard_of(local), atol=1e-6)})
    return {"groups": out}


def gather_over_own_axis(group) -> dict:
    """Stage 3: a group on the pair axis is gathered from its pair alone; each pair's ranks hold
    their own values (as expert-parallel ranks hold other experts)."""
    data = Comm(group)
    me = data.rank
    pair = new_axis("pair", [[0, 1], [2, 3]], me).comm(label="pair")
    axes = ShardAxes({DATA: data, "pair": pair})
    model = _model()
    with torch.no_grad():
        for p in model[2].parameters():
            p.add_(me // 2)  # the pairs differ
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    last = {id(p) for p in model[2].parameters()}
    flat = build_flat_groups(model, [{"params": list(model.parameters())}], {}, 10**6, axes=axes,
                             sharding=True, device=torch.device("cpu"), axis_of={i: "pair" for i in last})
    for g in flat:
        g.shard_parameters()
    released = all(p.numel() == 0 for p in model.parameters())
    for g in flat:
        axes.gather(g)
    same = all(torch.equal(p.detach(), want[n]) for n, p in model.named_parameters())
    return {"released": released, "same": same, "axes": sorted({g.axis for g in flat})}

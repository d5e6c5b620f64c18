"""Worker tasks for stage-3 specific tests."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zerodp


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}


def modify_with_gathered_parameters(group, stage: int) -> dict:
    """Rank 0 writes into a weight inside GatheredParameters(modifier_rank=0); every rank must
    see rank 0's values afterwards, gathered again from the re-sharded state."""
    rank = dist.get_rank(group)
    engine, _, _, _ = zerodp.initialize(model=_mlp(), config=_config(stage), process_group=group)
    w = engine.module[2].weight
    with zerodp.GatheredParameters([w], modifier_rank=0):
        full_inside = w.detach().clone()
        with torch.no_grad():
            w.fill_(float(rank + 1))           # only rank 0's edit may survive
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        after = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    sharded_at_rest = engine.memory_breakdown()["gathered_parameters"] == 0
    engine.destroy()
    return {"inside_shape": tuple(full_inside.shape), "after": after, "sharded_at_rest": sharded_at_rest}


class Gate(nn.Module):
    """A unit whose second weight is used only when asked (per rank, per step)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(dim, dim) * 0.3)
        self.w2 = nn.Parameter(torch.randn(dim, dim) * 0.3)

    def forward(self, x, use_w2: bool):
        y = x @ self.w1
        return y + x @ self.w2 if use_w2 else y


class GatedNet(nn.Module):
    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.gate = Gate(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, use_w2: bool):
        return self.out(torch.tanh(self.gate(torch.tanh(self.inp(x)), use_w2))).pow(2).mean()


def gated_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def gated_use(step: int, rank: int) -> bool:
    return (step + rank) % 2 == 0


def gated_reference(world: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = GatedNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    for step in range(steps):
        opt.zero_grad()
        losses = [model(gated_batch(step, r), gated_use(step, r)) for r in range(world)]
        (sum(losses) / world).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def gated_train(group, steps: int) -> dict:
    """Stage 3 with a parameter inside a unit used on some ranks only, between other units."""
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1,
                                 "overlap_comm": True}}
    engine, _, _, _ = zerodp.initialize(model=GatedNet(), config=cfg, process_group=group)
    for step in range(steps):
        engine.backward(engine(gated_batch(step, rank), gated_use(step, rank)))
        engine.step()
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        out = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    units = [u.name for u in engine.sharded.units]
    engine.destroy()
    return {"params": out, "units": units}


def _stage3_config(prefetch: int, lr: float = 0.05, reuse: int = 0) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1,
                                  "stage3_prefetch_bucket_size": prefetch, "overlap_comm": True,
                                  "stage3_max_reuse_distance": reuse}}


def deep_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16, bias=False), nn.Tanh())])


def prefetch_task(group, prefetch: int, reuse: int = 0) -> dict:
    """Six equal units; returns the peak of gathered parameter bytes, the traffic of the last
    step and the result."""
    rank = dist.get_rank(group)
    engine, _, _, _ = zerodp.initialize(model=deep_net(), config=_stage3_config(prefetch, reuse=reuse),
                                        process_group=group)
    # bytes of own-shard storage held by gathered groups, seen from inside every unit's forward
    held: list[int] = []

    def look(module, args):
        held.append(sum(g._own_shard.untyped_storage().nbytes() for g in engine.flat_groups
                        if g.gathered))
    hooks = [u.module.register_forward_pre_hook(look) for u in engine.sharded.units[1:]]
    # non-root units gathered while the first unit of backward (the last of forward) computes
    first_backward: list[int] = []
    hooks.append(engine.sharded.units[-1].module.register_full_backward_hook(
        lambda m, gin, gout: first_backward.append(sum(u.gathered for u in engine.sharded.units[1:]))))
    # whether the first unit is on its way when the model's forward begins (after the engine's hook)
    first_unit_at_start: list[bool] = []
    hooks.append(engine.module.register_forward_pre_hook(
        lambda m, args: first_unit_at_start.append(engine.sharded.units[1].gathered)))
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    for h in hooks:
        h.remove()
    mem = engine.memory_breakdown()
    unit_bytes = engine.sharded.units[1].numel * 4
    shards_back = all(g._own_shard.untyped_storage().nbytes() == g.shard_numel * 4 for g in engine.flat_groups)
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"peak": mem["gathered_parameters_peak"], "unit_bytes": unit_bytes, "params": params,
            "units": len(engine.sharded.units), "order": engine.sharded.prefetcher.order,
            "all_gather": engine.comm_stats()["all_gather"], "shard_bytes_while_gathered": max(held),
            "shards_back": shards_back, "gathered_in_first_backward_unit": first_backward[-1],
            "first_unit_at_start": first_unit_at_start}


def collective_order_task(group) -> list:
    """Six equal units, one prefetched ahead; returns the last step's collectives in issue
    order: ("ag", unit) for an all-gather, ("rs", unit) for a reduce-scatter."""
    from zerodp.core.collectives import Comm
    rank = dist.get_rank(group)
    events: list = []
    original = Comm.all_gather, Comm.reduce_scatter_sum
    try:
        Comm.all_gather = lambda self, full, *a, **k: (events.append(("ag", id(full))),
                                                       original[0](self, full, *a, **k))[1]
        Comm.reduce_scatter_sum = lambda self, full, *a, **k: (events.append(("rs", full.numel())),
                                                               original[1](self, full, *a, **k))[1]
        engine, _, _, _ = zerodp.initialize(model=deep_net(), config=_stage3_config(256), process_group=group)
        unit_of = {id(g.full): g.unit for g in engine.flat_groups}
        for step in range(3):
            events.clear()
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = engine(x).pow(2).mean()
            launched = len(events)
            engine.backward(loss)
            engine.step()
    finally:
        Comm.all_gather, Comm.reduce_scatter_sum = original
    engine.destroy()
    # a reduce-scatter's bucket is new each time: name it by the unit whose backward launched it
    backward, done = [], iter(reversed(range(1, len(engine.sharded.units))))
    for kind, key in events[launched:]:
        backward.append(("ag", unit_of[key]) if kind == "ag" else ("rs", next(done)))
    return [("ag", unit_of[key]) for _, key in events[:launched]] + backward


class Reorder(nn.Module):
    """Three units whose forward order flips in some steps (on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(6, 6) for _ in range(3))

    def forward(self, x, flip: bool):
        for m in ((self.c, self.b, self.a) if flip else (self.a, self.b, self.c)):
            x = torch.tanh(m(x))
        return x.pow(2).mean()


def reorder_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(7 * step + rank))


def reorder_reference(world: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = Reorder()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    for step in range(steps):
        opt.zero_grad()
        (sum(model(reorder_batch(step, r), step == 2) for r in range(world)) / world).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reorder_task(group, steps: int) -> dict:
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    engine, _, _, _ = zerodp.initialize(model=Reorder(), config=_stage3_config(10**6), process_group=group)
    for step in range(steps):
        engine.backward(engine(reorder_batch(step, rank), step == 2))
        engine.step()
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    rerecords = engine.sharded.prefetcher.rerecords
    engine.destroy()
    return {"params": params, "rerecords": rerecords}


def agreement_task(group, prefetch: int) -> list[int]:
    """Six equal units, three steps; returns how many times per step every rank waited for the
    others to reach the same call (to agree on the unit it runs)."""
    engine, _, _, _ = zerodp.initialize(model=deep_net(), config=_stage3_config(prefetch), process_group=group)
    meetings = []
    for step in range(3):
        before = engine.sharded.prefetcher.agreement.meetings
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        meetings.append(engine.sharded.prefetcher.agreement.meetings - before)
    engine.destroy()
    return meetings


class Peek(nn.Module):
    """A unit whose forward reads a later unit's weight through ``GatheredParameters``: by
    then that unit's all-gather is a prefetch, possibly still in flight."""

    def __init__(self, width: int, later: nn.Linear):
        super().__init__()
        self.lin = nn.Linear(width, width, bias=False)
        self.later = (later,)  # not a submodule: the weight stays in its own unit
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        with zerodp.GatheredParameters(self.later[0].weight):
            self.seen.append(self.later[0].weight.detach().clone())
        return torch.tanh(self.lin(x))


def peek_task(group, steps: int = 4) -> dict:
    """Read a prefetched unit's weight inside a forward with ``GatheredParameters``, in every
    step; returns what the forward saw and the weight read outside any forward right after."""
    torch.manual_seed(0)
    width = 512  # 1 MiB per weight: a prefetch takes long enough to be read while in flight
    layers = [nn.Linear(width, width, bias=False) for _ in range(4)]
    model = nn.Sequential(Peek(width, layers[-1]), *layers)
    engine, _, _, _ = zerodp.initialize(model=model, config=_stage3_config(8 * width * width),
                                        process_group=group)
    outside = []
    for step in range(steps):
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(step))
        loss = engine(x).pow(2).mean()
        with zerodp.GatheredParameters(layers[-1].weight):
            outside.append(layers[-1].weight.detach().clone())
        engine.backward(loss)
        engine.step()
    seen = engine.module[0].seen
    engine.destroy()
    return {"seen": seen, "outside": outside}


def divergent_task(group) -> str:
    """Rank 0 runs a branch the other ranks skip; returns the error every rank raised."""
    from parity_model import batch, build_model, make_config
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = make_config(3, world)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 1
    engine, _, _, _ = zerodp.initialize(model=build_model(), config=cfg, process_group=group)
    try:
        engine.backward(engine(*batch(0, rank, 0), rank == 0))
        engine.step()
    except RuntimeError as e:
        return str(e)
    finally:
        engine.destroy()
    return "no error"


def meta_init_task(group, precision: str = "fp32") -> dict:
    """Build the example GPT on the meta device and train it at stage 3: no rank ever holds
    more than its shards plus one unit's full parameters (``precision``: fp32 or bf16)."""
    from zerodp.examples.gpt import GPT, Block, build_gpt
    rank = dist.get_rank(group)
    with torch.device("meta"):
        model = build_gpt("small")
    width = 2 if precision == "bf16" else 4
    full_bytes = width * sum(p.numel() for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
           "bf16": {"enabled": precision == "bf16"},
           "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0,
                                 "stage3_max_reuse_distance": 0}}
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, process_group=group,
                                        unit_classes=(Block,), param_init_fn=GPT._init_weights)
    init_peak = engine.memory_breakdown()["gathered_parameters_peak"]
    unit_bytes = max(u.numel for u in engine.sharded.units) * width
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(6):  # the same batch: the loss must fall
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    mem = engine.memory_breakdown()
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        std = engine.module.blocks[0].mlp.c_fc.weight.std().item()
        ln = engine.module.blocks[0].ln_1.weight.detach().clone()
        checksum = sum(p.double().sum().item() for p in engine.module.parameters())
        dtypes = {str(p.dtype) for p in engine.module.parameters()}
        tied = engine.module.lm_head.weight is engine.module.wte.weight
    engine.destroy()
    held = (mem["parameters"] + mem["gradients"] + mem["optimizer_states"] + mem["master_weights"]
            + mem["gathered_parameters_peak"])
    return {"dtypes": dtypes, "master_bytes": mem["master_weights"], "full_bytes": full_bytes,
            "init_peak": init_peak, "unit_bytes": unit_bytes, "held": held,
            "losses": losses, "std": std, "ln": ln, "checksum": checksum, "tied": tied}


class ReadsChildWeight(nn.Module):
    """A parent that uses its child's weight directly, outside the child's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)
        self.out = nn.Linear(6, 1)

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        h = h @ self.inner.weight              # read outside inner's forward
        return self.out(h).pow(2).mean()


def _reads_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))


def reads_child_weight_reference(world: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = ReadsChildWeight()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    for step in range(steps):
        opt.zero_grad()
        (sum(model(_reads_batch(step, r)) for r in range(world)) / world).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reads_child_weight_task(group, threshold: int, register: bool = False, steps: int = 3):
    """Returns the error text, or the trained parameters."""
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    model = ReadsChildWeight()
    if register:
        zerodp.register_external_parameter(model, model.inner.weight)
    cfg = _stage3_config(10**6)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, process_group=group)
    try:
        for step in range(steps):
            engine.backward(engine(_reads_batch(step, rank)))
            engine.step()
        with zerodp.GatheredParameters(list(engine.module.parameters())):
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    except RuntimeError as e:
        return str(e)
    finally:
        engine.destroy()


def empty_partition_cache_task(group) -> dict:
    """After a step has recorded the units' order, a forward with grad enabled whose backward
    never comes leaves its units gathered (``stage3_max_reuse_distance`` keeps them for the
    backward); ``empty_partition_cache()`` releases them and the collective buffers, and the
    next step trains on the shards as if nothing had been gathered: its loss is the abandoned
    forward's (same batch, no update between)."""
    rank = dist.get_rank(group)
    engine, _, _, _ = zerodp.initialize(model=deep_net(), config=_stage3_config(0, reuse=10**6),
                                        process_group=group)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 16, generator=gen)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    first = engine(x).pow(2).mean().item()          # a forward with grad, no backward
    before = engine.memory_breakdown()
    engine.empty_partition_cache()
    after = engine.memory_breakdown()
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    second = engine(x).pow(2).mean().item()          # after one update: moved
    out = {"gathered_before": before["gathered_parameters"], "gathered_after": after["gathered_parameters"],
           "buffers_after": after["collective_buffers"], "first": first, "again": loss.item(),
           "after_step": second}
    engine.destroy()
    return out


def unit_states_through_a_step(group) -> dict:
    """The states a step takes the units and the prefetch plan through (``core/gather.py``), seen
    from hooks on the units' modules and from the engine between calls."""
    rank = dist.get_rank(group)
    engine, _, _, _ = zerodp.initialize(model=_mlp(), config=_config(3), process_group=group)
    units = engine.sharded.units
    pool = engine.sharded.scratch  # every stage-3 gather and reduction borrows this one buffer
    one_pool = all(axes.comm().scratch is pool for axes in (engine.shard_axes, engine.reducer.axes))
    seen: dict[str, list] = {"in_forward": [], "in_backward": []}
    hooks = [u.module.register_forward_pre_hook(  # after the engine's own pre-hook
        lambda m, a, u=u: seen["in_forward"].append(u.state.value)) for u in units[1:]]
    hooks += [u.module.register_full_backward_hook(
        lambda m, gi, go, u=u: seen["in_backward"].append(u.state.value)) for u in units[1:]]
    plans = []
    for step in range(2):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        out = engine(x.requires_grad_()).pow(2).mean()  # every unit's backward hook after its own
        plans.append(engine.sharded.prefetcher.plan.value)
        seen.setdefault(f"after_forward_{step}", [u.state.value for u in units[1:]])
        engine.backward(out)
        seen.setdefault(f"after_backward_{step}", [(u.state.value, u.pending_backward) for u in units])
        engine.step()
    for h in hooks:
        h.remove()
    with engine.parameters_held():
        held = ([u.state.value for u in units], engine.sharded.prefetcher.plan.value)
        engine.backward(engine(torch.ones(2, 8)).sum())
        held_after_backward = [u.state.value for u in units]
    after_held = ([u.state.value for u in units], engine.sharded.prefetcher.plan.value)
    engine.sharded.invalidate()
    invalidated = engine.sharded.prefetcher.plan.value
    with torch.no_grad():
        engine(torch.ones(2, 8))
    rerecorded = engine.sharded.prefetcher.plan.value
    engine.destroy()
    return {**seen, "plans": plans, "held": held, "held_after_backward": held_after_backward,
            "after_held": after_held, "invalidated": invalidated, "rerecorded": rerecorded, "units": len(units),
            "one_pool": one_pool}

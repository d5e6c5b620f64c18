"""Mixed-precision worker tasks and the single-process reference they are compared with.

The reference does what the engine does, in one process: the model in the 16-bit compute
dtype, one forward/backward per (rank, micro-batch) chunk on the same inputs, the chunk
gradients combined in the dtype and order the configuration asks for, unscaled and divided
in fp32, clipped, and AdamW on fp32 master weights that are rounded back into the 16-bit
parameters after every step.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from parity_model import ADAMW, batch, build_model, gathered_params, on, param_groups, use_branch

import zerodp
from zerodp.core.precision import LossScaleAtMinimumError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def precision_config(stage: int, world: int, dtype: str, gas: int = 1, clip: float = 0.0,
                     bucket: int = 500_000_000, comm: str | None = None, accum: str | None = None,
                     scale_power: int = 8, window: int = 1000, hysteresis: int = 2,
                     min_scale: float = 1.0) -> dict:
    cfg = {"train_batch_size": 2 * gas * world, "train_micro_batch_size_per_gpu": 2,
           "gradient_clipping": clip, "steps_per_print": 10_000,
           "optimizer": {"type": "AdamW", "params": dict(ADAMW)},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "overlap_comm": True,
                                 "stage3_param_persistence_threshold": 1}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": scale_power, "loss_scale_window": window,
                       "hysteresis": hysteresis, "min_loss_scale": min_scale}
    if comm:
        cfg["communication_data_type"] = comm
    if accum:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    return cfg


def reference_mixed(world: int, steps: int, dtype: str, gas: int = 1, clip: float = 0.0,
                    order: str = "fp32", scale: float = 2.0 ** 8, branch_on_all_ranks: bool = False,
                    device: str | torch.device = "cpu"):
    """The reference (see module docstring). ``order`` says how chunk gradients are summed:

    * ``"fp32"``: all chunk gradients summed in fp32 (``grad_accum_dtype`` and
      ``communication_data_type`` fp32);
    * ``"micro_then_rank"``: each rank sums its micro-batches in the 16-bit dtype, then the
      ranks' sums are added in the 16-bit dtype (stages 0-1 with the default dtypes);
    * ``"rank_then_micro"``: each micro-batch's gradients are added across ranks in 16 bits,
      then accumulated over micro-batches in 16 bits (stages 2-3 with the default dtypes).

    Runs on ``device``; returns (fp32 master weights by name, grad norm per step, 16-bit
    parameters by name), on the CPU.
    """
    low = DTYPES[dtype]
    model = build_model().to(device=device, dtype=low)
    groups = param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    masters = {id(p): p.detach().float().clone().requires_grad_(True) for g in groups for p in g["params"]}
    opt = torch.optim.AdamW([dict(g, params=[masters[id(p)] for p in g["params"]]) for g in groups],
                            **{k: tuple(v) if isinstance(v, list) else v for k, v in ADAMW.items()})
    params = [p for g in groups for p in g["params"]]
    loss_scale = scale if dtype == "fp16" else 1.0
    norms = []
    for step in range(steps):
        chunk = {}
        for r in range(world):
            for m in range(gas):
                model.zero_grad(set_to_none=True)
                loss = model(*on(device, batch(step, r, m)), use_branch(step, r, m, branch_on_all_ranks))
                scaled = loss / gas if gas > 1 else loss
                if dtype == "fp16":
                    scaled = scaled.float() * loss_scale
                scaled.backward()
                chunk[r, m] = {id(p): p.grad.clone() for p in params if p.grad is not None}
        total = {}
        for p in params:
            got = {k: c[id(p)] for k, c in chunk.items() if id(p) in c}
            if not got:
                continue
            zero = torch.zeros_like(p)

            def g(r, m, got=got, zero=zero):
                return got.get((r, m), zero)
            if order == "fp32":
                total[id(p)] = sum(v.float() for v in got.values())
            elif order == "micro_then_rank":
                per_rank = []
                for r in range(world):
                    acc = g(r, 0).clone()
                    for m in range(1, gas):
                        acc += g(r, m)
                    per_rank.append(acc)
                acc = per_rank[0].clone()
                for v in per_rank[1:]:
                    acc += v
                total[id(p)] = acc.float()
            else:
                acc = None
                for m in range(gas):
                    red = g(0, m).clone()
                    for r in range(1, world):
                        red += g(r, m)
                    acc = red if acc is None else acc + red
                total[id(p)] = acc.float()
        norms.append(master_update(params, masters, total, world * loss_scale, clip, opt))
    return ({names[k]: v.detach().to("cpu", copy=True) for k, v in masters.items()}, norms,
            {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()})


def master_update(params, masters: dict, total: dict, divisor: float, clip: float, opt, sched=None) -> float:
    """A reference's update from summed fp32 gradients ``total`` (by ``id`` of the parameter):
    divide by ``divisor``, clip to the global norm (``clip / (norm + 1e-6)`` when below 1), step
    the fp32 ``masters`` (and ``sched``), copy them into ``params``; returns the norm."""
    for t in total.values():
        t.mul_(1.0 / divisor)
    norm = math.sqrt(sum(torch.linalg.vector_norm(t, dtype=torch.float32).double().item() ** 2
                         for t in total.values()))
    if clip > 0 and clip / (norm + 1e-6) < 1:
        for t in total.values():
            t.mul_(clip / (norm + 1e-6))
    for p in params:
        masters[id(p)].grad = total.get(id(p))
    opt.step()
    if sched is not None:
        sched.step()
    with torch.no_grad():
        for p in params:
            p.copy_(masters[id(p)])
    return norm


def gathered_masters(engine) -> dict[str, torch.Tensor]:
    """Every trainable parameter's fp32 master, assembled from all ranks' shards, on the CPU."""
    out = {}
    group = engine.comm.group
    for g in engine.trainable:
        with g.swapped_in():  # disk offload: read from its file
            master = g.optim.master.clone() if g.optim.master is not None else g.shard.float()
        if g.partitions > 1:
            parts = [torch.empty_like(master) for _ in range(g.partitions)]
            dist.all_gather(parts, master.contiguous(), group=group)
            master = torch.cat(parts)
        for i, slot in enumerate(g.slots):
            out[slot.name] = g.view(master, i).to("cpu", copy=True)
    return out


def train_mixed(group, stage: int, steps: int, dtype: str, gas: int = 1, clip: float = 0.0,
                bucket: int = 500_000_000, comm: str | None = None, accum: str | None = None) -> dict:
    """The parity model through zerodp in 16-bit; returns masters, 16-bit params and facts."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    model = build_model()
    engine, _, _, _ = zerodp.initialize(
        model=model, model_parameters=param_groups(model), process_group=group,
        config=precision_config(stage, world, dtype, gas, clip, bucket, comm, accum))
    norms, out_dtypes = [], set()
    for step in range(steps):
        for m in range(gas):
            loss = engine(*on(engine.device, batch(step, rank, m)), use_branch(step, rank, m, stage == 3))
            out_dtypes.add(str(loss.dtype))
            engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    result = {"masters": gathered_masters(engine), "params": gathered_params(engine),
              "norms": norms, "loss_dtypes": sorted(out_dtypes), "comm": engine.comm_stats(),
              "memory": engine.memory_breakdown(), "skipped": engine.skipped_steps}
    engine.destroy()
    return result


# -- loss scaling --------------------------------------------------------------------------------

class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _mlp_engine(group, stage: int, extra: dict):
    torch.manual_seed(0)
    model = _Mlp()
    world = dist.get_world_size(group)
    cfg = {"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 4,
           "steps_per_print": 10_000, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 10, "warmup_type": "linear"}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    cfg.update(extra)
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, process_group=group)
    return engine


def overflow_task(group, stage: int, inject: list[int], window: int, hysteresis: int = 1,
                  steps: int | None = None, min_scale: float = 1.0, scale_power: int = 4) -> dict:
    """fp16 training where rank 0 (only) turns one gradient into inf in the steps listed in
    ``inject``; returns per step: loss scale after it, whether params changed, lr, skipped."""
    rank = dist.get_rank(group)
    engine = _mlp_engine(group, stage, {"fp16": {
        "enabled": True, "initial_scale_power": scale_power, "loss_scale_window": window,
        "hysteresis": hysteresis, "min_loss_scale": min_scale}})
    state = {"step": 0}

    def poison(grad):
        if rank == 0 and state["step"] in inject:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad
    engine.module.a.weight.register_hook(poison)
    gen = torch.Generator().manual_seed(rank)
    rows = []
    try:
        for step in range(steps or max(inject) + window + 2):
            state["step"] = step
            before = {n: p.detach().float().clone() for n, p in gathered_params(engine).items()}
            x = torch.randn(4, 8, generator=gen)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            after = gathered_params(engine)
            changed = any(not torch.equal(before[n], p.float()) for n, p in after.items())
            rows.append({"scale": engine.loss_scale, "changed": changed, "lr": engine.get_lr()[0],
                         "skipped": engine.skipped_steps, "norm": engine.get_global_grad_norm(),
                         "opt_state": len(engine.optimizer.state)})
    except Exception as e:  # noqa: BLE001 - the error is the result under test
        return {"rows": rows, "error": f"{type(e).__name__}: {e}"}
    finally:
        engine.destroy()
    return {"rows": rows, "error": None}


def overflow_at_minimum_task(group, stage: int, gas: int = 1) -> list[dict]:
    """fp16 already at its minimum loss scale; rank 0 (only) turns a gradient into inf in the
    first micro-batch of step 1, and every other batch is clean. Returns per step: the error
    step() raised (or None), whether the parameters changed, and the step counters after it."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    engine = _mlp_engine(group, stage, {
        "train_batch_size": 4 * gas * world, "gradient_accumulation_steps": gas,
        "fp16": {"enabled": True, "initial_scale_power": 4, "min_loss_scale": 16, "hysteresis": 1,
                 "loss_scale_window": 100}})
    state = {"at": None}

    def poison(grad):
        if rank == 0 and state["at"] == (1, 0):
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad
    engine.module.a.weight.register_hook(poison)
    gen = torch.Generator().manual_seed(rank)
    rows = []
    try:
        for step in range(4):
            before = {n: p.detach().float().clone() for n, p in gathered_params(engine).items()}
            error = None
            try:
                for m in range(gas):
                    state["at"] = (step, m)
                    engine.backward(engine(torch.randn(4, 8, generator=gen)).float().pow(2).mean())
                    engine.step()
            except LossScaleAtMinimumError as e:
                error = str(e)
            after = gathered_params(engine)
            changed = any(not torch.equal(before[n], p.float()) for n, p in after.items())
            rows.append({"error": error, "changed": changed,
                         "skipped": engine.skipped_steps, "global_steps": engine.global_steps,
                         "micro_steps": engine.micro_steps, "scale": engine.loss_scale,
                         "norm_finite": math.isfinite(engine.get_global_grad_norm())})
    finally:
        engine.destroy()
    return rows


# -- casting ---------------------------------------------------------------------------------------

class _Casty(torch.nn.Module):
    """A float input, an integer input, a float buffer and a batch-norm layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.lin = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.register_buffer("offset", torch.full((8,), 0.25))

    def forward(self, x, ids):
        h = self.lin(x) + self.emb(ids) + self.offset
        return self.bn(h)


def casting_task(group, stage: int, dtype: str) -> dict:
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    model = _Casty()
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10_000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1},
           dtype: {"enabled": True}}
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, process_group=group)
    mean_before = model.bn.running_mean.clone()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 8, generator=gen)               # fp32 input: cast by the engine
    ids = torch.randint(0, 10, (4,), generator=gen)      # integer input: left alone
    out = engine(x, ids=ids)
    engine.backward(out.float().pow(2).mean())
    engine.step()
    with zerodp.GatheredParameters(list(model.parameters())):
        dtypes = {n: str(p.dtype) for n, p in model.named_parameters()}
    result = {"param_dtypes": dtypes, "out_dtype": str(out.dtype),
              "buffer_dtypes": {n: str(b.dtype) for n, b in model.named_buffers()},
              "bn_stats_moved": not torch.equal(mean_before, model.bn.running_mean),
              "masters": sorted(str(g.optim.master.dtype) for g in engine.trainable if g.optim.master is not None),
              "memory": engine.memory_breakdown()}
    engine.destroy()
    return result


def modify_gathered_task(group, stage: int) -> dict:
    """Rank 0 overwrites a weight inside GatheredParameters(modifier_rank=0); the next step
    must start from the new value (the fp32 master follows the 16-bit parameter)."""
    engine = _mlp_engine(group, stage, {"bf16": {"enabled": True}})
    w = engine.module.a.weight
    with zerodp.GatheredParameters([w], modifier_rank=0):
        if dist.get_rank(group) == 0:
            with torch.no_grad():
                w.fill_(0.5)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    with zerodp.GatheredParameters([w]):
        value = w.detach().float().clone()
    engine.destroy()
    return {"max_dev_from_half": (value - 0.5).abs().max().item()}


# -- the example GPT: 16-bit against fp32 --------------------------------------------------------

def gpt_losses_task(group, stage: int, dtype: str, steps: int) -> list[float]:
    """Train the tiny example GPT; return the loss (mean over ranks) of every step."""
    from zerodp.examples import ByteCorpus, build_gpt
    from zerodp.examples.gpt import Block
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)
    model = build_gpt("tiny", n_layer=1, n_embd=32, n_head=2, block_size=32)
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10_000, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage}}
    if dtype != "fp32":  # fp16: a scale that does not overflow, so no step is skipped
        cfg[dtype] = {"enabled": True, **({"initial_scale_power": 10} if dtype == "fp16" else {})}
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, process_group=group, unit_classes=(Block,))
    corpus = ByteCorpus(max_bytes=1 << 18)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x, y = corpus.batch("train", 8, 32, generator=gen)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean, group=group)
        losses.append(mean.item() / world)
    assert engine.skipped_steps == 0
    engine.destroy()
    return losses

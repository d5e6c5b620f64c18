"""Worker tasks for the checkpoint tests, and the single-process reference they are compared with.

Every step trains on the same global batch of ``GLOBAL_MICROS`` micro-batches whatever the
world size: rank ``r`` runs micro-batches ``r * gas .. r * gas + gas - 1`` with
``gas = GLOBAL_MICROS / world``, so a run saved at one world size and resumed at another
sees exactly the batches an uninterrupted run would.

The reference does the same work in one process: per micro-batch a forward/backward in the
compute dtype of ``loss / gas`` (the engine's scaling), gradients summed in fp32 and divided
by the world size, clipped, and AdamW with a WarmupLR schedule on fp32 masters that are rounded
into the compute-dtype parameters after every step. With ``communication_data_type`` and
``grad_accum_dtype`` fp32 the engine does the same arithmetic up to the order of fp32 sums.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from parity_model import ADAMW, MICRO, ParityNet, batch, build_model, gathered_params, on, param_groups, use_branch
from precision_tasks import DTYPES, gathered_masters, master_update
from torch import nn

import zerodp
from zerodp.optim.schedules import WarmupLR

GLOBAL_MICROS = 12
CLIP = 0.5
WARMUP = {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 3, "warmup_type": "linear"}


def config(stage: int, world: int, dtype: str = "fp32", **extra) -> dict:
    cfg = {"train_batch_size": MICRO * GLOBAL_MICROS, "train_micro_batch_size_per_gpu": MICRO,
           "gradient_clipping": CLIP, "steps_per_print": 10_000,
           "optimizer": {"type": "AdamW", "params": dict(ADAMW)},
           "scheduler": {"type": "WarmupLR", "params": dict(WARMUP)},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 60,
                                 "stage3_param_persistence_threshold": 1}}
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
        cfg["communication_data_type"] = "fp32"
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    cfg["zero_optimization"].update(extra.pop("zero", {}))
    cfg.update(extra)
    return cfg


def micro_batch(step: int, j: int):
    return batch(step, j, 0)


def branch(step: int) -> bool:
    return use_branch(step, 0, 0, same_on_all_ranks=True)


def make_engine(group, stage: int, dtype: str = "fp32", seed: int = 0, **extra):
    world = dist.get_world_size(group)
    model = build_model(seed)
    engine, *_ = zerodp.initialize(model=model, model_parameters=param_groups(model),
                                   config=config(stage, world, dtype, **extra), process_group=group)
    return engine


def train_steps(engine, first: int, last: int) -> list[float]:
    """Optimizer steps ``first .. last - 1``; returns the gradient norms."""
    rank, gas = engine.dp_rank, engine.gradient_accumulation_steps()
    norms = []
    for step in range(first, last):
        for m in range(gas):
            engine.backward(engine(*on(engine.device, micro_batch(step, rank * gas + m)), branch(step)))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return norms


def snapshot(engine) -> dict:
    return {"masters": gathered_masters(engine), "params": gathered_params(engine),
            "global_steps": engine.global_steps, "lr": engine.get_lr()}


def save_task(group, stage: int, dtype: str, steps: int, save_dir: str, **kw) -> dict:
    """Train ``steps`` steps from scratch and save."""
    engine = make_engine(group, stage, dtype)
    norms = train_steps(engine, 0, steps)
    engine.save_checkpoint(save_dir, client_state={"steps": steps, "note": "resume me"}, **kw)
    out = snapshot(engine)
    out["norms"] = norms
    engine.destroy()
    return out


def resume_task(group, stage: int, dtype: str, load_dir: str, first: int, last: int, tag=None,
                **load_kw) -> dict:
    """A fresh engine (other initial weights), loaded from ``load_dir``, trained to ``last``."""
    engine = make_engine(group, stage, dtype, seed=123)
    path, client = engine.load_checkpoint(load_dir, tag=tag, **load_kw)
    assert engine.global_steps == first, (engine.global_steps, first)
    loaded = snapshot(engine)
    norms = train_steps(engine, first, last)
    out = snapshot(engine)
    out.update(norms=norms, path=path, client=client, loaded=loaded)
    engine.destroy()
    return out


def resume_without_task(group, missing: str, *args, **kw) -> dict:
    """:func:`resume_task` in a process where importing the package ``missing`` fails (an optional
    dependency, not installed where the user loads)."""
    import sys
    names = [n for n in sys.modules if n == missing or n.startswith(missing + ".")] + [missing]
    kept = {n: sys.modules.get(n) for n in names}
    sys.modules.update(dict.fromkeys(names))  # None: ``import`` raises ImportError
    try:
        return resume_task(group, *args, **kw)
    finally:
        for n, m in kept.items():
            if m is None:
                del sys.modules[n]
            else:
                sys.modules[n] = m


def run_task(group, stage: int, dtype: str, steps: int) -> dict:
    """Train ``steps`` steps without interruption."""
    engine = make_engine(group, stage, dtype)
    norms = train_steps(engine, 0, steps)
    out = snapshot(engine)
    out["norms"] = norms
    engine.destroy()
    return out


def reference(dtype: str, phases: list[tuple[int, int]]) -> dict:
    """One process; ``phases``: ``(world, steps)`` in order (the world sets ``gas``). Runs on
    one thread, as the workers do: 16-bit matmuls round differently when split over threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(dtype, phases)
    finally:
        torch.set_num_threads(threads)


def _reference(dtype: str, phases: list[tuple[int, int]]) -> dict:
    low = DTYPES[dtype]
    model = build_model().to(low)
    groups = param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in groups for p in g["params"]]
    masters = {id(p): p.detach().float().clone().requires_grad_(True) for p in params}
    opt = torch.optim.AdamW([dict(g, params=[masters[id(p)] for p in g["params"]]) for g in groups],
                            **{k: tuple(v) if isinstance(v, list) else v for k, v in ADAMW.items()})
    sched = WarmupLR(opt, **WARMUP)
    step = 0
    norms = []
    for world, steps in phases:
        gas = GLOBAL_MICROS // world
        for _ in range(steps):
            total: dict[int, torch.Tensor] = {}
            for j in range(GLOBAL_MICROS):
                model.zero_grad(set_to_none=True)
                loss = model(*micro_batch(step, j), branch(step))
                (loss / gas if gas > 1 else loss).backward()
                for p in params:
                    if p.grad is not None:
                        g = p.grad.float()
                        total[id(p)] = g if id(p) not in total else total[id(p)] + g
            norms.append(master_update(params, masters, total, world, CLIP, opt, sched))
            step += 1
    return {"masters": {names[k]: v.detach().clone() for k, v in masters.items()}, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# -- exact resume with dropout, a data loader and the RNG -------------------------------------

class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.3)
        self.l2 = nn.Linear(16, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.l2(self.drop(torch.relu(self.l1(x)))), y)


def _dataset():
    g = torch.Generator().manual_seed(42)
    x = torch.randn(40, 6, generator=g)
    y = torch.randint(0, 3, (40,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def loader_run(group, stage: int, dtype: str, steps: int, save_at: int | None, load_dir: str | None,
               save_dir: str | None, extra: dict | None = None) -> dict:
    """Train DropNet from ``training_data`` (4 samples per rank per micro-batch, 2 micro-batches
    per step: an epoch of 40 samples is 2.5 steps at 2 ranks, so saves fall mid-epoch). With
    ``load_dir``, resume from it first; with ``save_at``, save after that many steps."""
    torch.manual_seed(7)
    model = DropNet()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "steps_per_print": 10_000, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": dict(WARMUP)},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"].update(initial_scale_power=30, loss_scale_window=2, hysteresis=1)
    cfg.update(extra or {})
    engine, _, loader, _ = zerodp.initialize(model=model, model_parameters=model.parameters(),
                                             config=cfg, training_data=_dataset(), process_group=group)
    torch.manual_seed(1000 + engine.dp_rank)  # dropout masks differ per rank
    if load_dir:
        engine.load_checkpoint(load_dir)
    it = iter(loader)
    losses = []
    while engine.global_steps < steps:
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        loss = engine(x, y)
        engine.backward(loss)
        before = engine.global_steps
        engine.step()
        losses.append(loss.item())
        if engine.global_steps == save_at and before != save_at:
            engine.save_checkpoint(save_dir)
    out = snapshot(engine)
    out.update(losses=losses, skipped=engine.skipped_steps, scale=engine.loss_scale)
    engine.destroy()
    return out


# -- failures -----------------------------------------------------------------------------------

class WideNet(ParityNet):
    """The parity model with a wider hidden layer: three parameters change shape."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(self.l1.in_features, self.l1.out_features + 1)
        self.l2 = nn.Linear(self.l2.in_features + 1, self.l2.out_features)


def load_error_task(group, stage: int, load_dir: str, tag=None, model: str = "parity",
                    optimizer: str = "AdamW", **load_kw):
    """Load and return the error message (None when the load worked)."""
    world = dist.get_world_size(group)
    torch.manual_seed(0)
    net = WideNet() if model == "wide" else build_model()
    cfg = config(stage, world)
    if optimizer != "AdamW":
        cfg["optimizer"] = {"type": optimizer, "params": {"lr": 0.1, "momentum": 0.9}}
        cfg.pop("scheduler")
    engine, *_ = zerodp.initialize(model=net, model_parameters=param_groups(net), config=cfg,
                                   process_group=group)
    before = gathered_params(engine)
    try:
        result = engine.load_checkpoint(load_dir, tag=tag, **load_kw)
    except zerodp.CheckpointError as e:
        after = gathered_params(engine)
        unchanged = all(torch.equal(before[n], after[n]) for n in before)
        return {"error": str(e), "unchanged": unchanged}
    finally:
        engine.destroy()
    return {"error": None, "result": result}


def save_error_task(group, save_dir: str, client_state) -> dict:
    engine = make_engine(group, 2)
    train_steps(engine, 0, 1)
    try:
        engine.save_checkpoint(save_dir, client_state=client_state)
    except zerodp.CheckpointError as e:
        return {"error": str(e)}
    return {"error": None}


# -- consolidation, 16-bit model files, asynchronous saves --------------------------------------

def save_16bit_task(group, stage: int, dtype: str, out_dir: str) -> dict:
    engine = make_engine(group, stage, dtype)
    train_steps(engine, 0, 1)
    engine.save_16bit_model(out_dir, "model.safetensors")
    engine.save_16bit_model(out_dir)  # DeepSpeed's default name: pytorch_model.bin (torch.save)
    out = gathered_params(engine)
    engine.destroy()
    return out


def hf_save_task(group, stage: int, save_dir: str) -> dict:
    """A tiny transformers GPT-2 trained 2 steps at ``stage``, then saved."""
    import hf_tasks
    rank = dist.get_rank(group)
    model = hf_tasks.build_model("gpt2")
    cfg = {"train_micro_batch_size_per_gpu": hf_tasks.MICRO, "gradient_accumulation_steps": 1,
           "steps_per_print": 10_000, "optimizer": {"type": "AdamW", "params": dict(hf_tasks.ADAMW)},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    engine, *_ = zerodp.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                   process_group=group)
    for step in range(2):
        ids = hf_tasks.batch(step, rank, 0)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(save_dir)
    out = gathered_params(engine)
    if rank == 0:
        model.config.save_pretrained(save_dir)
    engine.destroy()
    return out


def async_save_task(group, stage: int, save_dir: str, fail_rank: int | None = None) -> dict:
    """Save asynchronously at step 2 and keep training while it is written; with ``fail_rank``,
    that rank's write fails in the background."""
    engine = make_engine(group, stage, "fp32")
    train_steps(engine, 0, 1)
    engine.save_checkpoint(save_dir, tag="first")
    train_steps(engine, 1, 2)
    at_save = gathered_params(engine)
    if fail_rank is not None and engine.dp_rank == fail_rank:
        from zerodp.checkpoint import tensorfile
        original = tensorfile.TensorWriter.write

        def failing(self, name, parts):
            raise OSError(28, "No space left on device")
        tensorfile.TensorWriter.write = failing
    try:
        engine.save_checkpoint(save_dir, async_save=True)
        in_flight = engine._checkpointer.in_flight
        train_steps(engine, 2, 4)  # the parameters move on while the shards are written
        error = None
        try:
            engine.wait_for_checkpoint()
        except zerodp.CheckpointError as e:
            error = str(e)
    finally:
        if fail_rank is not None and engine.dp_rank == fail_rank:
            tensorfile.TensorWriter.write = original
    out = {"at_save": at_save, "after": gathered_params(engine), "error": error, "in_flight": in_flight}
    engine.destroy()
    return out


# -- what a load reads -----------------------------------------------------------------------------

def _mlp():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))


def mlp_engine(group, stage: int):
    model = _mlp()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000}}
    engine, *_ = zerodp.initialize(model=model, config=cfg, process_group=group)
    return engine


def bytes_read_task(group, save_dir: str, stage: int, save: bool) -> dict:
    """Save (with 4 KiB checksum blocks) or load the MLP; returns the bytes this rank read."""
    from zerodp.checkpoint import tensorfile
    engine = mlp_engine(group, stage)
    if save:
        x = torch.randn(2, 128)
        engine.backward(engine(x).square().mean())
        engine.step()
        block = tensorfile.BLOCK
        tensorfile.BLOCK = 4096
        try:
            engine.save_checkpoint(save_dir)
        finally:
            tensorfile.BLOCK = block
        out = {"read": 0}
    else:
        before = tensorfile.STATS["bytes_read"]
        engine.load_checkpoint(save_dir)
        out = {"read": tensorfile.STATS["bytes_read"] - before}
    engine.destroy()
    return out

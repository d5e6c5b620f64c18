"""Worker tasks (and their single-process references) for ``test_api.py``: the
DeepSpeed-style API surface of ``zerodp.initialize`` and ``ZeroEngine``.

A training run is described by a plain dict ``spec`` (picklable, so it travels to the
workers). ``train_task(group, spec)`` runs it through zerodp on every rank;
``reference(world, spec)`` runs the same optimizer / schedule on the whole global batch in
one process with plain torch. Keys of ``spec`` (defaults in ``DEFAULT_SPEC``):

* ``model``: ``"net"`` (two Linear layers and a side layer that only rank 0 uses, in the first
  micro-batch of even steps, so its gradient is absent on other ranks and in odd steps),
  ``"bias_only"`` (the same net with everything frozen except the 3-element output bias) or
  ``"scalar"`` (one 0-dim parameter).
* ``stage``, ``steps``, ``gas``, ``bucket`` (reduce_bucket_size), ``clip``, ``overlap``.
* ``opt``: ``"adamw"`` or ``"sgd"``; ``opt_mode``: ``"instance"`` (a torch optimizer built on
  the model's param groups is passed as ``optimizer=``), ``"callable"`` (``optimizer=`` a
  callable taking param groups) or ``"config"`` (the config's ``optimizer`` block).
* ``groups``: two param groups with different lr (True), the same with the second group's
  ``"params"`` a bare tensor instead of a list (``"bare"``, which torch optimizers accept), or
  the engine's default (False); with ``opt_mode="instance"``, ``"named"`` builds the optimizer
  on ``(name, param)`` pairs of the trainable parameters (torch >= 2.6 keeps ``param_names``).
* ``sched``: None, ``"lambda"`` (a torch LambdaLR on the optimizer instance, passed as
  ``lr_scheduler=``), ``"lambda_callable"`` (``lr_scheduler=`` a callable building that
  LambdaLR on the engine's optimizer) or ``"warmup"`` (the config's ``scheduler`` block, WarmupLR linear).
* ``no_sync``: run the backward of every micro-batch but the last of each step in ``no_sync()``.
* ``garbage_zero_grad``: before each step, run a backward on a junk batch (``"plain"``, or
  ``"no_sync"``: inside ``no_sync()``), then ``engine.zero_grad()``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp

IN, HID, OUT, MICRO = 5, 7, 3, 2

DEFAULT_SPEC = {
    "model": "net", "stage": 2, "steps": 3, "gas": 1, "bucket": 500_000_000, "clip": 0.0,
    "overlap": True, "opt": "adamw", "opt_mode": "config", "groups": True, "sched": None,
    "no_sync": False, "garbage_zero_grad": False,
}

ADAMW = {"lr": 0.02, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}
GROUP_LRS = (0.02, 0.05)  # weights, biases (only with spec["groups"])

# WarmupLR (linear) of the config scheduler block, and the same schedule written out.
WARMUP = {"warmup_min_lr": 0.001, "warmup_max_lr": [0.02, 0.04], "warmup_num_steps": 3,
          "warmup_type": "linear"}


def warmup_lrs(step: int) -> list[float]:
    """DeepSpeed's WarmupLR (linear) for the optimizer step ``step`` (0-based).

    The schedule starts at iteration -1 (``warmup_min_lr``) and advances one iteration
    after every optimizer step; ``lr(i) = min + (max - min) * i / W`` for ``0 <= i < W``,
    ``max`` afterwards, with ``W = max(2, warmup_num_steps)``.
    """
    it, w, lo = step - 1, max(2, WARMUP["warmup_num_steps"]), WARMUP["warmup_min_lr"]
    if it < 0:
        return [lo for _ in WARMUP["warmup_max_lr"]]
    frac = min(it / w, 1.0)
    return [lo + (hi - lo) * frac for hi in WARMUP["warmup_max_lr"]]


def lr_lambda(step: int) -> float:
    """The LambdaLR multiplier used by the ``"lambda"`` schedule (and its reference)."""
    return 1.0 / (1.0 + 0.5 * step)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(IN, HID)
        self.l2 = nn.Linear(HID, OUT)
        self.side = nn.Linear(OUT, OUT)

    def forward(self, x: torch.Tensor, use_side: bool = False) -> torch.Tensor:
        h = self.l2(torch.tanh(self.l1(x)))
        return h + self.side(h) if use_side else h


class Scalar(nn.Module):
    """One parameter with numel 1: at world 4 three ranks own only padding."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor, use_side: bool = False) -> torch.Tensor:
        return self.w * x[:, :OUT]


def build_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "net":
        return Net()
    if kind == "bias_only":
        model = Net()
        model.requires_grad_(False)
        model.l2.bias.requires_grad_(True)
        return model
    if kind == "scalar":
        return Scalar()
    raise ValueError(kind)


def param_groups(model: nn.Module, spec: dict) -> list[dict] | None:
    """Two groups (weights, biases) with their own lr, or None (engine default)."""
    if not spec["groups"] or spec["groups"] == "named":
        return None
    if spec["groups"] == "bare":  # torch's add_param_group wraps a bare tensor in a list
        rest = [p for n, p in model.named_parameters() if p.requires_grad and n != "l2.bias"]
        return [{"params": rest, "lr": GROUP_LRS[0]},
                {"params": model.l2.bias, "lr": GROUP_LRS[1], "weight_decay": 0.0}]
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    weights = [p for n, p in trainable if p.dim() >= 2]
    biases = [p for n, p in trainable if p.dim() < 2]
    return [{"params": weights, "lr": GROUP_LRS[0]},
            {"params": biases, "lr": GROUP_LRS[1], "weight_decay": 0.0}]


def make_optimizer(spec: dict, groups) -> torch.optim.Optimizer:
    """The torch optimizer of ``spec`` on ``groups`` (param groups, or a param list)."""
    if spec["opt"] == "adamw":
        return torch.optim.AdamW(groups, **ADAMW)
    if spec["opt"] == "sgd":
        return torch.optim.SGD(groups, **SGD)
    raise ValueError(spec["opt"])


def make_config(spec: dict, world: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": spec["gas"],
           "train_batch_size": MICRO * spec["gas"] * world, "gradient_clipping": spec["clip"],
           "steps_per_print": 10_000,
           "zero_optimization": {"stage": spec["stage"], "reduce_bucket_size": spec["bucket"],
                                 "overlap_comm": spec["overlap"]}}
    if spec["opt_mode"] == "config":
        params = ADAMW if spec["opt"] == "adamw" else SGD
        cfg["optimizer"] = {"type": "AdamW" if spec["opt"] == "adamw" else "SGD",
                            "params": {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}}
    if spec["sched"] == "warmup":
        cfg["scheduler"] = {"type": "WarmupLR", "params": dict(WARMUP)}
    return cfg


def batch(step: int, rank: int, micro: int, junk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro + (500_000 if junk else 0))
    x = torch.randn(MICRO, IN, generator=g) * (50.0 if junk else 1.0)
    y = torch.randn(MICRO, OUT, generator=g)
    return x, y


def use_side(step: int, rank: int, micro: int) -> bool:
    return rank == 0 and micro == 0 and step % 2 == 0


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, side: bool = False) -> torch.Tensor:
    return F.mse_loss(model(x, side), y)


def full_spec(spec: dict) -> dict:
    unknown = set(spec) - set(DEFAULT_SPEC)
    if unknown:
        raise KeyError(f"unknown spec keys {sorted(unknown)}")
    return {**DEFAULT_SPEC, **spec}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- the zerodp run -----------------------------------------------------------------------

def train_task(group, spec: dict) -> dict:
    """Train ``spec`` through zerodp on this rank; return params, norms, lrs and API facts."""
    spec = full_spec(spec)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    model = build_model(spec["model"])
    groups = param_groups(model, spec)
    kwargs = {}
    passed_opt = passed_sched = None
    if spec["opt_mode"] == "instance":
        if spec["groups"] == "named":
            on = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        else:
            on = groups if groups else [p for p in model.parameters() if p.requires_grad]
        passed_opt = kwargs["optimizer"] = make_optimizer(spec, on)
        if spec["sched"] == "lambda":
            passed_sched = kwargs["lr_scheduler"] = torch.optim.lr_scheduler.LambdaLR(passed_opt, lr_lambda)
    else:
        kwargs["model_parameters"] = groups
        if spec["sched"] == "lambda":
            raise ValueError('sched "lambda" needs opt_mode "instance"')
        if spec["opt_mode"] == "callable":
            if spec["opt"] != "sgd":
                raise ValueError("the callable form is written for SGD")
            kwargs["optimizer"] = lambda gs: torch.optim.SGD(gs, lr=SGD["lr"], momentum=SGD["momentum"],
                                                              weight_decay=SGD["weight_decay"])
    if spec["sched"] == "lambda_callable":
        kwargs["lr_scheduler"] = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda)
    engine, opt, loader, sched = zerodp.initialize(model=model, config=make_config(spec, world),
                                                   process_group=group, **kwargs)
    norm_before = engine.get_global_grad_norm()
    opt_numel = sum(p.numel() for g in opt.param_groups for p in g["params"])
    norms, lrs = [], []
    for step in range(spec["steps"]):
        if spec["garbage_zero_grad"]:
            x, y = batch(step, rank, 0, junk=True)
            with engine.no_sync() if spec["garbage_zero_grad"] == "no_sync" else contextlib.nullcontext():
                engine.backward(loss_of(engine, x, y, True))
            engine.zero_grad()
        lrs.append(list(engine.get_lr()))
        for m in range(spec["gas"]):
            x, y = batch(step, rank, m)
            loss = loss_of(engine, x, y, use_side(step, rank, m))
            if spec["no_sync"] and m < spec["gas"] - 1:
                with engine.no_sync():
                    engine.backward(loss)
            else:
                engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    lrs.append(list(engine.get_lr()))
    comm = engine.comm_stats()
    engine.destroy()
    return {"params": _params(engine.module), "norms": norms, "lrs": lrs, "comm": comm,
            "norm_before": norm_before, "opt_numel": opt_numel,
            "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "opt_is_passed": passed_opt is not None and opt is passed_opt,
            "sched_is_passed": passed_sched is not None and sched is passed_sched,
            "sched_type": type(sched).__name__, "sched_bound": sched is None or sched.optimizer is opt,
            "opt_type": type(opt).__name__, "loader_is_none": loader is None,
            "module_is_model": engine.module is model}


def train_many(group, specs: list[dict]) -> list[dict]:
    """Several ``train_task`` runs in one round trip."""
    return [train_task(group, s) for s in specs]


# -- the single-process reference -----------------------------------------------------------

def reference(world: int, spec: dict) -> dict:
    """The same training in one process with plain torch on the whole global batch."""
    spec = full_spec(spec)
    model = build_model(spec["model"])
    groups = param_groups(model, spec)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(spec, groups if groups else trainable)
    lambda_sched = spec["sched"] in ("lambda", "lambda_callable")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lambda_sched else None
    norms, lrs = [], []
    for step in range(spec["steps"]):
        if spec["sched"] == "warmup":
            for g, lr in zip(opt.param_groups, warmup_lrs(step)):
                g["lr"] = lr
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.zero_grad(set_to_none=True)
        losses = [loss_of(model, *batch(step, r, m), use_side(step, r, m))
                  for r in range(world) for m in range(spec["gas"])]
        (sum(losses) / len(losses)).backward()
        clip = spec["clip"] if spec["clip"] > 0 else float("inf")
        norms.append(torch.nn.utils.clip_grad_norm_(trainable, clip).item())
        opt.step()
        if sched is not None:
            sched.step()
    if spec["sched"] == "warmup":
        lrs.append(warmup_lrs(spec["steps"]))
    else:
        lrs.append([g["lr"] for g in opt.param_groups])
    return {"params": _params(model), "norms": norms, "lrs": lrs}


# -- API-behaviour tasks ----------------------------------------------------------------------

def _net_engine(group, stage: int, gas: int, **extra):
    spec = full_spec({"stage": stage, "gas": gas})
    model = build_model("net")
    cfg = make_config(spec, dist.get_world_size(group))
    return zerodp.initialize(model=model, model_parameters=param_groups(model, spec), config=cfg,
                             process_group=group, **extra)


def boundary_task(group, stage: int, gas: int, micro_steps: int) -> list[dict]:
    """Per micro-step: the accumulation-boundary flag and counters before step(), and
    whether step() changed the parameters."""
    rank = dist.get_rank(group)
    engine, _, _, _ = _net_engine(group, stage, gas)
    out = []
    for i in range(micro_steps):
        x, y = batch(i // gas, rank, i % gas)
        before = {"boundary": engine.is_gradient_accumulation_boundary(),
                  "global_steps": engine.global_steps, "micro_steps": engine.micro_steps}
        engine.backward(loss_of(engine, x, y))
        params_before = _params(engine.module)
        engine.step()
        changed = any(not torch.equal(params_before[n], p) for n, p in engine.module.named_parameters())
        out.append({**before, "changed": changed, "global_steps_after": engine.global_steps})
    engine.destroy()
    return out


def no_sync_boundary_error_task(group, stages: list[int]) -> list[str]:
    """Run the boundary micro-batch's backward inside no_sync(), then step(): return the
    error message per stage (or "no error")."""
    rank = dist.get_rank(group)
    out = []
    for stage in stages:
        engine, _, _, _ = _net_engine(group, stage, gas=3)
        for m in range(3):
            x, y = batch(0, rank, m)
            with engine.no_sync():
                engine.backward(loss_of(engine, x, y))
            try:
                engine.step()
            except RuntimeError as e:
                out.append(f"micro {m}: RuntimeError: {e}")
                break
        else:
            out.append("no error")
        engine.destroy()
    return out


def dataloader_task(group, n_samples: int, config: dict) -> dict:
    """initialize(training_data=TensorDataset): the batches this rank's loader yields."""
    xs = torch.arange(n_samples, dtype=torch.float32).unsqueeze(1)
    ys = torch.arange(n_samples) * 10
    dataset = torch.utils.data.TensorDataset(xs, ys)
    model = nn.Linear(1, 1)
    engine, _, loader, _ = zerodp.initialize(model=model, config=config, training_data=dataset,
                                             process_group=group)
    batches = [(x.squeeze(1).long().tolist(), y.tolist()) for x, y in loader]
    second_epoch = [(x.squeeze(1).long().tolist(), y.tolist()) for x, y in loader]
    engine.destroy()
    return {"batches": batches, "second_epoch": second_epoch, "len": len(loader),
            "micro": engine.train_micro_batch_size_per_gpu()}


class MyLamb(torch.optim.SGD):
    """A LAMB-named optimizer class (its update would really be SGD's)."""


def _error_cases():
    """(name, thunk) pairs; each thunk calls initialize with one mistake."""
    adamw_cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    plain_cfg = {"train_micro_batch_size_per_gpu": 2}

    def both_optimizers(group):
        model = build_model("net")
        zerodp.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                          config=adamw_cfg, process_group=group)

    def both_optimizers_callable(group):
        model = build_model("net")
        zerodp.initialize(model=model, optimizer=lambda gs: torch.optim.SGD(gs, lr=0.1),
                          config=adamw_cfg, process_group=group)

    def optimizer_with_state(group):
        model = build_model("net")
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        loss_of(model, *batch(0, 0, 0)).backward()
        opt.step()
        opt.zero_grad()
        zerodp.initialize(model=model, optimizer=opt, config=plain_cfg, process_group=group)

    def lamb_instance(group):
        model = build_model("net")
        zerodp.initialize(model=model, optimizer=MyLamb(model.parameters(), lr=0.1), config=plain_cfg,
                          process_group=group)

    def lamb_callable(group):
        model = build_model("net")
        zerodp.initialize(model=model, optimizer=lambda gs: MyLamb(gs, lr=0.1), config=plain_cfg,
                          process_group=group)

    def lamb_config(group):
        model = build_model("net")
        zerodp.initialize(model=model, config={**plain_cfg, "optimizer": {"type": "Lamb", "params": {"lr": 0.1}}},
                          process_group=group)

    def bad_stage(group):
        model = build_model("net")
        zerodp.initialize(model=model, config={**adamw_cfg, "zero_optimization": {"stage": 4}},
                          process_group=group)

    def batch_not_divisible(group):
        model = build_model("net")
        zerodp.initialize(model=model, config={"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2,
                                               "optimizer": adamw_cfg["optimizer"]}, process_group=group)

    def batch_inconsistent(group):
        model = build_model("net")
        zerodp.initialize(model=model, config={"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2,
                                               "gradient_accumulation_steps": 2,
                                               "optimizer": adamw_cfg["optimizer"]}, process_group=group)

    def foreign_tensor(group):
        model = build_model("net")
        stranger = nn.Parameter(torch.zeros(4, 9))
        zerodp.initialize(model=model, model_parameters=[{"params": [model.l1.weight, stranger]}],
                          config=adamw_cfg, process_group=group)

    def duplicate_param(group):
        model = build_model("net")
        groups = [{"params": [model.l1.weight, model.l2.bias]},
                  {"params": [model.l2.weight, model.l2.bias], "lr": 0.1}]
        zerodp.initialize(model=model, model_parameters=groups, config=adamw_cfg, process_group=group)

    def scheduler_other_optimizer(group):
        model = build_model("net")
        other = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
        zerodp.initialize(model=model, config=adamw_cfg, process_group=group,
                          lr_scheduler=torch.optim.lr_scheduler.LambdaLR(other, lr_lambda))

    return [(f.__name__, f) for f in (
        both_optimizers, both_optimizers_callable, optimizer_with_state, lamb_instance, lamb_callable,
        lamb_config, bad_stage, batch_not_divisible, batch_inconsistent, foreign_tensor, duplicate_param,
        scheduler_other_optimizer)]


def named_parameters_task(group) -> tuple[str, str]:
    """model_parameters=model.named_parameters() (torch optimizers accept (name, param)
    pairs): trains, or fails with a clear error. Returns (exception class or "ok", message)."""
    model = build_model("net")
    try:
        engine, _, _, _ = zerodp.initialize(
            model=model, model_parameters=model.named_parameters(), process_group=group,
            config={"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e)
    x, y = batch(0, dist.get_rank(group), 0)
    engine.backward(loss_of(engine, x, y))
    engine.step()
    engine.destroy()
    return "ok", ""


def error_task(group) -> dict[str, tuple[str, str]]:
    """Every initialize mistake of ``_error_cases``: exception class name and message."""
    out = {}
    for name, thunk in _error_cases():
        try:
            thunk(group)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = (type(e).__name__, str(e))
        else:
            out[name] = ("no error", "")
    return out


def zero_grad_and_modes_task(group) -> dict:
    """engine.module identity, train()/eval() propagation to the module and a dropout layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HID), nn.Dropout(0.5), nn.Linear(HID, OUT))
    engine, _, _, _ = zerodp.initialize(model=model, config={"train_micro_batch_size_per_gpu": MICRO,
                                                             "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
                                        process_group=group)
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(1))
    out = {"module_is_model": engine.module is model, "initially_training": model.training}
    engine.eval()
    out["eval_flags"] = [model.training, model[1].training, engine.training]
    out["eval_deterministic"] = torch.equal(engine(x), engine(x)) and torch.equal(engine(x), model(x))
    engine.train()
    out["train_flags"] = [model.training, model[1].training, engine.training]
    torch.manual_seed(5)
    out["train_dropout_active"] = not torch.equal(engine(x), engine(x))
    model.eval()  # and the other way round: the engine's forward is the module's
    out["module_eval_used"] = torch.equal(engine(x), engine(x))
    engine.destroy()
    return out

"""Worker tasks for DeepSpeed's parameter-access functions (``zerodp.utils.safe_get_full_grad`` and its
family) on the parity model, and the single-process pieces they are compared with."""
from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
from parity_model import ADAMW, batch, build_model, make_config, on, param_groups, use_branch
from precision_tasks import gathered_masters, precision_config

import zerodp
from zerodp import utils

PROBE = (9, 0, 0)  # the batch every rank's forward computes after a parameter is set


def reference_pieces(world: int, branch_on_all_ranks: bool) -> dict:
    """One process, torch's AdamW on the global batch: step 0, then step 1's averaged gradient,
    the parameters before and after step 1 and AdamW's states after it (by parameter name)."""
    model = build_model()
    opt = torch.optim.AdamW(param_groups(model), **{k: tuple(v) if isinstance(v, list) else v
                                                     for k, v in ADAMW.items()})
    names = {p: n for n, p in model.named_parameters() if p.requires_grad}
    out = {}
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        losses = [model(*batch(step, r, 0), use_branch(step, r, 0, branch_on_all_ranks)) for r in range(world)]
        (sum(losses) / len(losses)).backward()
        if step == 1:
            out["before"] = {n: p.detach().clone() for p, n in names.items()}
            out["grad"] = {n: p.grad.clone() for p, n in names.items() if p.grad is not None}
        opt.step()
    out["after"] = {n: p.detach().clone() for p, n in names.items()}
    out["all_after"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["exp_avg"] = {names[p]: st["exp_avg"].clone() for p, st in opt.state.items()}
    out["exp_avg_sq"] = {names[p]: st["exp_avg_sq"].clone() for p, st in opt.state.items()}
    return out


def probe_loss(params: dict[str, torch.Tensor], changed: dict[str, torch.Tensor]) -> float:
    """The parity model's loss on ``PROBE`` with ``params``, some of them replaced by ``changed``."""
    model = build_model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(changed.get(n, params[n]))
    return model(*batch(*PROBE), False).item()


def _engine(group, stage: int, offload: str | None):
    model = build_model()
    config = make_config(stage, dist.get_world_size(group))
    if offload == "cpu":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    elif offload == "nvme":
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": tempfile.mkdtemp()}
    engine, _, _, _ = zerodp.initialize(model=model, model_parameters=param_groups(model), config=config,
                                        process_group=group)
    return engine


def _cpu(t):
    return None if t is None else t.detach().to("cpu", copy=True)


def access_task(group, stage: int, offload: str | None = None) -> dict:
    """Two steps of the parity model; after step 1's backward (before its step) every trainable
    parameter's full gradient and fp32 value, after the step its AdamW states; the local variants
    checked against the full ones; then a parameter set and the loss of the next forward."""
    rank = dist.get_rank(group)
    engine = _engine(group, stage, offload)
    named = list(engine.module.named_parameters())
    trained = [(n, p) for n, p in named if p.requires_grad]
    out: dict = {"none_before": utils.safe_get_full_grad(trained[0][1]) is None}
    for step in range(2):
        loss = engine(*on(engine.device, batch(step, rank, 0)), use_branch(step, rank, 0, stage == 3))
        engine.backward(loss)
        if step == 1:
            out["grad"] = {n: _cpu(utils.safe_get_full_grad(p)) for n, p in trained}
            out["before"] = {n: _cpu(utils.safe_get_full_fp32_param(p)) for n, p in trained}
            out["local_grad"] = {n: _cpu(utils.safe_get_local_grad(p)) for n, p in trained}
        engine.step()
    out["none_after"] = utils.safe_get_full_grad(trained[0][1]) is None
    frozen = [p for n, p in named if not p.requires_grad]
    out["frozen"] = [utils.safe_get_full_grad(frozen[0]), utils.safe_get_full_fp32_param(frozen[0]),
                     utils.safe_get_full_optimizer_state(frozen[0], "exp_avg")]
    out["after"] = {n: _cpu(utils.safe_get_full_fp32_param(p)) for n, p in trained}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = {n: _cpu(utils.safe_get_full_optimizer_state(p, key)) for n, p in trained}
        out["local_" + key] = {n: _cpu(utils.safe_get_local_optimizer_state(p, key)) for n, p in trained}
    out["local_param"] = {n: _cpu(utils.safe_get_local_fp32_param(p)) for n, p in trained}
    out["pieces"] = _pieces(engine)
    out["gathered_masters"] = gathered_masters(engine)

    # set one parameter whole (the same value on every rank): the next forward computes with it
    name, p = trained[1]
    shape = out["after"][name].shape
    new = torch.linspace(-1, 1, shape.numel()).view(shape)
    utils.safe_set_full_fp32_param(p, new.to(engine.device))
    out["set_name"], out["set_value"] = name, new
    out["after_set"] = _cpu(utils.safe_get_full_fp32_param(p))
    out["probe_loss"] = engine(*on(engine.device, batch(*PROBE)), False).item()

    # the optimizer state, whole and by this rank's part
    utils.safe_set_full_optimizer_state(p, torch.full_like(new, 0.5).to(engine.device), "exp_avg")
    out["state_after_set"] = _cpu(utils.safe_get_full_optimizer_state(p, "exp_avg"))
    local = utils.safe_get_local_optimizer_state(p, "exp_avg_sq")
    utils.safe_set_local_optimizer_state(p, torch.full_like(local, float(rank + 1)), "exp_avg_sq")
    out["local_state_set"] = _cpu(utils.safe_get_full_optimizer_state(p, "exp_avg_sq"))
    local = utils.safe_get_local_fp32_param(p)
    utils.safe_set_local_fp32_param(p, torch.full_like(local, float(rank + 1)))
    out["local_param_set"] = _cpu(utils.safe_get_full_fp32_param(p))
    with zerodp.GatheredParameters([p]):
        out["model_param_after_local_set"] = _cpu(p)
    try:
        utils.safe_get_full_optimizer_state(p, "step")
        out["scalar_state"] = "no error"
    except ValueError as e:
        out["scalar_state"] = str(e)
    engine.destroy()
    return out


def _pieces(engine) -> dict[str, tuple[int, int]]:
    """Per parameter name: which elements of the flattened parameter this rank holds, [lo, hi)."""
    out = {}
    for g in engine.trainable:
        for pc in g.pieces:
            out[g.slots[pc.slot].name] = (pc.param_lo, pc.param_lo + pc.shard_hi - pc.shard_lo)
    return out


def bf16_set_task(group, stage: int) -> dict:
    """bf16: setting a parameter's fp32 master sets the 16-bit parameter the model computes with too."""
    rank = dist.get_rank(group)
    model = build_model()
    engine, _, _, _ = zerodp.initialize(model=model, model_parameters=param_groups(model), process_group=group,
                                        config=precision_config(stage, dist.get_world_size(group), "bf16"))
    loss = engine(*on(engine.device, batch(0, rank, 0)), use_branch(0, rank, 0, stage == 3))
    engine.backward(loss)
    grad = utils.safe_get_full_grad(engine.module.l1.weight)
    engine.step()
    p = engine.module.l1.weight
    new = torch.linspace(-1, 1, 42).view(7, 6) / 3  # not representable in bf16
    utils.safe_set_full_fp32_param(p, new)
    with zerodp.GatheredParameters([p]):
        param16 = _cpu(p)
    out = {"grad_dtype": grad.dtype, "master": gathered_masters(engine)["l1.weight"],
           "fp32": _cpu(utils.safe_get_full_fp32_param(p)), "param16": param16, "new": new}
    engine.destroy()
    return out

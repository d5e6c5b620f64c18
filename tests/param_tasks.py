"""Worker tasks for ``test_stage3_params.py``: parameters built in ``zero.Init`` meeting code that
was written against DeepSpeed's (new modules placed by their neighbours' device, parameters added
after ``Init``, values lost on the way)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp

LR, STEPS = 0.1, 3


def _base(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def _adapter(seed: int) -> nn.Module:
    """A module made after ``Init`` with values its creator chose (seeded by rank in the workers:
    rank 0's must win, as when ``Init`` shards a parameter)."""
    torch.manual_seed(seed)
    return nn.Linear(8, 4)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(2, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.mse_loss(out, torch.ones_like(out))


def reference(world: int) -> dict:
    """One process, plain SGD on the whole global batch, from rank 0's adapter."""
    model = nn.Sequential(*_base(), _adapter(1000))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        sum(_loss(model, _batch(step, r)) for r in range(world)).div(world).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def added_after_init(group, stage: int) -> dict:
    """Build the base in ``zero.Init``, then add a layer the way peft places an adapter: made with
    values, then moved to the device (and dtype) of a base weight. Train it through the engine."""
    rank = dist.get_rank(group)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    with zerodp.zero.Init(data_parallel_group=group):
        base = _base()
    w = base[0].weight
    seen = {"device": str(w.device), "shape": tuple(w.shape), "ds_shape": tuple(w.ds_shape)}
    adapter = _adapter(1000 + rank).to(w.device, dtype=w.dtype)
    seen["adapter_device"] = str(adapter.weight.device)
    model = nn.Sequential(*base, adapter)
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, process_group=group)
    for step in range(STEPS):
        engine.backward(_loss(engine, _batch(step, rank)))
        engine.step()
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        seen["params"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return seen


def lost_values(group, where: str) -> str:
    """A parameter with no values behind it, in a model whose others have values: ``initialize`` (or
    ``GatheredParameters``) must say which, not invent values."""
    with zerodp.zero.Init(data_parallel_group=group):
        base = _base()
    adapter = _adapter(0).to("meta")  # what peft did when the base reported the meta device
    model = nn.Sequential(*base, adapter)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": 3}}
    try:
        if where == "initialize":
            zerodp.initialize(model=model, config=cfg, process_group=group)
        else:
            with zerodp.GatheredParameters(list(model.parameters()), modifier_rank=0):
                pass
    except ValueError as e:
        return str(e)
    return "no error"


def outside_a_gather(group) -> dict:
    """What code outside the engine sees of a stage-3 parameter after ``initialize``, outside and
    inside ``GatheredParameters``, before and after a training step."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1}}
    engine, _, _, _ = zerodp.initialize(model=_base(), config=cfg, process_group=group)
    w = engine.module[0].weight
    from zerodp.runtime.zero.partition_parameters import ZeroParamStatus

    def looks() -> dict:
        return {"shape": tuple(w.shape), "numel": w.numel(), "device": str(w.device), "dtype": str(w.dtype),
                "ds_shape": tuple(w.ds_shape), "ds_numel": w.ds_numel,
                "available": w.ds_status == ZeroParamStatus.AVAILABLE}
    seen = {"at_rest": looks()}
    try:
        w.sum()  # a read outside a gather: an empty tensor's sum, never freed memory
        seen["read"] = "ok"
    except RuntimeError as e:
        seen["read"] = str(e)
    seen["state_dict_shapes"] = sorted({tuple(t.shape) for t in engine.module.state_dict().values()})
    # DeepSpeed's partition_numel(): this rank's elements of each parameter (Lightning's summary sums them)
    seen["partition_numel"] = {n: (p.partition_numel(), p.ds_numel) for n, p in engine.module.named_parameters()}
    with zerodp.GatheredParameters([w]):
        seen["gathered"] = looks()
    engine.backward(_loss(engine, _batch(0, dist.get_rank(group))))
    engine.step()
    seen["after_step"] = looks()
    engine.destroy()
    return seen


class Repacks(nn.Module):
    """A layer that rewrites its frozen weight's data in its first forward, as bitsandbytes' 4-bit
    layer does in eval mode on a CPU with AVX512-BF16 (``weight.data = repacked`` and a mark on the
    side): the rows reversed and the bytes read as int32, read back that way from then on. Its
    adapter trains."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.adapter = nn.Linear(8, 8)
        self.repacked = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.repacked:
            self.weight.data = self.weight.data.flip(0).contiguous().view(torch.int32)
            self.repacked = True
        return F.linear(x, self.weight.view(torch.float32).flip(0)) + self.adapter(x)


def _repacking(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), Repacks(), nn.Tanh(), Repacks())


def repacking_reference(world: int) -> dict:
    model = _repacking()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(_loss(model, _batch(step, r)) for r in range(world)).div(world)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": [m.weight.detach().clone() for m in model if isinstance(m, Repacks)]}


def repacking_in_engine(group, stage: int, offload: str = "none") -> dict:
    """``_repacking`` trained through the engine: the data its layers assign in the first forward must
    be what later forwards (after a release and a gather at stage 3) and a checkpoint see."""
    rank = dist.get_rank(group)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1,
                                 "offload_param": {"device": offload}, "offload_optimizer": {"device": offload}}}
    model = _repacking()
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = zerodp.initialize(model=model, model_parameters=trained, config=cfg, process_group=group)
    losses = []
    for step in range(STEPS):
        loss = _loss(engine, _batch(step, rank))
        engine.backward(loss)
        engine.step()
        both = loss.detach().clone()
        dist.all_reduce(both, group=group)
        losses.append(both.item() / dist.get_world_size(group))
    repackers = [m for m in model if isinstance(m, Repacks)]
    with zerodp.GatheredParameters([m.weight for m in repackers]):
        weights = [m.weight.detach().clone() for m in repackers]
    engine.destroy()
    return {"losses": losses, "weights": weights}


def assign_with_modifier(group, stage: int) -> dict:
    """``p.data = new`` (a new tensor, as PEFT's safe merge assigns) inside
    ``GatheredParameters(modifier_rank=0)``: rank 0's new values reach every rank and the optimizer,
    as an edit in place does."""
    rank = dist.get_rank(group)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    engine, _, _, _ = zerodp.initialize(model=_base(), config=cfg, process_group=group)
    w = engine.module[0].weight
    with zerodp.GatheredParameters([w], modifier_rank=0):
        w.data = torch.full_like(w.data, 0.5 if rank == 0 else -1.0)
    engine.backward(_loss(engine, _batch(0, rank)))
    engine.step()
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return params


def assign_reference(world: int) -> dict:
    model = _base()
    with torch.no_grad():
        model[0].weight.fill_(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sum(_loss(model, _batch(0, r)) for r in range(world)).div(world).backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}

"""Worker tasks for ``test_moe.py``: a mixture-of-experts model whose experts are separate modules
(as transformers v4 and trust-remote-code models write them). Each rank routes its own tokens, so
ranks run different experts in the same step; with 2 tokens per rank and 6 experts, top-1 routing
runs at most 2 and top-2 at most 4 of them, so every rank leaves experts idle."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp

D, E, TOKENS, STEPS, LR = 8, 6, 2, 3, 0.05


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class MoEBlock(nn.Module):
    """Top-k routing over separate expert modules; returns the output and an auxiliary loss (two
    tensors whose backward both reach the block, as Mixtral's router logits do)."""

    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.used: list[list[int]] = []  # the experts each call ran

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        weight, chosen = probs.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        ran = []
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue  # an idle expert is not called at all on this rank
            ran.append(e)
            out = out.index_add(0, rows, weight[rows, slot, None] * expert(x[rows]))
        self.used.append(ran)
        return out, probs.pow(2).mean()


class Layer(nn.Module):
    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.moe = MoEBlock(top_k)

    def forward(self, h):
        h = h + self.down(torch.tanh(self.up(self.norm(h))))
        out, aux = self.moe(h)
        return h + out, aux


class MoENet(nn.Module):
    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.inp = nn.Linear(6, D)
        self.blocks = nn.ModuleList(Layer(top_k) for _ in range(2))
        self.head = nn.Linear(D, 3)

    def forward(self, x, y):
        h, aux = self.inp(x), 0.0
        for block in self.blocks:
            h, a = block(h)
            aux = aux + a
        return F.mse_loss(self.head(h), y) + 0.1 * aux


def build(top_k: int) -> MoENet:
    torch.manual_seed(0)
    return MoENet(top_k)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(TOKENS, 6, generator=g) * 2, torch.randn(TOKENS, 3, generator=g)


def reference(top_k: int, world: int) -> dict:
    """One process, SGD with momentum, the mean of every rank's loss (experts no rank ran get no
    gradient and no update, as unsharded PyTorch skips them)."""
    model = build(top_k)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        (sum(model(*batch(step, r)) for r in range(world)) / world).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def config(stage: int, declare: str) -> dict:
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 1, "stage3_prefetch_bucket_size": 0}
    if declare == "classes":
        zero["leaf_module"] = {"classes": ["MoEBlock"]}
    elif declare == "qualified":
        zero["leaf_module"] = {"classes": [f"{__name__}.MoEBlock"]}
    elif declare == "names":
        zero["leaf_module"] = {"names": ["blocks.0.moe", "blocks.1.moe"]}
    elif declare == "suffixes":
        zero["leaf_module"] = {"name_suffixes": "moe"}  # a bare string, as DeepSpeed accepts it
    elif declare == "granularity":
        zero["stage3_module_granularity_threshold"] = 50
    return {"train_micro_batch_size_per_gpu": TOKENS, "gradient_clipping": 0.0, "steps_per_print": 10**9,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}, "zero_optimization": zero}


def train(group, stage: int, top_k: int, declare: str) -> dict:
    """Train through the engine with the leaves declared one way (``api``, ``by_name``,
    ``by_suffix``: zerodp.utils before initialize; ``classes``, ``qualified``, ``names``,
    ``suffixes``, ``granularity``: the config; ``none``). Returns the trained parameters, the
    experts each rank ran, and the leaves; or the error text."""
    from zerodp import utils
    rank = dist.get_rank(group)
    model = build(top_k)
    if declare == "api":
        utils.set_z3_leaf_modules(model, [MoEBlock])
    elif declare == "by_name":
        utils.set_z3_leaf_modules_by_name(model, ["blocks.0.moe", "blocks.1.moe"])
    elif declare == "by_suffix":
        utils.set_z3_leaf_modules_by_suffix(model, ["moe"])
    try:
        engine, _, _, _ = zerodp.initialize(model=model, config=config(stage, declare), process_group=group)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}"}
    names = {id(m): n for n, m in model.named_modules()}
    leaves = sorted(names[id(m)] for m in utils.get_z3_leaf_modules(model))
    leaf_params = sorted(n for n, p in model.named_parameters() if utils.z3_leaf_parameter(p))
    try:
        for step in range(STEPS):
            engine.backward(engine(*batch(step, rank)))
            engine.step()
    except RuntimeError as e:
        engine.destroy()
        return {"error": str(e)}
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    used = [b.moe.used for b in model.blocks]
    engine.destroy()
    return {"params": params, "used": used, "leaves": leaves, "leaf_params": leaf_params}

"""A tiny model with every awkward feature the engine must handle, its data, and the
single-process reference that parity tests compare against.

Features: an embedding tied to the output layer, sizes that do not divide the world
size, two param groups with their own lr and weight decay, a frozen layer, and a branch
whose parameters are used only on rank 0 and only in some steps (so in other steps no
rank produces a gradient for them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import zerodp

VOCAB, DIM, HIDDEN, SEQ, MICRO = 11, 6, 7, 5, 2


class ParityNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.l1 = nn.Linear(DIM, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.branch = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.l2(torch.tanh(self.l1(h)))
        h = self.frozen(h)
        if use_branch:
            h = h + self.branch(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def build_model(seed: int = 0) -> ParityNet:
    torch.manual_seed(seed)
    return ParityNet()


def param_groups(model: nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.01}]


def batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return x, y


def use_branch(step: int, rank: int, micro: int, same_on_all_ranks: bool = False) -> bool:
    """Rank 0 only, in some steps; or every rank in those steps (stage 3 needs every rank to
    run the same modules)."""
    return (same_on_all_ranks or rank == 0) and step % 3 == 1


ADAMW = {"lr": 0.02, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}
OPTIMIZERS = {"AdamW": (torch.optim.AdamW, ADAMW), "SGD": (torch.optim.SGD, SGD)}


def make_config(stage: int, world: int, gas: int = 1, clip: float = 0.0, bucket: int = 500_000_000,
                overlap: bool = True, optimizer: str = "AdamW", reduce_scatter: bool = True) -> dict:
    return {"train_batch_size": MICRO * gas * world, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": clip, "steps_per_print": 10_000,
            "optimizer": {"type": optimizer, "params": dict(OPTIMIZERS[optimizer][1])},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "reduce_scatter": reduce_scatter,
                                  "stage3_param_persistence_threshold": 1,
                                  "overlap_comm": overlap}}


def reference(world: int, steps: int, gas: int = 1, clip: float = 0.0, optimizer: str = "AdamW",
              branch_on_all_ranks: bool = False, device: str | torch.device = "cpu"):
    """One process, the torch optimizer, the whole global batch of every step, on ``device``.

    Returns the parameters (on the CPU) and the global gradient norm of every step (before clipping).
    """
    model = build_model().to(device)
    groups = param_groups(model)
    cls, hyper = OPTIMIZERS[optimizer]
    hyper = {k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()}
    opt = cls(groups, **hyper)
    params = [p for g in groups for p in g["params"]]
    norms = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        losses = [model(*on(device, batch(step, r, m)), use_branch(step, r, m, branch_on_all_ranks))
                  for r in range(world) for m in range(gas)]
        (sum(losses) / len(losses)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")).item())
        opt.step()
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}, norms


def on(device, tensors):
    """``tensors`` moved to ``device`` (the engine's, which does not move a forward's inputs)."""
    return tuple(t.to(device) for t in tensors)


def train_engine(group, stage: int, steps: int, gas: int = 1, clip: float = 0.0,
                 bucket: int = 500_000_000, overlap: bool = True, optimizer: str = "AdamW",
                 reduce_scatter: bool = True, zero: dict | None = None) -> dict:
    """Worker task: the same training through zerodp (``zero``: more ``zero_optimization`` keys);
    returns params and engine facts."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    model = build_model()
    config = make_config(stage, world, gas, clip, bucket, overlap, optimizer, reduce_scatter)
    config["zero_optimization"].update(zero or {})
    engine, _, _, _ = zerodp.initialize(model=model, model_parameters=param_groups(model), config=config,
                                        process_group=group)
    norms = []
    for step in range(steps):
        for m in range(gas):
            loss = engine(*on(engine.device, batch(step, rank, m)), use_branch(step, rank, m, stage == 3))
            engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    engine.destroy()
    return {"params": gathered_params(engine),
            "norms": norms, "global_steps": engine.global_steps, "comm": engine.comm_stats(),
            "groups": len(engine.flat_groups)}


def gathered_params(engine) -> dict[str, torch.Tensor]:
    """Full copies of every parameter on the CPU (gathered first at stage 3)."""
    params = list(engine.module.parameters())
    with zerodp.GatheredParameters(params):
        return {n: p.detach().to("cpu", copy=True) for n, p in engine.module.named_parameters()}

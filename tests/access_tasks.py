"""Worker tasks for ``test_access.py``: models whose modules read a child's parameter without calling
the child, at stage 3 with every module a unit of its own, against the same model in one process.

* ``encoder``: two ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention`` reads
  ``out_proj.weight`` in its forward; in eval mode the layer's fast path reads every child's
  parameters from its own forward);
* ``decoder``: an ``nn.TransformerDecoderLayer`` over a memory made by a linear layer;
* ``vit``: a small vision transformer laid out as torchvision's (``conv_proj``, ``class_token``,
  ``encoder.pos_embedding``, encoder blocks of ``ln_1``, ``self_attention`` (an
  ``nn.MultiheadAttention``), ``ln_2``, ``mlp``; ``heads``);
* ``custom``: an attention written as many are, ``F.linear(x, self.qkv.weight, self.qkv.bias)``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp

# SGD: Adam's normalization turns fp32 rounding in gradients that are zero in exact arithmetic (an
# attention's key bias) into updates of lr's size, at every stage and in DDP alike (measured: 5e-3)
SGD = {"lr": 0.1, "momentum": 0.9}
STEPS = 3


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.self_attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(self, tokens: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, tokens, dim).normal_(std=0.02))
        self.layers = nn.Sequential(*[EncoderBlock(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)

    def forward(self, x):
        return self.ln(self.layers(x + self.pos_embedding))


class VisionTransformer(nn.Module):
    """torchvision's ``VisionTransformer`` in small: 16x16 images, 8x8 patches, 4 classes."""

    def __init__(self, image: int = 16, patch: int = 8, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.patch = patch
        self.conv_proj = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.encoder = Encoder((image // patch) ** 2 + 1, dim, heads, layers)
        self.heads = nn.Sequential(nn.Linear(dim, 4))

    def forward(self, images):
        x = self.conv_proj(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


class CustomAttention(nn.Module):
    """Self-attention whose forward reads its children's parameters, never calling them."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = F.linear(x, self.qkv.weight, self.qkv.bias).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        return x + F.linear(y, self.proj.weight, self.proj.bias)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.memory = nn.Linear(32, 32)
        self.layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.layer(x, self.memory(x))


class KeepsAList(nn.Module):
    """Reaches a child's weight through a plain list: a read the engine cannot notice."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)
        self.out = nn.Linear(6, 1)
        self.kept = [self.inner.weight]

    def forward(self, x):
        return self.out(torch.tanh(x @ self.kept[0])).pow(2).mean()


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "encoder":
        return nn.Sequential(*[nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
                               for _ in range(2)])
    if kind == "decoder":
        return Decoder()
    if kind == "vit":
        return VisionTransformer()
    if kind == "custom":
        return nn.Sequential(CustomAttention(), nn.LayerNorm(32), CustomAttention())
    raise ValueError(kind)


def batch(kind: str, step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    if kind == "vit":
        return torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 4, (2,), generator=g)
    return torch.randn(2, 5, 32, generator=g), None


def loss_of(kind: str, model: nn.Module, inputs, labels) -> torch.Tensor:
    out = model(inputs)
    return F.cross_entropy(out, labels) if kind == "vit" else out.pow(2).mean()


def reference(kind: str, world: int) -> dict:
    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(loss_of(kind, model, *batch(kind, step, r)) for r in range(world)) / world
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        evaluated = loss_of(kind, model, *batch(kind, 99, 0)).item()
    return {"losses": losses, "eval": evaluated, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def config(prefetch: int, stage: int = 3) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 0.0,  # as the reference
            "optimizer": {"type": "SGD", "params": SGD},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": prefetch}}


def train(group, kind: str, prefetch: int = 0, stage: int = 3) -> dict:
    """``kind`` trained 3 steps at stage 3 (every module with parameters a unit), then evaluated in
    eval mode without gradients; the losses, the evaluation and the parameters (gathered)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model = build(kind)
    engine, *_ = zerodp.initialize(model=model, config=config(prefetch, stage), process_group=group)
    losses = []
    for step in range(STEPS):
        loss = loss_of(kind, engine, *batch(kind, step, rank))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        losses.append(mean.item() / world)
    engine.eval()
    with torch.no_grad():
        evaluated = loss_of(kind, engine, *batch(kind, 99, 0)).item()
    with zerodp.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {"losses": losses, "eval": evaluated, "params": params,
           "gathered_after": engine.memory_breakdown()["gathered_parameters"]}
    engine.destroy()
    return out


def unreachable(group) -> str:
    """The error a forward that reaches a released parameter through a list raises."""
    engine, *_ = zerodp.initialize(model=KeepsAList(), config=config(0), process_group=group)
    try:
        engine(torch.randn(4, 6))
    except RuntimeError as e:
        return str(e)
    finally:
        engine.destroy()
    return "no error"

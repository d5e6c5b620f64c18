"""A small byte-level GPT language model and a text corpus that exists everywhere.

The model is a compact decoder-only transformer (pre-LayerNorm blocks, causal
self-attention via :func:`torch.nn.functional.scaled_dot_product_attention`,
GELU MLP, tied input/output embeddings).  The corpus is the Python standard
library's own source code, read as raw bytes, so examples and benchmarks need
no downloads.
"""

from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "ByteCorpus", "build_gpt", "GPT_PRESETS"]


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPT`."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # q, k and v are the three blocks of c_attn's output; under tensor parallelism each holds
        # this rank's heads only, so sizes come from the tensors, not from n_head
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        head_dim = self.n_embd // self.n_head
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim)
        q = q.view(B, T, -1, head_dim).transpose(1, 2)
        k = k.view(B, T, -1, head_dim).transpose(1, 2)
        v = v.view(B, T, -1, head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network with a 4x hidden expansion."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Decoder-only transformer language model.

    ``forward(idx, targets=None)`` returns ``(logits, loss)``: logits of shape
    ``(B, T, vocab_size)`` in the model's dtype and the mean cross-entropy, in fp32, against ``targets`` (or
    ``None`` when no targets are given).  With ``tie_weights`` the output
    projection shares its weight Parameter with the token embedding.
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Number of scalar parameters, counting shared (tied) Parameters once."""
        seen: set[int] = set()
        total = 0
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        return total

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:  # in fp32 even when the model runs in 16 bits
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 40, generator: torch.Generator | None = None,
                 stop: int | None = None) -> torch.Tensor:
        """Continue the byte sequences ``idx`` (``(B, T)`` int64) by sampling
        ``max_new_tokens`` bytes (the last ``block_size`` bytes as context), from the
        ``top_k`` most likely at ``temperature``; a row stops early at byte ``stop``."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            logits = logits[:, -1, :].float() / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
            if stop is not None and bool((nxt == stop).all()):
                break
        return idx


#: Model sizes for :func:`build_gpt`: ``tiny`` for tests, ``small`` for demos.
GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64),
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "medium": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256),
}


def build_gpt(preset: str = "tiny", **overrides) -> GPT:
    """Build a :class:`GPT` from a named preset, optionally overriding config fields.

    Initialisation is deterministic given ``torch.manual_seed``.
    """
    if preset not in GPT_PRESETS:
        raise ValueError(f"Unknown GPT preset {preset!r}; choose one of {sorted(GPT_PRESETS)}")
    return GPT(replace(GPT_PRESETS[preset], **overrides))


class ByteCorpus:
    """Byte-level text corpus built from the Python standard library's ``.py`` sources.

    Files are read in sorted path order (skipping ``site-packages``,
    ``dist-packages`` and ``test``/``tests`` directories and unreadable
    files) until ``max_bytes`` bytes are collected.  The last
    ``val_fraction`` of the bytes form the validation split.

    Attributes:
        data: all bytes, a ``uint8`` tensor.
        train, val: views of ``data`` for the two splits.
        num_files: number of files that contributed bytes.
    """

    _SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})

    def __init__(self, max_bytes: int = 8 * 1024 * 1024, val_fraction: float = 0.05, root: str | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.root = root or sysconfig.get_paths()["stdlib"]
        buf = bytearray()
        self.num_files = 0
        for path in self._source_files(self.root):
            try:
                with open(path, "rb") as f:
                    chunk = f.read(max_bytes - len(buf))
            except OSError:
                continue
            if chunk:
                buf += chunk
                self.num_files += 1
            if len(buf) >= max_bytes:
                break
        if not buf:
            raise RuntimeError(f"no Python source files found under {self.root}")
        self.data = torch.frombuffer(buf, dtype=torch.uint8).clone()
        n_val = max(1, int(math.ceil(len(self.data) * val_fraction)))
        self.train = self.data[: len(self.data) - n_val]
        self.val = self.data[len(self.data) - n_val :]

    @classmethod
    def _source_files(cls, root: str) -> list[str]:
        files: list[str] = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in cls._SKIP_DIRS)
            files.extend(os.path.join(dirpath, name) for name in filenames if name.endswith(".py"))
        return sorted(files)

    def __len__(self) -> int:
        return len(self.data)

    def batch(
        self,
        split: str,
        batch_size: int,
        block_size: int,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``batch_size`` random windows from ``split`` (``"train"`` or ``"val"``).

        Returns ``(x, y)``, both ``int64`` of shape ``(batch_size, block_size)``,
        where ``y`` is ``x`` shifted left by one byte.
        """
        if split == "train":
            data = self.train
        elif split == "val":
            data = self.val
        else:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if len(data) <= block_size:
            raise ValueError(f"{split} split has {len(data)} bytes, too few for block_size {block_size}")
        starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
        window = data[starts.unsqueeze(1) + torch.arange(block_size + 1)].long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

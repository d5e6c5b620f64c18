"""Muon's arithmetic on one whole matrix: momentum, the Newton-Schulz orthogonalization, the scale.

Two flavours, one per source of truth:

* ``"deepspeed"`` (the config's ``"type": "Muon"``): DeepSpeed 0.19's ``muon_update``. The
  ``ns_method`` is ``"gram"`` (the default: Newton-Schulz on the small Gram matrix, with a restart
  at iteration 2, in fp16 where the device multiplies fp16, else fp32) or ``"standard"`` (the
  quintic iteration on the matrix itself, in bf16 where the device has it, else fp32); the matrix
  is normalized by ``norm + 1e-7`` and the result scaled by ``sqrt(max(1, rows / cols))``.
* ``"torch"`` (a ``torch.optim.Muon`` a script passes in): torch's iteration, always in bf16,
  normalized by ``norm.clamp(min=eps)``, with its ``ns_coefficients``, ``ns_steps`` and
  ``adjust_lr_fn`` (``"original"``: ``sqrt(max(1, rows / cols))``; ``"match_rms_adamw"``:
  ``0.2 * sqrt(max(rows, cols))``).

Both take the momentum as ``momentum.lerp_(grad, 1 - beta)`` and, with Nesterov, the blend
``grad.lerp(momentum, beta)``: elementwise, so it runs on each rank's shard; only
:func:`orthogonalize` needs the whole matrix (``muon.py`` brings it to one rank).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

#: Newton-Schulz quintic coefficients (Keller Jordan's; DeepSpeed's and torch's default).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")
FLAVOURS = ("deepspeed", "torch")


def fp16_matmul_supported(device: torch.device) -> bool:
    """Whether ``device`` multiplies fp16 matrices natively (CUDA; a CPU with oneDNN fp16)."""
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False
    return False


def bf16_matmul_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu"


def ns_dtype(ns_method: str, device: torch.device) -> torch.dtype:
    """The dtype DeepSpeed's iteration runs in on ``device``: fp16 for ``gram``, bf16 for
    ``standard``, fp32 where the device lacks that type."""
    if ns_method == "gram":
        return torch.float16 if fp16_matmul_supported(device) else torch.float32
    return torch.bfloat16 if bf16_matmul_supported(device) else torch.float32


def _quintic(X: torch.Tensor, steps: int, coefficients) -> torch.Tensor:
    a, b, c = coefficients
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X


def _torch_quintic(X: torch.Tensor, steps: int, coefficients) -> torch.Tensor:
    """torch's form of the iteration (fused multiply-adds: its bf16 roundings)."""
    a, b, c = coefficients
    mm = torch.addmm if X.dim() == 2 else torch.baddbmm
    shape = X.shape
    if X.dim() > 3:
        X = X.reshape(-1, *shape[-2:])
    for _ in range(steps):
        gram = X @ X.mT
        update = mm(gram, gram, gram, beta=b, alpha=c)
        X = mm(X, update, X, beta=a)
    return X.reshape(shape)


def _gram_quintic(X: torch.Tensor, steps: int, coefficients) -> torch.Tensor:
    """The same iteration on the Gram matrix ``R = X X^T`` (n x n, n <= m), accumulating the
    polynomial ``Q`` so that the result is ``Q X``; restarted from ``X <- Q X`` at iteration 2."""
    a, b, c = coefficients
    R = X @ X.mT
    Q: Optional[torch.Tensor] = None
    restart_at = 2
    for i in range(steps):
        if i == restart_at:
            X = Q @ X
            R = X @ X.mT
            Q = None
        Z = b * R + c * R @ R
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = a * Q + Z @ Q
        if i < steps - 1 and i + 1 != restart_at:
            RZ = a * R + Z @ R
            R = a * RZ + Z @ RZ
    return Q @ X


def newton_schulz(G: torch.Tensor, steps: int = 5, ns_method: str = "gram", flavour: str = "deepspeed",
                  coefficients=NS_COEFFICIENTS, eps: float = 1e-7) -> torch.Tensor:
    """The orthogonalization of ``G`` (a matrix, or a batch over leading dimensions), in
    ``flavour``'s precision and normalization (module docstring); returned in the iteration's
    dtype, in ``G``'s shape."""
    tall = G.size(-2) > G.size(-1)
    if flavour == "torch":
        X = G.to(torch.bfloat16)
        X = X.mT if tall else X
        X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        X = _torch_quintic(X, steps, coefficients)
        return X.mT if tall else X
    dtype = ns_dtype(ns_method, G.device)
    if ns_method == "gram":
        X = G.to(torch.float32 if G.dtype == torch.float16 else G.dtype)
        X = X.mT if tall else X
        X = (X / (X.norm(dim=(-2, -1), keepdim=True) + eps)).to(dtype)
        X = _quintic(X, steps, coefficients) if X.size(-1) <= X.size(-2) else _gram_quintic(X, steps, coefficients)
    else:
        X = G.to(dtype)
        X = X.mT if tall else X
        X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
        X = _quintic(X, steps, coefficients)
    return X.mT if tall else X


def aspect_scale(rows: int, cols: int, adjust_lr_fn: Optional[str] = None) -> float:
    """The factor the orthogonalized update is multiplied by: ``sqrt(max(1, rows / cols))``
    (DeepSpeed; torch's ``"original"``), ``0.2 * sqrt(max(rows, cols))`` (torch's
    ``"match_rms_adamw"``)."""
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(rows / cols) if rows > cols else 1.0


def orthogonalize(update: torch.Tensor, shape: torch.Size, *, ns_method: str = "gram", ns_steps: int = 5,
                  flavour: str = "deepspeed", num_heads: Optional[int] = None, coefficients=NS_COEFFICIENTS,
                  eps: float = 1e-7, adjust_lr_fn: Optional[str] = None) -> torch.Tensor:
    """Muon's update of one parameter of ``shape`` from its (flat, whole) blended momentum
    ``update``: orthogonalized and scaled, flat, in ``update``'s dtype.

    As DeepSpeed: a 4-D (convolution) weight is orthogonalized as ``[out, in * kh * kw]`` (and,
    as DeepSpeed does, scaled by its last two dimensions); 3-D and up as a batch of matrices over
    the leading dimensions (experts); with ``num_heads``, a 2-D ``[heads * head_dim, in]``
    projection head by head.
    """
    dtype = update.dtype
    if len(shape) < 2:
        raise ValueError(f"Muon orthogonalizes matrices; got a parameter of shape {tuple(shape)}")
    if num_heads is not None:
        rows, cols = shape[0], math.prod(shape[1:])
        if num_heads < 1 or rows % num_heads:
            raise ValueError(f"muon_num_heads={num_heads} does not divide the {rows} rows of a parameter of "
                             f"shape {tuple(shape)}")
        out = newton_schulz(update.view(num_heads, rows // num_heads, cols), ns_steps, ns_method, flavour,
                            coefficients, eps)
        return (out.to(dtype) * aspect_scale(rows // num_heads, cols, adjust_lr_fn)).reshape(-1)
    if len(shape) == 4:
        matrix = update.view(shape[0], -1)
    else:
        matrix = update.view(shape)
    out = newton_schulz(matrix, ns_steps, ns_method, flavour, coefficients, eps).to(dtype)
    return (out * aspect_scale(shape[-2], shape[-1], adjust_lr_fn)).reshape(-1)


def ns_flops(shape: torch.Size, ns_steps: int = 5, ns_method: str = "gram",
             num_heads: Optional[int] = None) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of orthogonalizing one parameter of ``shape``:
    what the owner of its update spends, the measure the owners are balanced by."""
    if num_heads is not None:
        batch, n, m = num_heads, shape[0] // num_heads, math.prod(shape[1:])
    elif len(shape) == 4:
        batch, n, m = 1, shape[0], math.prod(shape[1:])
    else:
        batch, n, m = math.prod(shape[:-2]), shape[-2], shape[-1]
    n, m = min(n, m), max(n, m)
    per_step = 2 * n * n * m + 2 * n * n * n + 2 * n * n * m  # X X^T, A A, B X
    if ns_method == "gram" and m > n:
        gram = 2 * n * n * m  # R = X X^T, and once more at the restart, plus the final Q X
        steps = ns_steps * (2 * n * n * n) + (ns_steps - 2) * 2 * (2 * n * n * n)
        return batch * (3 * gram + steps)
    return batch * ns_steps * per_step

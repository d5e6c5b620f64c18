"""ALST's tiled MLP and tiled logits-and-loss (``parallel/tiled.py``, DeepSpeed's ``TiledMLP`` and
``TiledFusedLogitsLoss``): the same outputs and gradients as the untiled computation, scaled by the
gradient that reaches them, and through the engine at stages 1-3 the same training as one process."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerodp.parallel.tiled import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute


def _grads(module: nn.Module, x: torch.Tensor) -> dict:
    return {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in module.named_parameters()}}


@pytest.mark.parametrize("shards", [1, 3, 4])
def test_the_tiled_mlp_gives_the_untiled_output_and_gradients(shards):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(2, 12, 8, requires_grad=True)
    (mlp(x) * torch.arange(8.0)).sum().backward()
    want, out_want = _grads(mlp, x), mlp(x).detach()
    mlp.zero_grad()
    x.grad = None
    hooks = []
    fired = []
    for p in mlp.parameters():
        hooks.append(p.register_post_accumulate_grad_hook(lambda p: fired.append(1)))
    out = TiledMLP.apply(lambda m, t: m(t), mlp, x, shards, list(mlp.parameters()))
    (out * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(out.detach(), out_want)
    for k, v in _grads(mlp, x).items():
        torch.testing.assert_close(v, want[k], msg=k)
    assert len(fired) == 4  # one gradient per parameter, whatever the tiles (the engine's hooks fire once)


def _mlp_fn(self, x):
    return self(x)


@pytest.mark.parametrize("shards", [1, 3, 4])
def test_sequence_tiled_compute_gives_the_untiled_output_and_gradients(shards):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(2, 13, 8, requires_grad=True)  # 13 tokens: the last tile is shorter
    weight = torch.randn(2, 13, 8)
    (mlp(x) * weight).sum().backward()
    want = _grads(mlp, x)
    mlp.zero_grad()
    x.grad = None
    out = sequence_tiled_compute(_mlp_fn, 13, shards, {"x": x}, {"self": mlp}, "x", list(mlp.parameters()),
                                 output_unshard_dimension=1, output_reduction=None)
    (out * weight).sum().backward()
    torch.testing.assert_close(out.detach(), mlp(x).detach())
    for k, v in _grads(mlp, x).items():
        torch.testing.assert_close(v, want[k], msg=k)
    with pytest.raises(ValueError, match="grad_requiring_tensor_key"):
        sequence_tiled_compute(_mlp_fn, 13, shards, {"x": x}, {"self": mlp}, "y", [])
    with pytest.raises(ValueError, match="output_reduction"):
        sequence_tiled_compute(_mlp_fn, 13, shards, {"x": x}, {"self": mlp}, "x", [], 1, "max")


def _loss_fn(self, x, y):
    return F.cross_entropy(self(x).flatten(0, 1), y.flatten(), reduction="sum")


def test_sequence_tiled_compute_matches_deepspeeds_on_a_loss():
    """The loss use (scalars stacked on dimension 0, their mean) against DeepSpeed's own function."""
    ds = pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")
    results = []
    for impl in (sequence_tiled_compute, ds.sequence_tiled_compute):
        torch.manual_seed(0)
        head = nn.Linear(6, 11)
        x = torch.randn(1, 12, 6, requires_grad=True)
        y = torch.randint(0, 11, (1, 12))
        loss = impl(_loss_fn, 12, 4, {"x": x, "y": y}, {"self": head}, "x", list(head.parameters()),
                    output_unshard_dimension=0, output_reduction="mean")
        loss.backward()
        results.append((loss.detach(), _grads(head, x)))
    (mine, my_grads), (theirs, their_grads) = results
    torch.testing.assert_close(mine, theirs)
    for k in my_grads:
        torch.testing.assert_close(my_grads[k], their_grads[k], msg=k)


def test_the_tiled_loss_gives_the_untiled_loss_and_scales_its_gradients():
    torch.manual_seed(0)
    head = nn.Linear(6, 11)
    x = torch.randn(2, 10, 6, requires_grad=True)
    y = torch.randint(0, 11, (2, 10))
    ce = lambda m, xt, yt: F.cross_entropy(m(xt), yt, reduction="sum")  # noqa: E731
    want_loss = F.cross_entropy(head(x).reshape(-1, 11), y.reshape(-1), reduction="sum")
    (0.25 * want_loss).backward()
    want = _grads(head, x)
    head.zero_grad()
    x.grad = None
    loss = TiledFusedLogitsLoss.apply(ce, head, x, y, None, 4, list(head.parameters()), "sum")
    (0.25 * loss).backward()  # the scale reaches the parameters' gradients too (DeepSpeed's misses it)
    torch.testing.assert_close(loss.detach(), want_loss.detach())
    for k, v in _grads(head, x).items():
        torch.testing.assert_close(v, want[k], msg=k)
    with pytest.raises(ValueError, match="output_reduction"):
        TiledFusedLogitsLoss.apply(ce, head, x, y, None, 4, [], "max")
    with pytest.raises(ValueError, match=r"share their \[batch, sequence\]"):
        TiledFusedLogitsLoss.apply(ce, head, x, y[:, :5], None, 4, [], "sum")


@pytest.mark.parametrize("stage,gas", [(1, 1), (2, 2), (3, 1), (3, 2)])
def test_a_tiled_model_trains_as_the_untiled_one_on_one_process(pool, stage, gas):
    from tiled_tasks import train_tiled
    for r in pool.run(train_tiled, 2, stage, 3, gas):
        for got, want in zip(r["norms"], r["ref_norms"]):
            assert abs(got - want) <= 1e-5 * want, (r["norms"], r["ref_norms"])
        for name, want in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)

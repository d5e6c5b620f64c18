"""Tests for optimizer construction and DeepSpeed-compatible lr schedules."""

import math
import warnings

import pytest
import torch

from zerodp.optim import (
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
    check_elementwise,
    optimizer_factory_from_config,
)


def _params(n=2):
    return [torch.nn.Parameter(torch.zeros(3)) for _ in range(n)]


# ---------------------------------------------------------------------------
# optimizer_factory_from_config
# ---------------------------------------------------------------------------


def test_adam_defaults_to_adamw_mode():
    cls, kwargs = optimizer_factory_from_config("Adam", {"lr": 1e-3, "betas": [0.8, 0.99]})
    assert cls is torch.optim.AdamW
    assert kwargs["betas"] == (0.8, 0.99)
    assert isinstance(kwargs["betas"], tuple)
    assert kwargs["lr"] == 1e-3
    # DeepSpeed's Adam kernels default weight_decay to 0, not torch's 0.01.
    assert kwargs["weight_decay"] == 0.0
    cls(_params(), **kwargs)


def test_adam_w_mode_false_gives_adam_and_drops_ds_keys():
    params = {"lr": 2e-4, "adam_w_mode": False, "torch_adam": True, "fused": True, "weight_decay": 0.1}
    cls, kwargs = optimizer_factory_from_config("adam", params)
    assert cls is torch.optim.Adam
    assert kwargs == {"lr": 2e-4, "weight_decay": 0.1}
    assert "adam_w_mode" in params  # input not modified
    cls(_params(), **kwargs)


def test_torch_adam_keeps_torch_defaults():
    cls, kwargs = optimizer_factory_from_config("Adam", {"torch_adam": True})
    assert cls is torch.optim.AdamW
    assert kwargs == {}


@pytest.mark.parametrize(
    "name,expected",
    [
        ("AdamW", torch.optim.AdamW),
        ("ADAMW", torch.optim.AdamW),
        ("SGD", torch.optim.SGD),
        ("sgd", torch.optim.SGD),
        ("Adagrad", torch.optim.Adagrad),
        ("RMSprop", torch.optim.RMSprop),
    ],
)
def test_type_mapping(name, expected):
    cls, _ = optimizer_factory_from_config(name, {"lr": 0.1})
    assert cls is expected


def test_adamw_ignores_adam_w_mode_false():
    cls, kwargs = optimizer_factory_from_config("AdamW", {"adam_w_mode": False})
    assert cls is torch.optim.AdamW
    assert "adam_w_mode" not in kwargs


def test_unknown_type_lists_supported():
    with pytest.raises(ValueError, match="FooOpt") as exc:
        optimizer_factory_from_config("FooOpt", {})
    assert "AdamW" in str(exc.value) and "SGD" in str(exc.value)


def test_max_grad_norm_rejected():
    with pytest.raises(ValueError, match="gradient_clipping"):
        optimizer_factory_from_config("Adam", {"max_grad_norm": 1.0})


def test_muon_is_built_on_the_engines_groups():
    """Muon's halves come from the parameters' use_muon tags: the factory alone cannot build it;
    ``optimizer_from_config`` checks its keys and builds it on the groups it is given."""
    with pytest.raises(ValueError, match="use_muon"):
        optimizer_factory_from_config("Muon", {"lr": 1e-3})
    from zerodp.optim.build import optimizer_from_config
    from zerodp.optim.muon import MuonWithAuxAdam
    assert isinstance(optimizer_from_config("muon", {"muon_lr": 0.02, "adam_lr": 1e-3}), MuonWithAuxAdam)
    with pytest.raises(ValueError, match="optimizer.params.ns_steps"):
        optimizer_from_config("Muon", {"ns_steps": 0})


@pytest.mark.parametrize("name", ["Lamb", "OneBitLamb", "LAMB", "Shampoo", "LBFGS", "Adafactor"])
def test_non_elementwise_types_refused(name):
    with pytest.raises(ValueError) as exc:
        optimizer_factory_from_config(name, {"lr": 1e-3})
    msg = str(exc.value)
    assert "shard" in msg and "whole-tensor" in msg
    assert "AdamW" in msg  # names the alternatives


# ---------------------------------------------------------------------------
# check_elementwise
# ---------------------------------------------------------------------------


def test_check_elementwise_silent_for_known():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.RMSprop):
            check_elementwise(cls)


def test_check_elementwise_warns_for_unknown_class():
    class MyOptimizer(torch.optim.Optimizer):
        pass

    with pytest.warns(UserWarning, match="elementwise"):
        check_elementwise(MyOptimizer)


def test_check_elementwise_refuses_known_bad():
    class FusedLamb(torch.optim.Optimizer):
        pass

    class DistributedShampoo(torch.optim.Optimizer):
        pass

    bad = [torch.optim.LBFGS, FusedLamb, DistributedShampoo]
    if hasattr(torch.optim, "Adafactor"):
        bad.append(torch.optim.Adafactor)
    for cls in bad:
        with pytest.raises(ValueError, match="whole-tensor"):
            check_elementwise(cls)


# ---------------------------------------------------------------------------
# Schedules: reference formulas written from DeepSpeed's definitions.
# DeepSpeed's iteration index starts at -1 after construction and each
# scheduler.step() adds one; the lr after n steps is f(n - 1).
# ---------------------------------------------------------------------------


def _warmup_gamma(i, warmup, kind):
    w = max(2, warmup)
    if kind == "log":
        return math.log(i + 1) / math.log(w)
    return i / w


def ref_warmup_lr(i, lo, hi, warmup, kind):
    if i < 0:
        return lo
    w = max(2, warmup)
    g = _warmup_gamma(i, warmup, kind) if i < w else 1.0
    return lo + (hi - lo) * g


def ref_warmup_decay_lr(i, lo, hi, warmup, total, kind):
    if i < 0:
        return lo
    w = max(2, warmup)
    if i < w:
        g = _warmup_gamma(i, warmup, kind)
    else:
        g = max(0.0, (total - i) / max(1, total - w))
    return lo + (hi - lo) * g


def ref_warmup_cosine_lr(i, base, warmup, total, min_ratio, cos_min, kind):
    if i < 0:
        return 0.0
    w = max(2, warmup)
    if i < w:
        r = min_ratio + (1 - min_ratio) * _warmup_gamma(i, warmup, kind)
    else:
        p = min(1.0, (i - w + 1) / max(1, total - w))
        r = max(0.0, cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * p)))
    return base * r


def _trace(opt, sched, n):
    """lr of every group right after construction and after each of n steps."""
    seq = [[g["lr"] for g in opt.param_groups]]
    assert sched.get_last_lr() == seq[0]
    for _ in range(n):
        opt.step()
        sched.step()
        seq.append([g["lr"] for g in opt.param_groups])
        assert sched.get_last_lr() == seq[-1]
    return seq


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_sequence(kind):
    opt = torch.optim.SGD(_params(1), lr=0.5)
    sched = build_scheduler(
        opt, "WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 8, "warmup_type": kind}
    )
    assert isinstance(sched, WarmupLR)
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    seq = _trace(opt, sched, 20)
    expected = [ref_warmup_lr(n - 1, 0.01, 0.1, 8, kind) for n in range(21)]
    assert [s[0] for s in seq] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert seq[0][0] == pytest.approx(0.01)  # construction: warmup_min_lr
    assert seq[1][0] == pytest.approx(0.01)  # iteration 0: still warmup_min_lr
    assert seq[9][0] == pytest.approx(0.1)  # iteration 8: warmup finished
    assert seq[20][0] == pytest.approx(0.1)


def test_warmup_lr_default_max_is_optimizer_lr_and_per_group_lists():
    p1, p2 = _params(2)
    opt = torch.optim.SGD([{"params": [p1], "lr": 0.2}, {"params": [p2], "lr": 0.4}])
    sched = build_scheduler(opt, "warmuplr", {"warmup_min_lr": [0.0, 0.1], "warmup_num_steps": 4})
    seq = _trace(opt, sched, 10)
    for n, lrs in enumerate(seq):
        assert lrs[0] == pytest.approx(ref_warmup_lr(n - 1, 0.0, 0.2, 4, "log"))
        assert lrs[1] == pytest.approx(ref_warmup_lr(n - 1, 0.1, 0.4, 4, "log"))


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_sequence(kind):
    opt = torch.optim.SGD(_params(1), lr=1.0)
    params = {"total_num_steps": 16, "warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 5}
    params["warmup_type"] = kind
    sched = build_scheduler(opt, "WarmupDecayLR", params)
    assert isinstance(sched, WarmupDecayLR)
    seq = _trace(opt, sched, 20)
    expected = [ref_warmup_decay_lr(n - 1, 0.0, 0.05, 5, 16, kind) for n in range(21)]
    assert [s[0] for s in seq] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert seq[0][0] == 0.0
    assert seq[6][0] == pytest.approx(0.05)  # iteration 5: peak, decay starts
    assert seq[17][0] == 0.0  # iteration 16 == total_num_steps
    assert seq[20][0] == 0.0  # stays at zero


def test_warmup_cosine_two_groups():
    p1, p2 = _params(2)
    opt = torch.optim.AdamW([{"params": [p1], "lr": 1e-3}, {"params": [p2], "lr": 3e-2}])
    params = {
        "total_num_steps": 15,
        "warmup_min_ratio": 0.1,
        "warmup_num_steps": 4,
        "cos_min_ratio": 0.05,
        "warmup_type": "linear",
    }
    sched = build_scheduler(opt, "WarmupCosineLR", params)
    assert isinstance(sched, WarmupCosineLR)
    seq = _trace(opt, sched, 20)
    for g, base in enumerate((1e-3, 3e-2)):
        expected = [ref_warmup_cosine_lr(n - 1, base, 4, 15, 0.1, 0.05, "linear") for n in range(21)]
        assert [s[g] for s in seq] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert seq[0][g] == 0.0  # construction: ratio 0
        assert seq[1][g] == pytest.approx(0.1 * base)  # iteration 0: warmup_min_ratio
        assert seq[5][g] == pytest.approx(base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi / 11))))
        assert seq[16][g] == pytest.approx(0.05 * base)  # iteration 15: cos_min_ratio
        assert seq[20][g] == pytest.approx(0.05 * base)  # clamped afterwards


def test_warmup_cosine_log_default():
    opt = torch.optim.SGD(_params(1), lr=0.3)
    sched = build_scheduler(opt, "WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 6})
    seq = _trace(opt, sched, 20)
    expected = [ref_warmup_cosine_lr(n - 1, 0.3, 6, 12, 0.0, 0.0001, "log") for n in range(21)]
    assert [s[0] for s in seq] == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_scheduler_state_dict_roundtrip_and_explicit_iteration():
    opt = torch.optim.SGD(_params(1), lr=1.0)
    sched = build_scheduler(opt, "WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5})
    for _ in range(7):
        opt.step()
        sched.step()
    state = sched.state_dict()
    assert sched.last_batch_iteration == 6

    opt2 = torch.optim.SGD(_params(1), lr=1.0)
    sched2 = build_scheduler(opt2, "WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5})
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    opt.step()
    sched.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])

    sched.step(last_batch_iteration=10)
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_warmup_decay_lr(10, 0.0, 0.001, 5, 20, "log"))


def test_scheduler_errors():
    opt = torch.optim.SGD(_params(1), lr=1.0)
    with pytest.raises(ValueError, match="WarmupLR.*WarmupDecayLR.*WarmupCosineLR"):
        build_scheduler(opt, "OneCycle", {})
    with pytest.raises(ValueError, match="total_num_steps"):
        build_scheduler(opt, "WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 100})
    with pytest.raises(ValueError, match="total_num_steps"):
        build_scheduler(opt, "WarmupCosineLR", {"warmup_num_steps": 10})
    with pytest.raises(ValueError, match="warmup_num_steps"):
        build_scheduler(opt, "WarmupLR", {"warmup_num_steps": 0})
    with pytest.raises(ValueError, match="warmup_type"):
        build_scheduler(opt, "WarmupLR", {"warmup_type": "cubic"})
    with pytest.raises(ValueError, match="warmup_min_lr"):
        build_scheduler(opt, "WarmupLR", {"warmup_min_lr": [0.0, 0.1]})
    with pytest.raises(ValueError, match="bogus"):
        build_scheduler(opt, "WarmupLR", {"bogus": 1})

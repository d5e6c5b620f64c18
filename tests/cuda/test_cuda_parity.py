"""Parity on CUDA: every stage in fp32, bf16 and fp16 gives the parameters of single-process CUDA
training, on a real NCCL group (one rank), with ``overlap_comm`` (gradient copies and reductions on a
side stream) and stage 3's prefetch (the next units' gathers issued ahead) on and off.

Tolerances: the engine steps with torch's fused AdamW, the reference with its default (foreach)
AdamW; on CUDA the two kernels round differently in the last bits, so fp32 parameters agree to
1e-5 rather than the CPU suite's 2e-6."""
from __future__ import annotations

import pytest
import torch
from parity_model import reference, train_engine
from precision_tasks import reference_mixed, train_mixed

STEPS = 4


def max_diff(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max((got[n].float() - want[n].float()).abs().max().item() for n in want)


def assert_norms(got: list, want: list, rel: float) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=rel), f"step {step}: grad norm {g} != {w}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_parity(group, device, stage):
    """AdamW, accumulation 2, clipping that bites, 60-element buckets (many flat groups), tied
    weights, a frozen layer, two param groups, a branch unused in some steps."""
    got = train_engine(group, stage, STEPS, gas=2, clip=0.5, bucket=60)
    params, norms = reference(1, STEPS, gas=2, clip=0.5, branch_on_all_ranks=stage == 3, device=device)
    assert got["groups"] > 3 and got["global_steps"] == STEPS
    assert max_diff(got["params"], params) <= 1e-5
    assert_norms(got["norms"], norms, 1e-5)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_parity(group, device, stage, dtype):
    """16-bit forward and backward on CUDA, fp32 accumulation and masters, against the reference
    that does the same in one process (``precision_tasks.reference_mixed``)."""
    got = train_mixed(group, stage, STEPS, dtype, gas=2, clip=0.5, bucket=60, comm="fp32", accum="fp32")
    masters, norms, params16 = reference_mixed(1, STEPS, dtype, gas=2, clip=0.5, order="fp32",
                                               branch_on_all_ranks=stage == 3, device=device)
    assert got["skipped"] == 0
    assert got["loss_dtypes"] == [f"torch.{'bfloat16' if dtype == 'bf16' else 'float16'}"]
    assert max_diff(got["masters"], masters) <= 1e-5
    assert_norms(got["norms"], norms, 1e-5)
    # the 16-bit parameters are the masters rounded: at most one step of the 16-bit grid apart
    assert all(p.dtype == params16[n].dtype for n, p in got["params"].items())
    assert max_diff(got["params"], params16) <= 2e-2


@pytest.mark.parametrize("stage", [2, 3])
def test_overlap_comm_off_gives_the_same_numbers(group, device, stage):
    """The side stream changes when copies and reductions run, never what they compute."""
    on = train_engine(group, stage, STEPS, gas=2, clip=0.5, bucket=60, overlap=True)
    off = train_engine(group, stage, STEPS, gas=2, clip=0.5, bucket=60, overlap=False)
    assert max_diff(on["params"], off["params"]) == 0.0
    assert on["norms"] == off["norms"]


def test_stage3_prefetch_off_gives_the_same_numbers(group, device):
    """Stage 3 gathers the next units ahead on a side stream; without prefetch it gathers each unit
    when its forward starts. Same numbers either way."""
    ahead = train_engine(group, 3, STEPS, gas=2, clip=0.5, bucket=60)
    inline = train_engine(group, 3, STEPS, gas=2, clip=0.5, bucket=60, zero={"stage3_prefetch_bucket_size": 0})
    assert max_diff(ahead["params"], inline["params"]) == 0.0
    assert ahead["norms"] == inline["norms"]


def test_engine_runs_on_the_gpu_with_nccl(group, device):
    """The in-process cases above really ran on the GPU and NCCL (not a silent CPU fallback)."""
    import torch.distributed as dist
    from parity_model import build_model, make_config, param_groups

    import zerodp
    model = build_model()
    engine, *_ = zerodp.initialize(model=model, model_parameters=param_groups(model),
                                   config=make_config(3, 1), process_group=group)
    assert engine.device == device and all(p.device == device for p in engine.module.parameters())
    assert str(dist.get_backend()).lower() == ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        assert torch.cuda.memory_allocated(device) > 0
    engine.destroy()


def test_zero_init_builds_on_the_device(group, device):
    """``zero.Init`` builds each module on the engine's device, as DeepSpeed's does: a seeded
    layer gets the values the device's generator gives it (what DDP and DeepSpeed train from),
    not the CPU's, and a device the caller chose (meta) is left alone."""
    from torch import nn

    import zerodp
    torch.manual_seed(0)
    want = nn.Linear(16, 8, device=device)
    torch.manual_seed(0)
    with zerodp.zero.Init():
        layer = nn.Linear(16, 8)
        assert torch.get_default_device() == device
    assert torch.get_default_device().type == "cpu"
    with zerodp.zero.GatheredParameters(list(layer.parameters())):
        assert torch.equal(layer.weight, want.weight) and torch.equal(layer.bias, want.bias)
    with torch.device("meta"), zerodp.zero.Init():
        assert torch.get_default_device().type == "meta"

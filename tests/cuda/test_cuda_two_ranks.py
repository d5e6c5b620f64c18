"""Two ranks on one GPU: NCCL refuses two ranks on one device, so these run the suite's worker pool
(gloo) with the engine on CUDA tensors (each worker computes on ``cuda:0``; gloo moves CUDA tensors
for the collectives it supports). The ranks' gradient reductions, parameter gathers and the
tensor-parallel split's collectives are real here, unlike on a group of one rank."""
from __future__ import annotations

import pytest
from parity_model import reference, train_engine
from precision_tasks import reference_mixed, train_mixed

STEPS = 3
TIMEOUT = 180  # a collective gloo cannot run on CUDA tensors must fail the test, not hang the tier


def max_diff(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max((got[n].float() - want[n].float()).abs().max().item() for n in want)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_ranks_fp32_parity(pool, device, stage):
    results = pool.run(train_engine, 2, stage, STEPS, gas=2, clip=0.5, bucket=60, timeout=TIMEOUT)
    params, norms = reference(2, STEPS, gas=2, clip=0.5, branch_on_all_ranks=stage == 3, device=device)
    for r in results:
        assert max_diff(r["params"], params) <= 1e-5
        assert r["norms"] == pytest.approx(norms, rel=1e-5)
    comm = results[0]["comm"]
    assert comm["all_gather"] > 0 and (comm["reduce_scatter"] > 0 or comm["all_reduce"] > 0)


def test_two_ranks_bf16_stage3(pool, device):
    results = pool.run(train_mixed, 2, 3, STEPS, "bf16", gas=2, clip=0.5, bucket=60, comm="fp32",
                       accum="fp32", timeout=TIMEOUT)
    masters, norms, _ = reference_mixed(2, STEPS, "bf16", gas=2, clip=0.5, order="fp32",
                                        branch_on_all_ranks=True, device=device)
    for r in results:
        assert max_diff(r["masters"], masters) <= 1e-5
        assert r["norms"] == pytest.approx(norms, rel=1e-5)


def test_tensor_parallelism_over_gloo_is_refused_on_the_gpu(pool, device):
    """Four ranks on one GPU over gloo cannot run tensor parallelism: torch's DTensor over gloo ends
    the process on CUDA tensors (``benchmarks/gloo_cuda_probe.py``: a segmentation fault in its
    redistribution with torch 2.11). The engine refuses it by name instead of crashing; tensor
    parallelism on CUDA needs NCCL and a GPU per rank, which a machine of one GPU does not have."""
    if device.type != "cuda":
        pytest.skip("the refusal applies on CUDA only (its CPU test is in tests/test_tp.py)")
    from tp_tasks import refused_gloo_on_cuda
    errors = pool.run(refused_gloo_on_cuda, 4, timeout=TIMEOUT)
    assert all(e.startswith("tensor parallelism on CUDA needs an NCCL process group") for e in errors), errors

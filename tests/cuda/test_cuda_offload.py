"""Offload and checkpoints on CUDA: the optimizer (and at stage 3 the parameter shards) in pinned
host memory or in files gives the numbers of the run that keeps everything on the GPU; a checkpoint
written on CUDA loads on the CPU exactly, and one written on the CPU loads back on CUDA exactly.

The offloaded step runs on the CPU (torch's fused AdamW there) and the other on the GPU: the two
kernels round differently in the last bits, so masters agree to 1e-5 in fp32 (1e-4 in bf16, where a
master that rounds to the other side changes the next forward)."""
from __future__ import annotations

import os
import subprocess
import sys

import checkpoint_tasks as ct
import offload_tasks as ot
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3
ATOL = {"fp32": 1e-5, "bf16": 1e-4}
CASES = [  # (stage, dtype, offload, parameters too)
    (1, "fp32", "cpu", False), (2, "fp32", "cpu", False), (3, "fp32", "cpu", False),
    (3, "fp32", "nvme", False), (3, "fp32", "cpu", True), (3, "fp32", "nvme", True),
    (2, "bf16", "cpu", False), (3, "bf16", "cpu", True),
]


def assert_close(got: dict, want: dict, atol: float, what: str) -> None:
    assert got.keys() == want.keys()
    for n, w in want.items():
        err = (got[n].float() - w.float()).abs().max().item()
        assert err <= atol, f"{what}: {n} max |diff| {err:.3g} > {atol}"


@pytest.mark.parametrize("stage,dtype,where,params", CASES)
def test_offload_gives_the_numbers_of_the_gpu_run(group, device, tmp_path, stage, dtype, where, params):
    """Clipping, a warm-up schedule, 60-element buckets, and for disk offload 40-element tiles (the
    step walks many tiles through their files while the GPU computes the next)."""
    plain = ot.train_task(group, stage, dtype, STEPS, {})
    zero = ot.zero_block(where, str(tmp_path), params=params, sub_group_size=40 if where == "nvme" else None)
    got = ot.train_task(group, stage, dtype, STEPS, zero)
    assert_close(got["masters"], plain["masters"], ATOL[dtype], "offload vs on the GPU")
    assert got["norms"] == pytest.approx(plain["norms"], rel=1e-5)
    for n, v in got["params"].items():
        if n in got["masters"]:  # the parameters on the GPU are the rounded masters
            assert torch.equal(v, got["masters"][n].to(v.dtype)), n
    if where == "nvme":
        assert got["swap_files"] and not got["swap_left"]
    if dtype == "fp32":  # one process on the CPU (in 16 bits the CPU's and GPU's kernels round apart)
        ref = ct.reference(dtype, [(1, STEPS)])
        assert_close(got["masters"], ref["masters"], 1e-4, "offload vs one CPU process")


def test_host_buffers_are_pinned(group, device):
    """``pin_memory: true`` gives page-locked transfer buffers on a GPU (asynchronous copies)."""
    engine = ct.make_engine(group, 3, "fp32", zero=ot.zero_block("cpu", params=True))
    assert engine.offload.pin == (device.type == "cuda")
    engine.destroy()


@pytest.mark.parametrize("stage,dtype", [(2, "fp32"), (3, "bf16")])
def test_checkpoint_moves_between_cuda_and_cpu(group, device, tmp_path, stage, dtype):
    """Saved on CUDA after 2 steps; loaded in a process that sees no GPU (masters exactly the saved
    ones, and ``get_fp32_state_dict_from_zero_checkpoint`` gives them too), one step there, saved;
    loaded back on CUDA exactly; and the CPU's third step is the GPU's within the kernels' rounding."""
    saved = ct.save_task(group, stage, dtype, 2, str(tmp_path / "gpu"))
    out = tmp_path / "cpu.pt"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "cpu_leg.py"), str(stage), dtype,
                           str(tmp_path / "gpu"), str(tmp_path / "cpu"), "2", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), (proc.stdout + proc.stderr)[-4000:]
    cpu = torch.load(out, weights_only=False)
    assert cpu["device"] == "cpu"
    assert_close(cpu["loaded"]["masters"], saved["masters"], 0.0, "loaded on the CPU")
    assert_close({n: cpu["consolidated"][n] for n in saved["masters"]}, saved["masters"], 0.0, "consolidated")
    back = ct.resume_task(group, stage, dtype, str(tmp_path / "cpu"), 3, 3)
    assert_close(back["loaded"]["masters"], cpu["after"]["masters"], 0.0, "loaded back on CUDA")
    on_gpu = ct.resume_task(group, stage, dtype, str(tmp_path / "gpu"), 2, 3)
    # the CPU's bf16 forward rounds otherwise than the GPU's: one step apart by up to a few lr x 1e-2
    cross = {"fp32": 1e-5, "bf16": 1e-3}[dtype]
    assert_close(cpu["after"]["masters"], on_gpu["masters"], cross, "third step CPU vs GPU")

"""The CUDA tier: zerodp's GPU code paths (NCCL's tensor collectives, the side streams and events
of prefetch and ``overlap_comm``, pinned host buffers, offload, checkpoints that cross devices, the
Trainer, streamed inference) against single-process CUDA training.

    pytest -m cuda tests/cuda           # on a machine with a GPU (benchmarks/gpu_check.sh runs it)

Every test here is marked ``cuda`` and skipped, with the reason, where CUDA is absent, so the CPU
suite is unchanged. In-process cases run on a real NCCL group of one rank, started here; the
two-rank cases run in the suite's worker pool (gloo) on CUDA tensors, both ranks on one GPU.

``ZERODP_CUDA_TIER_ON_CPU=1`` runs the same cases on the CPU with gloo: a check of the tier's own
logic on a machine without a GPU, before a GPU is at hand. It proves nothing about CUDA.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zerodp.core.device import backend_for, default_device

HERE = Path(__file__).resolve().parent
ON_CPU = os.environ.get("ZERODP_CUDA_TIER_ON_CPU") == "1"
RUNS = torch.cuda.is_available() or ON_CPU
WHY = "needs a CUDA device: run `pytest -m cuda tests/cuda` on a machine with one (benchmarks/gpu_check.sh)"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.cuda)
            if not RUNS:
                item.add_marker(pytest.mark.skip(reason=WHY))


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the engine computes on (``core/device.py``): ``cuda:0`` here."""
    d = default_device()
    assert d.type == "cuda" or ON_CPU, d
    if d.type == "cuda":
        torch.cuda.set_device(d)
    return d


@pytest.fixture(scope="session")
def group(device, tmp_path_factory):
    """This process as a world of one rank, on the device's backend (NCCL on a GPU). The engine
    takes the default group (``None``)."""
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("store") / "file"
        dist.init_process_group(backend_for(device), init_method=f"file://{store}", rank=0, world_size=1)
    assert dist.get_backend() == backend_for(device)
    return None


@pytest.fixture(scope="session")
def hf_python(request) -> str:
    """A Python for the Trainer's runs under ``ZERODP_AS_DEEPSPEED=1``: this one where DeepSpeed
    is not installed (a GPU machine's image), else the suite's view without it."""
    if importlib.util.find_spec("deepspeed") is None:
        return sys.executable
    return request.getfixturevalue("no_deepspeed_python")


@pytest.fixture(autouse=True)
def one_thread():
    """References on the CPU run their kernels on one thread, as the workers do (16-bit CPU GEMMs
    round by how the work is split over threads); no effect on the GPU's kernels."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

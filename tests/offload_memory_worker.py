"""Run under torchrun by ``test_offload.py::test_disk_offload_trains_a_model_several_times_the_cap``
and by ``benchmarks/offload.py --part cap``::

    offload_memory_worker.py NVME_DIR LAYERS [disk|disk+params|cpu|stage3|stage0]

A stack of bias-free 512 x 512 linear layers trains a few steps in bf16: at stage 3 (built on the
meta device, so no rank ever holds the whole model) with the optimizer offloaded to disk (the
default; with ``disk+params`` the parameter shards too), to host memory, or not at all; or at
stage 0 (built whole).
Rank 0 prints one ``RESULT`` line: its resident memory (RSS) just before the model was built,
the peak over that while building and training (``VmHWM`` reset there), the ledger and the
model's total model-state bytes (16 per parameter: bf16 parameter and gradient, fp32 master,
two fp32 Adam moments).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import zerodp

LAYERS, WIDTH = int(sys.argv[2]), 512
SETTING = sys.argv[3] if len(sys.argv) > 3 else "disk"


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def main() -> None:
    nvme = sys.argv[1]
    zerodp.init_distributed()
    torch.set_num_threads(1)
    rank = dist.get_rank()
    zero = {"stage": 3, "sub_group_size": WIDTH * WIDTH // 2, "reduce_bucket_size": 4 * WIDTH * WIDTH,
            "stage3_max_live_parameters": 4 * WIDTH * WIDTH, "stage3_prefetch_bucket_size": 2 * WIDTH * WIDTH}
    if SETTING.startswith("disk"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        if SETTING == "disk+params":
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    elif SETTING == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif SETTING == "stage0":
        zero["stage"] = 0
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": zero}
    x = torch.randn(4, WIDTH)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS from here
    before = rss_kib("VmRSS")
    # built from scratch: meta=True keeps no values, so nothing is held until initialize gives each
    # unit its values (without it, Init keeps each rank's bf16 slice of every weight until then)
    with zerodp.zero.Init(config_dict_or_path=cfg, enabled=zero["stage"] == 3, meta=True):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    engine, *_ = zerodp.initialize(model=model, config=cfg, unit_classes=(nn.Linear,))
    for _ in range(3):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    peak = rss_kib("VmHWM")
    mem = engine.memory_breakdown()
    params = LAYERS * WIDTH * WIDTH
    if rank == 0:
        print("RESULT " + json.dumps({"rss_before": before * 1024, "rss_peak": peak * 1024,
                                      "memory": mem, "params": params, "model_states": 16 * params,
                                      "world": dist.get_world_size()}), flush=True)
    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

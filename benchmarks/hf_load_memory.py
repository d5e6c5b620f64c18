"""Memory of loading a pretrained model under ZeRO-3 through transformers, on 2 ranks.

    pip install torch==2.13.0 -e '.[test]' && python benchmarks/hf_load_memory.py [--layers 24]

A GPT-2 of ``--layers`` blocks of width 512 is saved with ``save_pretrained`` (safetensors), then
loaded with ``from_pretrained`` after ``TrainingArguments(deepspeed=<stage 3>)`` on 2 ranks, so
that transformers builds it inside ``deepspeed.zero.Init`` and copies the weights in on rank 0
inside ``GatheredParameters(modifier_rank=0)``:

* ``transformers, no ZeRO``: the same ``from_pretrained`` without a DeepSpeed config;
* ``DeepSpeed ZeRO-3``: the real DeepSpeed installed here (CPU accelerator), if any;
* ``zerodp ZeRO-3``: ``ZERODP_AS_DEEPSPEED=1`` in a view of this environment without DeepSpeed.

Per rank it prints the peak resident memory over the start of loading (``VmHWM`` reset there;
file pages mapped from the checkpoint count) and the anonymous memory held once loaded
(``RssAnon``: what the rank keeps), with ``MALLOC_MMAP_THRESHOLD_`` so that freed memory leaves.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import (  # noqa: E402
    RESULT_PREFIX,
    failure_reason,
    proc_status_mib,
    python_without_deepspeed,
    torchrun,
    worker_env,
)

STAGE3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def worker(model_dir: str, mode: str) -> None:
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel, TrainingArguments

    # starts the process group; held, since transformers keeps its DeepSpeed config by weak reference
    args = TrainingArguments(output_dir=os.path.join(model_dir, "out"),
                             deepspeed=None if mode == "plain" else STAGE3, use_cpu=True, report_to=[])
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS from here
    rss0, anon0 = proc_status_mib("VmRSS"), proc_status_mib("RssAnon")
    model = GPT2LMHeadModel.from_pretrained(model_dir)
    mine = {"peak": proc_status_mib("VmHWM") - rss0, "anon": proc_status_mib("RssAnon") - anon0,
            "sharded": all(p.numel() == 0 or p.is_meta for p in model.parameters())}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    del args
    if dist.get_rank() == 0:
        print(RESULT_PREFIX + json.dumps(every), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    import importlib.util

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=64, n_embd=512, n_layer=args.layers, n_head=8))
        model.save_pretrained(model_dir)
        mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20
        del model
        src = os.path.join(os.path.dirname(HERE), "src")
        base = worker_env(2, {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)})
        runs = [("transformers, no ZeRO", sys.executable, "plain", {})]
        if importlib.util.find_spec("deepspeed") is not None:
            runs.append(("DeepSpeed ZeRO-3", sys.executable, "zero3", {"DS_ACCELERATOR": "cpu"}))
        runs.append(("zerodp ZeRO-3", python_without_deepspeed(tmp), "zero3", {"ZERODP_AS_DEEPSPEED": "1"}))
        print(f"GPT-2, {args.layers} blocks of width 512: {mib:.0f} MiB of fp32 weights, loaded on 2 ranks\n")
        print("| run | rank 0 peak RSS over start | rank 1 peak | rank 0 anonymous held | rank 1 anonymous held |")
        print("|---|---|---|---|---|")
        for name, python, mode, extra in runs:
            launch = torchrun(__file__, 2, ["--worker", model_dir, mode], dict(base, **extra), timeout=900,
                              python=python)
            got = launch.result()
            if got is None:
                print(f"| {name} | failed: {failure_reason(launch)} | | | |")
                continue
            if got[0]["sharded"] != (mode == "zero3"):
                print(f"| {name} | the model came out {'sharded' if got[0]['sharded'] else 'whole'} | | | |")
                continue
            print(f"| {name} | {got[0]['peak']:.0f} MiB | {got[1]['peak']:.0f} MiB | {got[0]['anon']:.0f} MiB "
                  f"| {got[1]['anon']:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()

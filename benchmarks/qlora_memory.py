"""Memory per rank of QLoRA at ZeRO-3: a 4-bit base loaded whole, then sharded by ``initialize``,
against one loaded sharded (``zerodp.zero.ShardedLoad``), on 1, 2 and 4 CPU ranks.

    pip install torch==2.13.0 -e '.[test]' && python benchmarks/qlora_memory.py [--layers 16] [--steps 2]

A Llama of ``--layers`` blocks (width 1024, MLP 2816, vocabulary 4000) is quantized to 4 bits by
bitsandbytes (nf4, double quantization, codes stored as uint8) and saved with ``save_pretrained``,
as 4-bit models are published. Each rank then loads it with ``from_pretrained`` (plainly, or inside
``ShardedLoad``), puts LoRA adapters on its attention projections (peft), and trains ``--steps``
AdamW steps at stage 3 (fp32, 2 sequences of 64 tokens a rank), with prefetching, reuse and live
parameters sized to one or two blocks, as DeepSpeed's defaults (counted in elements) stand to a model
of tens of billions of parameters: left at those defaults, this small model would stay gathered
whole through forward and backward.

Per rank (the largest over the ranks is shown; they differ by little) it prints: the resident
memory before loading; the peak over the load (``VmHWM``, reset by ``/proc/self/clear_refs`` at its
start, less the memory before it), in which the checkpoint file's pages, mapped by transformers while
it loads, count on every rank; the anonymous memory the load left (``RssAnon``: what the rank keeps
of the model); and the peak over the whole run (load, ``initialize``, the steps). Workers run with
``MALLOC_MMAP_THRESHOLD_`` so that freed memory leaves.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import RESULT_PREFIX, failure_reason, proc_status_mib, torchrun, worker_env  # noqa: E402

WIDTH, MLP, VOCAB, SEQ, MICRO = 1024, 2816, 4000, 64, 2


def _quantization():
    import torch
    from transformers import BitsAndBytesConfig
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)


class AnonPeak:
    """The largest ``RssAnon`` seen by a thread that reads it every few milliseconds: the private
    memory a rank holds at its peak, without the checkpoint's file pages that ``VmHWM`` counts."""

    def __init__(self) -> None:
        import threading
        self.peak, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, proc_status_mib("RssAnon"))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, proc_status_mib("RssAnon"))


def worker(model_dir: str, mode: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    import zerodp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS from here
    rss0, anon0 = proc_status_mib("VmRSS"), proc_status_mib("RssAnon")
    anon = AnonPeak()
    kwargs = {"quantization_config": _quantization(), "dtype": torch.float32}
    if mode == "sharded":
        with zerodp.zero.ShardedLoad():
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    mine = {"before": rss0, "load_peak": proc_status_mib("VmHWM") - rss0, "held": proc_status_mib("RssAnon") - anon0}
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj"])).train()
    block = sum(p.numel() for p in model.base_model.model.model.layers[0].parameters())  # codes count as bytes
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": block, "stage3_max_reuse_distance": block,
                                 "stage3_max_live_parameters": 2 * block}}
    engine, *_ = zerodp.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                   config=cfg)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    mine["run_peak"] = proc_status_mib("VmHWM")
    mine["anon_peak"] = anon.stop()
    mine["loss"] = loss.item()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    engine.destroy()
    if rank == 0:
        print(RESULT_PREFIX + json.dumps(every), flush=True)
    dist.destroy_process_group()


def save_quantized(model_dir: str, layers: int) -> tuple[float, float]:
    """Save the 4-bit model; returns (MiB of packed codes, MiB of the checkpoint file)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    full_dir = model_dir + "-full"
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=WIDTH, intermediate_size=MLP, num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=VOCAB, max_position_embeddings=SEQ,
                         bos_token_id=0, eos_token_id=0, pad_token_id=None, attn_implementation="sdpa")
    LlamaForCausalLM(config).save_pretrained(full_dir)
    model = AutoModelForCausalLM.from_pretrained(full_dir, quantization_config=_quantization(), dtype=torch.float32)
    packed = sum(p.numel() * p.element_size() for p in model.parameters() if type(p).__name__ == "Params4bit")
    model.save_pretrained(model_dir)
    size = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    return packed / 2**20, size / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL_DIR", "MODE", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        packed, size = save_quantized(model_dir, args.layers)
        print(f"Llama, {args.layers} blocks of width {WIDTH}, 4-bit (nf4, uint8 codes): {packed:.0f} MiB of packed "
              f"codes, a {size:.0f} MiB checkpoint; LoRA r=8 on q/v, stage 3, {args.steps} steps\n")
        print("| ranks | load | RSS before load | peak over the load | anonymous held after the load "
              "| peak over load + initialize + steps | anonymous peak over them |")
        print("|---|---|---|---|---|---|---|")
        src = os.path.join(os.path.dirname(HERE), "src")
        for world in [int(w) for w in args.worlds.split(",")]:
            path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
            env = worker_env(world, {"PYTHONPATH": path})
            for mode in ("plain", "sharded"):
                launch = torchrun(__file__, world, ["--worker", model_dir, mode, str(args.steps)], env, timeout=600)
                got = launch.result()
                if got is None:
                    print(f"| {world} | {mode} | failed: {failure_reason(launch)} | | | | |", flush=True)
                    continue
                top = {k: max(r[k] for r in got) for k in ("before", "load_peak", "held", "run_peak", "anon_peak")}
                print(f"| {world} | {mode} | {top['before']:.0f} MiB | {top['load_peak']:.0f} MiB "
                      f"| {top['held']:.0f} MiB | {top['run_peak']:.0f} MiB | {top['anon_peak']:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()

"""The longest sequence a small Llama trains at Ulysses sequence-parallel sizes 1, 2 and 4 within a
fixed memory budget per rank, with and without ALST's tiled MLP and tiled loss and checkpointed
activations in host memory, and the step time at it.

Each (size, variant, length) runs in fresh ``torchrun`` processes (one rank per sequence-parallel
rank, data parallelism 1, ZeRO stage 3, fp32, AdamW), one warm-up step and one timed step. On the
CPU, glibc returns freed memory (``MALLOC_MMAP_THRESHOLD_``) and a rank's peak is its resident
set's high-water mark during the two steps (reset after set-up through ``/proc/self/clear_refs``)
over the RSS after set-up; on a GPU (``--device cuda``) it is the allocator's peak over what was
allocated after set-up. Either way: what the step adds (activations, logits, gathered parameters).
The length doubles from ``--start`` until a run's largest peak passes ``--budget-mib`` or fails; the
table gives the longest that fitted.

    python benchmarks/sequence.py                        # sizes 1 2 4, budget 1024 MiB per rank, up to 16384
    python benchmarks/sequence.py --sps 1 2 --budget-mib 1024 --start 1024
    python benchmarks/sequence.py --device cuda --sps 1 --budget-mib 40000 --start 8192 --max-length 262144

Variants (``--variants``): ``plain`` (the stock model), ``tiled`` (every MLP's forward through
``TiledMLP``, the logits and loss through ``TiledFusedLogitsLoss``; tiles: ceil(local length /
hidden size), DeepSpeed's recipe), ``tiled+ckpt`` (and the Trainer's kind of gradient
checkpointing) and ``tiled+ckpt+offload`` (and ``activation_checkpointing.cpu_checkpointing``: the
layers' inputs wait in host memory). On the CPU the activations already live in host memory, so
the last two measure the same. Sequence parallelism is run through DeepSpeed's Hugging Face face
(``UlyssesSPAttentionHF``, sdpa).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

#: (hidden, layers, heads, key/value heads, MLP width, vocabulary): a small Llama for the CPU, and
#: Llama-3.2-1B's shapes for a GPU
PRESETS = {"tiny": (256, 4, 8, 4, 1024, 8192), "1b": (2048, 16, 32, 8, 8192, 128256)}
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = PRESETS[os.environ.get("SEQUENCE_BENCH_PRESET", "tiny")]


VARIANTS = ("plain", "tiled", "tiled+ckpt", "tiled+ckpt+offload")


def worker(sp: int, variant: str, seq: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaMLP

    import zerodp
    from zerodp.core.collectives import all_gather_numbers
    from zerodp.parallel.sequence_hf import UlyssesSPAttentionHF
    from zerodp.parallel.tiled import TiledFusedLogitsLoss, TiledMLP

    cuda = _common.start_worker()
    rank = dist.get_rank()
    tiled, ckpt, offload = variant != "plain", "ckpt" in variant, "offload" in variant
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                         num_key_value_heads=KV_HEADS, max_position_embeddings=seq,
                                         attn_implementation="sdpa"))
    local = seq // sp
    shards = max(1, math.ceil(local / HIDDEN))
    if tiled:
        for layer in model.model.layers:
            mlp = layer.mlp
            mlp.forward = (lambda x, mlp=mlp: TiledMLP.apply(lambda m, t: LlamaMLP.forward(m, t), mlp, x, shards,
                                                             list(mlp.parameters())))
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1) if sp > 1 else None
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "activation_checkpointing": {"cpu_checkpointing": offload},
              "zero_optimization": {"stage": 3}}
    engine, _, _, _ = zerodp.initialize(model=model, config=config, mpu=mpu)
    engine.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, seq + 1), generator=g)
    me = rank % sp
    cut = slice(me * local, (me + 1) * local)
    dev = engine.device
    inputs, labels = ids[:, :-1][:, cut].contiguous().to(dev), ids[:, 1:][:, cut].contiguous().to(dev)
    positions = torch.arange(seq)[cut].unsqueeze(0).to(dev)

    def step() -> float:
        if tiled:
            # through the model itself (its root unit's hooks), the logits of one position alone
            hidden = engine(input_ids=inputs, position_ids=positions, logits_to_keep=1,
                            output_hidden_states=True).hidden_states[-1]
            head = engine.module.lm_head
            loss = TiledFusedLogitsLoss.apply(lambda m, h, y: F.cross_entropy(m(h), y, reduction="sum"), head,
                                              hidden, labels, None, shards, list(head.parameters()), "sum")
            loss = loss / labels.numel()
        else:
            logits = engine(input_ids=inputs, position_ids=positions).logits
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        engine.backward(loss)
        engine.step()
        return loss.item()

    meter = _common.AddedPeak(cuda)
    step()
    meter.sync()
    t0 = time.perf_counter()
    step()
    meter.sync()
    seconds = time.perf_counter() - t0
    peak = meter.mib()
    rows = all_gather_numbers({"peak": peak, "seconds": seconds})
    if rank == 0:
        print(_common.RESULT_PREFIX + json.dumps({"peak_mib": max(r["peak"] for r in rows),
                                                  "seconds": max(r["seconds"] for r in rows)}), flush=True)
    engine.destroy()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sps", type=int, nargs="+", default=[1, 2, 4], help="sequence-parallel sizes (default 1 2 4)")
    ap.add_argument("--budget-mib", type=float, default=1024, help="memory a step may add per rank (default 1024)")
    ap.add_argument("--start", type=int, default=2048, help="the first length tried (default 2048)")
    ap.add_argument("--max-length", type=int, default=16384, help="the longest length tried (default 16384)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before a run is killed (default 600)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                    help="what runs at each size (default: plain tiled tiled+ckpt+offload)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: one rank per GPU (NCCL), the allocator's peak (default cpu)")
    ap.add_argument("--preset", choices=list(PRESETS), default="tiny",
                    help="model shapes: tiny (4 layers, hidden 256) or 1b (Llama-3.2-1B's) (default tiny)")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        sp, variant, seq = args.worker
        worker(int(sp), variant, int(seq))
        return
    variants = args.variants or ["plain", "tiled", "tiled+ckpt+offload"]
    rows = []
    t0 = time.perf_counter()
    for sp in args.sps:
        for variant in variants:
            best = None
            seq = args.start
            while seq <= args.max_length:
                env = _common.worker_env(sp, memory=args.device == "cpu", extra={"SEQUENCE_BENCH_PRESET": args.preset})
                if args.device == "cpu":
                    env["CUDA_VISIBLE_DEVICES"] = ""
                launch = _common.torchrun(__file__, sp, ["--worker", str(sp), variant, str(seq)], env,
                                          timeout=args.timeout)
                got = launch.result()
                status = "ok" if got else _common.failure_reason(launch)
                fits = got is not None and got["peak_mib"] <= args.budget_mib
                print(f"sp {sp} {variant} length {seq}: "
                      + (f"{got['peak_mib']:.0f} MiB, {got['seconds']:.2f} s" if got else status), flush=True)
                if not fits:
                    break
                best = (seq, got)
                seq *= 2
            rows.append((sp, variant, best))
    print(f"\n`python benchmarks/sequence.py --preset {args.preset} --device {args.device} "
          f"--sps {' '.join(map(str, args.sps))} --budget-mib {args.budget_mib:g} --start {args.start} "
          f"--variants {' '.join(variants)}` "
          f"({(time.perf_counter() - t0) / 60:.1f} min)\n")
    hidden, layers, heads, kv_heads, _, vocab = PRESETS[args.preset]
    print(f"Llama {layers} layers, hidden {hidden}, {heads} heads ({kv_heads} key/value), vocabulary {vocab}; "
          f"ZeRO stage 3, fp32, one sequence per step; budget {args.budget_mib:g} MiB added per rank\n")
    print("| sequence-parallel ranks | variant | longest length within budget | peak added per rank (MiB) "
          "| step (s) |")
    print("|---|---|---|---|---|")
    for sp, variant, best in rows:
        if best is None:
            print(f"| {sp} | {variant} | under {args.start} | - | - |")
        else:
            seq, got = best
            print(f"| {sp} | {variant} | {seq} | {got['peak_mib']:.0f} | {got['seconds']:.2f} |")


if __name__ == "__main__":
    main()

"""The common ZeRO advice checked with ``zerodp estimate --time``: "< 7B: ZeRO-1; 7-13B: ZeRO-2;
30-70B: ZeRO-3; > 70B: ZeRO-3 + offload" on one 8 x A100 80 GB node, and "5 x 44 GB GPUs, 8B full
fine-tune: ZeRO-2 does not fit, use ZeRO-3".

    python benchmarks/advice_table.py

Models are Llama-shaped ``transformers`` configs built on the meta device (no download): Llama 3.2
3B, Llama 2 7B and 13B, Code Llama 34B, Llama 2 70B, and a 180B of Falcon 180B's width and depth
with Llama's layers. Every run: bf16 with fp32 master weights and AdamW, sequence 4,096, fused
attention (no scores kept), global batch 64 sequences (60 on 5 GPUs); the
configuration is the fastest layout that fits (``--search``: TP, PP, micro-batch, checkpointing,
stage, offload), and beside it the fastest plain data-parallel one (TP 1, PP 1) per stage.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

from zerodp.estimator.search import rank_layouts

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
         "max_position_embeddings": 4096, "tie_word_embeddings": False}
MODELS = {  # name: hidden, layers, heads, kv heads, ffn, vocab
    "Llama 3.2 3B": (3072, 28, 24, 8, 8192, 128256),
    "Llama 2 7B": (4096, 32, 32, 32, 11008, 32000),
    "Llama 2 13B": (5120, 40, 40, 40, 13824, 32000),
    "Code Llama 34B": (8192, 48, 64, 8, 22016, 32016),
    "Llama 2 70B": (8192, 80, 64, 8, 28672, 32000),
    "180B": (14848, 80, 116, 8, 40192, 65024),
}
#: 5 GPUs of 44 GB usable (48 GB cards such as the L40S or A6000), PCIe between them, one node
FIVE_44 = {"name": "5x44GB", "devices_per_node": 5, "flops": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
           "gemm_efficiency": 0.5, "device_memory": 44 * 10**9, "memory_bandwidth": 864e9,
           "intra_bandwidth": 20e9, "inter_bandwidth": 20e9, "host_bandwidth": 20e9, "cpu_memory": 512 * 10**9,
           "description": "5 x 48 GB PCIe GPUs, 44 GB usable each, PCIe 4 between them"}


def config_dir(root: str, name: str, shape: tuple) -> str:
    hidden, layers, heads, kv, ffn, vocab = shape
    path = os.path.join(root, name.replace(" ", "_").replace("(", "").replace(")", "").replace("'", ""))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**LLAMA, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                   "num_key_value_heads": kv, "intermediate_size": ffn, "vocab_size": vocab}, f)
    return path


def per_stage(found) -> str:
    """The fastest plain data-parallel layout of each stage (and offload) that fits."""
    best: dict = {}
    for lay in found.layouts:
        if lay.tp == 1 and lay.pp == 1:
            best.setdefault(lay.row.label, lay.row.step_time.step_time_s)
    if not best:
        return "none fits"
    fastest = min(best.values())
    return ", ".join(f"{k} {v / fastest:.2f}x" for k, v in sorted(best.items(), key=lambda kv: kv[1]))


def main() -> int:
    root = tempfile.mkdtemp(prefix="advice_")
    print("| model | cluster | fastest layout that fits | step (s) | tokens/s per GPU | data-parallel only, "
          "stage by stage (step time / the fastest) |")
    print("|---|---|---|---|---|---|")
    cases = [(name, shape, "a100-80gb-8x") for name, shape in MODELS.items()]
    cases.append(("Llama 3.1 8B", (4096, 32, 32, 8, 14336, 128256), FIVE_44))
    for name, shape, cluster in cases:
        found = rank_layouts(config_dir(root, name, shape), cluster=cluster, global_batch=60 if cluster is FIVE_44
                             else 64, seq_len=4096, micro_batches=(1, 2, 4), fused_attention=True)
        label = cluster if isinstance(cluster, str) else cluster["name"]
        if not found.layouts:
            print(f"| {name} | {label} | nothing fits | - | - | - |")
            continue
        best = found.layouts[0]
        t = best.row.step_time
        print(f"| {name} | {label} | {best.label} | {t.step_time_s:.2f} | {t.tokens_per_s_per_device:,.0f} | "
              f"{per_stage(found)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

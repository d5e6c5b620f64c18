#!/usr/bin/env bash
# The GPU checks, in one script, on a machine with one CUDA GPU (about 8 minutes on an H100):
#
#   bash benchmarks/gpu_check.sh [setup] [tests] [sanitizer] [bench] [largest] [sequence] [experts] [compile] [muon]  # default: all
#
#   setup      install zerodp (editable, no network: its dependencies must be there already, or
#              lie as wheels in .whl/ at the repository root, which this installs first)
#   tests      the CUDA tier: pytest -m cuda tests/cuda (NCCL with one rank; two ranks on gloo)
#   sanitizer  stage 3 and offload cases again under TORCH_CUDA_SANITIZER=1 (torch's stream checker)
#   bench      benchmarks/gpu_throughput.py: tokens/s and MFU, zerodp against FSDP2 with CPU offload
#   largest    the largest Llama that trains a step with optimizer and parameters in host memory
#   sequence   benchmarks/sequence.py on one GPU: the longest sequence Llama-3.2-1B's shapes train in
#              40 GiB added, stock, and with the tiled MLP and loss, checkpointing and activation offload
#   experts    zerodp simulate on the GPU: one rank of 8 training a 4-layer Qwen3-30B-A3B-shaped MoE
#              (128 experts, top-8) at stage 3, bf16, 2048 tokens, with experts over 1, 2, 4, 8 ranks:
#              the rank's peak device memory and the bytes it sends per step
#   compile    benchmarks/compile.py on one GPU: GPT-2 small's shapes, bf16, each stage uncompiled and
#              compiled (engine.compile; at stage 3 also block by block) against FSDP2 with its blocks
#              compiled: tokens/s, MFU (H200's 989 dense bf16 TFLOPS), compile time apart, recompiles
#   muon       benchmarks/muon.py on one GPU: Muon's update (fp16 Gram Newton-Schulz) against AdamW's
#
# Logs go to $OUT (or ./gpu_check_out): tests.log, sanitizer.log, bench.log, and JSON/XML beside.
# Each phase's time limit in seconds can be set: T_TESTS (300), T_SANITIZER (150), T_BENCH (170),
# T_LARGEST (260), T_SEQUENCE (240), T_EXPERTS (150), T_COMPILE (300), T_MUON (120); the benchmarks' own budgets are 10 s less.
#
# A machine without pydantic (a CUDA image with torch, transformers, peft, accelerate and Lightning,
# and no network) needs its wheels in .whl/, fetched where the network is, for that machine's Python
# (3.12 here), e.g.:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl pydantic==2.14.4 pydantic-core==2.50.5 \
#       annotated-types typing-inspection typing-extensions
# (pydantic pins its pydantic-core exactly: `unzip -p .whl/pydantic-*.whl '*/METADATA' | grep Requires`).
# On one H200 (torch 2.11, three runs): setup 20 s, tests 130 s, sanitizer 27 s, bench 85 s,
# largest (7B) 52 s.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
PHASES="${*:-setup tests sanitizer bench largest sequence experts compile muon}"
has() { case " $PHASES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
stamp() { echo "== $(date +%T) $*"; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
status=0

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
echo "host memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), cpus: $(nproc)"

if has setup; then
  stamp "setup"
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || status=1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || status=1
  "$PY" -c "import zerodp, pydantic, transformers, peft, accelerate; print('zerodp', zerodp.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| accelerate', accelerate.__version__)" || status=1
fi

if has tests; then
  stamp "tests: pytest -m cuda tests/cuda"
  timeout "${T_TESTS:-300}" "$PY" -m pytest -m cuda tests/cuda -p no:cacheprovider -rfEs -v --durations=8 \
      --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|slowest|s (call|setup)" | tail -70
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if has sanitizer; then
  stamp "sanitizer: stage 3 and offload under TORCH_CUDA_SANITIZER=1"
  P=tests/cuda/test_cuda_parity.py; O=tests/cuda/test_cuda_offload.py
  TORCH_CUDA_SANITIZER=1 timeout "${T_SANITIZER:-150}" "$PY" -m pytest -m cuda -p no:cacheprovider -rfE -q \
      "$P::test_fp32_parity[3]" "$P::test_mixed_precision_parity[3-bf16]" \
      "$P::test_stage3_prefetch_off_gives_the_same_numbers" "$P::test_overlap_comm_off_gives_the_same_numbers[2]" \
      "$O::test_offload_gives_the_numbers_of_the_gpu_run[3-fp32-cpu-True]" \
      "$O::test_offload_gives_the_numbers_of_the_gpu_run[3-fp32-nvme-False]" \
      "$O::test_offload_gives_the_numbers_of_the_gpu_run[2-bf16-cpu-False]" \
      2>&1 | tee "$OUT/sanitizer.log" | tail -25
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if has bench; then
  stamp "bench: one GPU, 1B Llama, bf16"
  T=${T_BENCH:-170}; timeout "$T" "$PY" benchmarks/gpu_throughput.py --size 1b --seq 2048 --batch 4 --steps 4 --budget $((T - 10)) \
      --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -20
fi

if has largest; then
  stamp "largest: Llama 7B with optimizer and parameters in host memory"
  T=${T_LARGEST:-260}; timeout "$T" "$PY" benchmarks/gpu_throughput.py --systems --largest "${LARGEST:-7b}" --seq 2048 --budget $((T - 10)) \
      --json "$OUT/largest.json" 2>&1 | tee "$OUT/largest.log" | tail -12
fi

if has sequence; then
  stamp "sequence: the longest sequence on one GPU, stock against tiled, checkpointed and offloaded"
  T=${T_SEQUENCE:-240}; timeout "$T" "$PY" benchmarks/sequence.py --device cuda --preset 1b --sps 1 \
      --variants plain tiled+ckpt tiled+ckpt+offload --budget-mib 40960 --start 8192 --max-length 262144 \
      --timeout 60 2>&1 | tee "$OUT/sequence.log" | tail -12
fi

if has experts; then
  stamp "experts: one rank of 8, a Qwen3-30B-A3B-shaped MoE at stage 3, experts over 1, 2, 4 and 8 ranks"
  cat > "$OUT/qwen3moe_4l.json" <<'JSON'
{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
 "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
 "num_hidden_layers": 4, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
 "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": false, "norm_topk_prob": true}
JSON
  T=${T_EXPERTS:-150}
  for ep in 1 2 4 8; do
    timeout $((T / 4)) "$PY" -m zerodp.tools.cli simulate --model "$OUT/qwen3moe_4l.json" --world 8 --stage 3 \
        --seq 2048 --precision bf16 --ep $ep --json > "$OUT/experts_ep$ep.json" 2>> "$OUT/experts.log" || status=1
  done
  "$PY" - "$OUT" <<'PYEOF' | tee -a "$OUT/experts.log"
import json, sys
print(f"{'ep':>3} {'peak GiB':>9} {'states GiB':>11} {'sent GiB/step':>14} {'all-to-all GiB':>15} {'s':>6}")
for ep in (1, 2, 4, 8):
    try:
        r = json.load(open(f"{sys.argv[1]}/experts_ep{ep}.json"))
    except (OSError, ValueError):
        print(f"{ep:>3} failed"); continue
    a2a = r["collectives"].get("expert", {}).get("all_to_all", 0)
    print(f"{ep:>3} {r['peak'] / 2**30:>9.2f} {r['model_states'] / 2**30:>11.2f} {r['bytes_per_step'] / 2**30:>14.2f} "
          f"{a2a / 2**30:>15.3f} {r['seconds']:>6.1f}")
PYEOF
fi

if has compile; then
  stamp "compile: one GPU, GPT-2 small shapes, bf16, compiled against uncompiled, zerodp against FSDP2"
  T=${T_COMPILE:-300}; timeout "$T" "$PY" benchmarks/compile.py --device cuda --world 1 --preset gpt2 --micro-batch 8 \
      --steps 6 --bf16 --peak-tflops 989 --timeout $(((T - 10) / 5)) 2>&1 | tee "$OUT/compile.log" | tail -16
fi

if has muon; then
  stamp "muon: one GPU, the medium GPT, Muon (fp16 Gram iterations) against AdamW"
  T=${T_MUON:-120}; timeout "$T" "$PY" benchmarks/muon.py --device cuda --worlds 1 --stage 1 --preset medium \
      --steps 6 --timeout $((T - 10)) 2>&1 | tee "$OUT/muon.log" | tail -6
fi

stamp "done (status $status)"
exit $status

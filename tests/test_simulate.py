"""``zerodp simulate``: one rank of N run in this machine's memory over a fake process group.

The simulated rank runs zerodp's own engine; its ledger must show the ZeRO accounting (16Ψ/N at
stage 3 with bf16 AdamW, the padding aside), agree with ``zerodp estimate`` to within 1% on model
states, stay under the estimate's bounds for buffers and the peak, and issue the same number of
collectives per step whatever N.
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
         "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 3,
         "vocab_size": 512, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
STATES = ("parameters", "gradients", "master_weights", "optimizer_states")


def _run(jobs: list[dict]) -> list[dict]:
    out = subprocess.run([sys.executable, os.path.join(HERE, "simulate_script.py"), json.dumps(jobs)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


@pytest.fixture(scope="module")
def stage3(llama):
    return _run([{"model": llama, "world": n, "stage": 3, "seq": 16} for n in (8, 64, 1024)]
                + [{"model": llama, "world": 64, "stage": 3, "seq": 16, "tp": 4}])


def test_stage3_model_states_are_16_psi_over_n(stage3):
    for r in stage3[:3]:
        psi, n = r["params"], r["world"]
        assert r["params"] == stage3[0]["params"] > 0
        # bf16 params 2 + grads 2 + fp32 master 4 + Adam m, v 8, each a 1/N shard (plus padding:
        # under 16 bytes per flat group and kind)
        assert 16 * psi / n <= r["model_states"] <= 16 * psi / n + 64 * 16 * 4, r
        assert r["parameters"] * 4 == r["optimizer_states"] and r["master_weights"] * 2 == r["optimizer_states"]


def test_stage3_agrees_with_the_estimate(stage3):
    for r in stage3:
        est = r["estimated"]
        for k in STATES:
            assert abs(r[k] - est[k]) <= 0.01 * est[k] + 1024, (r["world"], r["tp"], k, r[k], est[k])
        assert abs(r["model_states"] - est["model_states"]) <= 0.01 * est["model_states"] + 4096
        # the estimate's buffers are bounds: every bucket in flight, every prefetched unit at once
        padding = r["world"] * 16 * 32  # gathered buffers hold N padded shards (estimate: unpadded)
        assert 0 < r["gathered_parameters_peak"] <= est["gathered_parameters"] + padding, r
        assert 0 < r["gradient_buckets_peak"] <= est["gradient_buckets"] + padding, r
        # the peak: what the estimate counts, less the bounds' slack, plus temporaries it leaves out
        # (the fp32 loss, the optimizer's and the norm's scratch: a few % of a model this small)
        assert r["model_states"] + r["gathered_parameters_peak"] <= r["peak"] <= 1.1 * est["device_total"], r


def test_collectives_per_step_do_not_grow_with_n(stage3):
    calls = {r["world"]: r["collectives_per_step"] for r in stage3[:3]}
    assert len(set(calls.values())) == 1 and calls[8] > 0, calls
    per_group = {r["world"]: r["collectives"]["data"]["calls"] for r in stage3[:3]}
    assert len(set(per_group.values())) == 1, per_group
    # ring bytes per rank: B(N-1)/N per all-gather/reduce-scatter, so nearly flat in N
    sent = [r["bytes_per_step"] for r in stage3[:3]]
    assert sent[0] < sent[1] < sent[2] < 1.25 * sent[0], sent  # (N grows 128x; padding grows with N)


def test_tensor_parallel_grid(stage3):
    r = stage3[3]
    assert (r["tp"], r["dp"]) == (4, 16)
    assert r["params"] < stage3[1]["params"]  # this rank holds its tensor slice
    assert r["collectives"]["tensor"]["calls"] > 0 and r["collectives"]["data"]["calls"] > 0


def test_pipeline_stages(llama, stage3):
    """TP 2 x PP 2 x DP 4: a rank of each pipeline stage holds its stage's layers (together the
    whole model, each split over the tensor ranks) sharded over its 4 data-parallel ranks."""
    runs = _run([{"model": llama, "world": 16, "stage": 3, "seq": 16, "tp": 2, "pp": 2, "rank": r} for r in (0, 15)])
    first, last = runs
    assert (first["pipeline_stage"], last["pipeline_stage"], first["dp"]) == (0, 1, 4)
    whole = stage3[0]["params"]
    h, layers = LLAMA["hidden_size"], LLAMA["num_hidden_layers"]
    split = h * (4 * h + 3 * LLAMA["intermediate_size"]) * layers  # q, k, v, o and the MLP
    split += 2 * LLAMA["vocab_size"] * h  # the embedding's and the output layer's vocabulary
    assert first["params"] + last["params"] == whole - split // 2  # the split matrices halved by TP
    for r in runs:
        assert 16 * r["params"] / 4 <= r["model_states"] <= 16 * r["params"] / 4 + 64 * 16 * 4, r
        # the whole stage stays gathered through the step's micro-batches
        assert r["gathered_parameters_peak"] >= 2 * r["params"], r
        assert r["p2p_bytes"] == 2 * 16 * LLAMA["hidden_size"] * 2  # 2 micro-batches, bf16, one direction
        assert r["collectives"]["tensor"]["calls"] > 0 and r["collectives"]["data"]["calls"] > 0


def test_stages_1_and_2_and_offload(llama):
    runs = _run([{"model": llama, "world": 8, "stage": s, "seq": 16} for s in (1, 2)]
                + [{"model": llama, "world": 8, "stage": 3, "seq": 16, "offload": "optimizer+params"}])
    off = runs.pop()
    est = off["estimated"]  # device columns: nothing but gradients; the rest on the host
    assert abs(off["categories"]["model_states_on_compute"] - est["model_states"]) <= 0.01 * est["model_states"] + 1024
    assert abs(off["categories"]["model_states_on_host"] - est["cpu"]) <= 0.01 * est["cpu"] + 1024
    for r in runs:
        for k in STATES:
            assert abs(r[k] - r["estimated"][k]) <= 0.01 * r["estimated"][k] + 1024, (r["stage"], k)
        assert r["model_states"] < r["peak"] <= 1.1 * r["estimated"]["device_total"], r
    one, two = runs
    assert abs(one["gradients"] - 8 * two["gradients"]) <= 1024, (one["gradients"], two["gradients"])  # 2Ψ vs 2Ψ/N


def test_cli(llama):
    out = subprocess.run([sys.executable, "-m", "zerodp.tools.cli", "simulate", "--model", llama, "--world", "16",
                          "--stage", "3", "--seq", "8", "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rank 0 of 16" in out.stdout and "model states" in out.stdout and "collectives per step" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "zerodp.tools.cli", "simulate", "--model", llama, "--world", "16",
                          "--stage", "3", "--pp", "3"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--tp" in bad.stderr and "does not divide" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
    for grid in (["--tp", "8", "--pp", "2"],):  # 4 heads do not split over 8 ranks (--tp alone: the next test)
        heads = subprocess.run([sys.executable, "-m", "zerodp.tools.cli", "simulate", "--model", llama, "--world",
                                "16", "--stage", "3", *grid], capture_output=True, text=True, timeout=300)
        assert heads.returncode == 2 and "4 attention heads do not split over 8" in heads.stderr, heads.stderr[-800:]


def test_sequence_parallel_ranks_hold_their_slice_of_the_activations(llama):
    """Ulysses over 4 of 8 ranks: the same model states (ZeRO over all 8), a quarter of the tokens
    per rank, so what the step adds to them shrinks by well over half."""
    one, four = _run([{"model": llama, "world": 8, "stage": 3, "seq": 512, "precision": "fp32", "sp": sp}
                      for sp in (1, 4)])
    assert four["sp"] == 4 and four["model_states"] == one["model_states"]
    assert four["peak"] - four["at_start"] < 0.5 * (one["peak"] - one["at_start"]), (one["peak"], four["peak"])
    code = ("import json, warnings; warnings.simplefilter('ignore')\n"
            "import torch.distributed as dist\n"
            "from zerodp.estimator import EstimateError\n"
            "from zerodp.tools.simulate import simulate\n"
            "out = []\n"
            f"for model, seq in (({llama!r}, 30), ('zerodp.examples.gpt:build_gpt', 32)):\n"
            "    try:\n"
            "        simulate(model, world=8, stage=3, seq=seq, sp=2 if seq == 32 else 4, steps=1)\n"
            "    except EstimateError as e:\n"
            "        out.append([e.name, e.detail, dist.is_initialized()])\n"
            "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seq, factory = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seq[:1] == ["seq"] and "30 tokens do not split over the 4" in seq[1] and not seq[2]
    assert factory[:1] == ["sp"] and "transformers causal LM" in factory[1] and not factory[2]  # group ended


def test_a_failed_simulation_ends_its_process_group(llama):
    """The Python API: a simulation that fails (heads that do not split) leaves no process group
    behind, so the next one in the same process runs."""
    code = ("import warnings, json; warnings.simplefilter('ignore')\n"
            "import torch.distributed as dist\n"
            "from zerodp.tools.simulate import simulate\n"
            "try:\n"
            f"    simulate({llama!r}, world=16, stage=3, tp=16, seq=8, steps=1)\n"
            "    raised = False\n"
            "except Exception:\n"
            "    raised = True\n"
            "after = dist.is_initialized()\n"
            f"s = simulate({llama!r}, world=16, stage=3, seq=8, steps=1)\n"
            "print(json.dumps([raised, after, s.model_states]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    raised, after, states = json.loads(out.stdout.strip().splitlines()[-1])
    assert raised and not after and states > 0


QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128,
             "intermediate_size": 256, "moe_intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 32, "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 512,
             "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def test_expert_parallel_ranks_hold_and_gather_their_experts_only(tmp_path):
    """Qwen3-MoE (8 experts) at stage 3 on 8 ranks: with the experts over groups of 4, the model
    states per rank stay (ZeRO shards either way), the rank gathers a quarter of the experts, so the
    bytes it sends and its peak shrink, and its tokens go to their experts by all-to-all."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_MOE))
    one, four = _run([{"model": str(path), "world": 8, "stage": 3, "seq": 32, "precision": "fp32", "ep": ep}
                      for ep in (1, 4)])
    assert four["ep"] == 4 and abs(four["model_states"] - one["model_states"]) <= 0.01 * one["model_states"]
    assert four["bytes_per_step"] < 0.5 * one["bytes_per_step"], (one["bytes_per_step"], four["bytes_per_step"])
    assert four["peak"] < 0.75 * one["peak"], (one["peak"], four["peak"])
    assert four["collectives"]["expert"]["all_to_all"] > 0 and "expert" not in one["collectives"]
    assert four["collectives"]["data"]["calls"] == one["collectives"]["data"]["calls"]  # the dense ones

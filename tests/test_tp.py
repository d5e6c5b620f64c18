"""Tensor parallelism and hybrid sharding composed with ZeRO: parity with one process.

Every case runs on the pool's 4 ranks as a grid (tensor x data, or shard x replica) and is
compared with the same model trained in one process on the whole global batch
(``tp_tasks.reference``), with gradient accumulation and clipping that binds (the norms are
above the clip). SGD with momentum carries every gradient error into the parameters linearly,
so those cases are held to 1e-6. Under AdamW a parameter whose exact gradient is zero (the key
projection's bias: softmax ignores a shift shared by all keys) gets rounding noise for a gradient,
which Adam's normalization turns into an update of up to lr x noise / eps; splitting the matmuls
over ranks changes that noise, so AdamW cases are held to 3e-5.
"""
from __future__ import annotations

import pytest
import torch
from tp_tasks import (
    VOCAB,
    embedding_backward_rows,
    grid_round_trip,
    megatron_reference,
    megatron_train,
    mismatched_batch,
    reference,
    save_and_export,
    train,
)

import zerodp

STEPS, GAS, CLIP = 3, 2, 0.5


def assert_matches(results, ref, atol, norm_rtol=1e-6):
    for rank, res in enumerate(results):
        assert sorted(res["params"]) == sorted(ref["params"])
        for name, want in ref["params"].items():
            err = (res["params"][name] - want).abs().max().item()
            assert err <= atol, f"rank {rank} param {name}: max |diff| {err:.3g} > {atol}"
        for step, (got, want) in enumerate(zip(res["norms"], ref["norms"])):
            assert got == pytest.approx(want, rel=norm_rtol), f"rank {rank} step {step} grad norm"
    assert min(ref["norms"]) > CLIP  # clipping binds


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tp2_dp2_example_gpt(pool, stage):
    results = pool.run(train, 4, "gpt", stage, 2, STEPS, gas=GAS, clip=CLIP, optimizer_name="SGD")
    assert [(r["dp_rank"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_matches(results, reference("gpt", 2, STEPS, GAS, CLIP, "SGD"), atol=1e-6)


def test_tp4_dp1(pool):
    results = pool.run(train, 4, "gpt", 2, 4, STEPS, gas=GAS, clip=CLIP, optimizer_name="SGD")
    assert_matches(results, reference("gpt", 1, STEPS, GAS, CLIP, "SGD"), atol=1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_tp2_dp2_adamw(pool, stage):
    results = pool.run(train, 4, "gpt", stage, 2, STEPS, gas=GAS, clip=CLIP)
    assert_matches(results, reference("gpt", 2, STEPS, GAS, CLIP), atol=3e-5, norm_rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 3])
def test_tp2_dp2_transformers_llama(pool, stage):
    """A ``transformers`` Llama (grouped key/value heads, untied output layer) split by its own
    ``tp_plan``: q/k/v and gate/up by columns, o and down by rows, the embedding by vocabulary."""
    results = pool.run(train, 4, "llama", stage, 2, STEPS, gas=GAS, clip=CLIP, optimizer_name="SGD")
    assert_matches(results, reference("llama", 2, STEPS, GAS, CLIP, "SGD"), atol=1e-6)


def test_tp2_dp2_transformers_qwen3(pool):
    """A ``transformers`` Qwen3 split by its own ``tp_plan``, whose per-head q and k norms are
    ``replicated_with_grad_allreduce``: run on this rank's heads, their gradients summed over them."""
    results = pool.run(train, 4, "qwen3", 2, 2, STEPS, gas=GAS, clip=CLIP, optimizer_name="SGD")
    assert_matches(results, reference("qwen3", 2, STEPS, GAS, CLIP, "SGD"), atol=1e-6)


def test_tp2_dp2_transformers_gpt2(pool):
    """``transformers``' GPT-2 ships no plan; zerodp's splits its ``Conv1D`` layers (weights stored
    transposed) and the fused ``c_attn`` by heads, and the tied vocabulary."""
    results = pool.run(train, 4, "gpt2", 2, 2, STEPS, gas=GAS, clip=CLIP, optimizer_name="SGD")
    assert_matches(results, reference("gpt2", 2, STEPS, GAS, CLIP, "SGD"), atol=1e-6)


@pytest.mark.parametrize("grid_from", ["mesh", "tp_model_init"])
def test_the_grid_from_a_device_mesh_or_tp_model_init(pool, grid_from):
    results = pool.run(train, 4, "gpt", 1, 2, STEPS, gas=GAS, clip=CLIP, optimizer_name="SGD", grid_from=grid_from)
    assert [(r["dp_rank"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_matches(results, reference("gpt", 2, STEPS, GAS, CLIP, "SGD"), atol=1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_an_optimizer_built_on_the_unsplit_model(pool, stage):
    """A script that builds its optimizer before ``initialize`` splits the model (Accelerate's
    ``prepare(model, optimizer)`` with the config's ``autotp_size``) trains the split model: the
    optimizer's parameters, tied weight included, are taken as the ones that replaced them."""
    results = pool.run(train, 4, "gpt", stage, 2, STEPS, gas=GAS, clip=CLIP, optimizer_name="SGD",
                       client_optimizer=True)
    assert_matches(results, reference("gpt", 2, STEPS, GAS, CLIP, "SGD"), atol=1e-6)


def test_heads_that_do_not_split_are_refused_naming_the_layer(pool):
    from tp_tasks import refused_split
    errors = pool.run(refused_split, 4, 2, 4)
    assert all(e.startswith("blocks.0.attn: 2 attention heads do not split over 4 tensor-parallel ranks")
               for e in errors), errors


def test_tensor_parallelism_over_gloo_on_cuda_is_refused(pool):
    """DTensor over gloo ends the process on CUDA tensors (a segmentation fault, seen on a GPU with
    torch 2.11: benchmarks/gloo_cuda_probe.py); initialize says so and names NCCL instead."""
    from tp_tasks import refused_gloo_on_cuda
    errors = pool.run(refused_gloo_on_cuda, 4)
    assert all(e.startswith("tensor parallelism on CUDA needs an NCCL process group") for e in errors), errors


@pytest.mark.parametrize("stage", [1, 3])
def test_hybrid_shard2_replicate2(pool, stage):
    """mics_shard_size 2 on 4 data-parallel ranks: sharded inside {0,1} and {2,3}, replicated
    across; gradients summed across the replicas once per step."""
    results = pool.run(train, 4, "gpt", stage, 1, STEPS, gas=GAS, clip=CLIP, hybrid=2, optimizer_name="SGD")
    assert_matches(results, reference("gpt", 4, STEPS, GAS, CLIP, "SGD"), atol=1e-6)
    comm = results[0]["comm"]
    assert comm["replica"]["all_reduce"] > 0 and comm["data"]["reduce_scatter"] > 0


def test_tp2_bf16_follows_fp32(pool):
    """bf16 parameters with fp32 masters: the fp32 reference within bf16 precision."""
    results = pool.run(train, 4, "gpt", 2, 2, STEPS, gas=GAS, clip=CLIP, dtype="bf16", optimizer_name="SGD")
    assert_matches(results, reference("gpt", 2, STEPS, GAS, CLIP, "SGD"), atol=5e-3, norm_rtol=5e-3)


@pytest.mark.parametrize("case", ["offload", "plain_loop"])
def test_tp2_with_offload_and_the_plain_loop(pool, case):
    kw = {"offload": True} if case == "offload" else {"plain_loop": True}
    results = pool.run(train, 4, "gpt", 2, 2, STEPS, gas=GAS, clip=CLIP, optimizer_name="SGD", **kw)
    assert_matches(results, reference("gpt", 2, STEPS, GAS, CLIP, "SGD"), atol=1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_megatron_style_model_with_an_mpu(pool, stage):
    """A script that split its model itself (hand-written column/row layers, Megatron's marks)
    and passes an ``mpu``: ZeRO shards over its data-parallel groups, the norm counts each split
    parameter's slices on every tensor rank and the replicated ones once."""
    results = pool.run(megatron_train, 4, stage, 2, STEPS, CLIP)
    assert results[0]["grid"] == "data 2 x tensor 2"
    assert_matches(results, megatron_reference(2, STEPS, CLIP), atol=1e-6)


def test_model_states_per_rank_follow_the_split(pool):
    """Stage 3, fp32, AdamW: each rank holds 16 bytes per element of its local model (a split
    parameter's 1/N_tp, a replicated one whole), divided over the data-parallel ranks."""
    from tp_tasks import build_gpt
    model = build_gpt()
    split = {"wte.weight"} | {n for n, _ in model.named_parameters()
                              if any(k in n for k in ("c_attn", "c_fc")) or n.endswith("c_proj.weight")}
    local = sum(p.numel() // (2 if n in split else 1) for n, p in model.named_parameters())
    results = pool.run(train, 4, "gpt", 3, 2, 1)
    estimated = zerodp.estimate(build_gpt(), ranks_per_node=4, tp=2, precision="fp32").row(3)
    for r in results:
        assert r["local_numel"] == pytest.approx(local, abs=64)
        states = r["memory"]["parameters"] + r["memory"]["gradients"] + r["memory"]["optimizer_states"]
        assert states == pytest.approx(16 * local / 2, rel=0.02)
        assert r["memory"]["model_states"] == pytest.approx(estimated.model_states, rel=0.02)


def test_a_batch_that_differs_inside_a_tensor_group_fails_naming_the_ranks(pool):
    errors = pool.run(mismatched_batch, 4, 2)
    for e in errors[:2]:
        assert "ranks [0] and ranks [1] got different inputs" in e, e
    assert errors[2] == errors[3] == "no error"


def test_a_vocabulary_split_embedding_makes_the_gradient_of_its_own_rows_only(pool):
    """Megatron's vocabulary-parallel embedding: each tensor rank's backward makes a gradient of its
    VOCAB / 2 rows, never one of the whole vocabulary (DTensor's own embedding backward did, on every
    rank: 1 GB for Llama-3 8B); test_tp2_dp2_example_gpt checks its numbers."""
    out = pool.run(embedding_backward_rows, 4, 2)
    for r in out:
        assert r["rows"] and max(r["rows"]) == VOCAB // 2, r["rows"]


def test_tp_slice_takes_and_places_fused_blocks():
    from zerodp.parallel import TPSlice
    full = torch.arange(24.).reshape(12, 2)  # three blocks (q, k, v) of 4 rows
    parts = [TPSlice(0, 2, r, (12, 2), blocks=3) for r in range(2)]
    assert parts[0].ranges() == [(0, 2), (4, 6), (8, 10)]
    back = torch.zeros_like(full)
    for r, tp in enumerate(parts):
        assert tp.take(full).shape == (6, 2)
        tp.place(back, tp.take(full), r)
    assert torch.equal(back, full)


def test_checkpoints_move_between_grids(pool, tmp_path):
    """TP2 x DP2 stage 3 -> TP1 x DP4 stage 1 -> TP4 x DP1 stage 2 -> shard 2 x replica 2 stage 3,
    each loading the last one's checkpoint with no conversion and going on as one process would."""
    legs = [(3, 2, 0, 2), (1, 1, 0, 1), (2, 4, 0, 1), (3, 1, 2, 1)]
    results = pool.run(grid_round_trip, 4, str(tmp_path), legs, GAS, CLIP)
    dp = [2, 2, 4, 1, 4]
    assert all(r["global_steps"] == 5 for r in results)
    assert_matches(results, reference("gpt", dp, 5, GAS, CLIP, "SGD"), atol=1e-6)


@pytest.mark.parametrize("model_name", ["gpt", "qwen3"])
def test_checkpoints_move_between_sequence_parallel_grids(pool, tmp_path, model_name):
    """The replicated DTensors of sequence parallelism (the norms) and Qwen3's head norms in
    checkpoints: TP2 x DP2 stage 3 with sequence parallelism -> TP1 x DP4 stage 1 -> TP2 x DP2
    stage 2 without it -> TP2 x DP2 stage 1 with it, going on as one process would."""
    legs = [(3, 2, 0, 2, True), (1, 1, 0, 1, False), (2, 2, 0, 1, False), (1, 2, 0, 1, True)]
    results = pool.run(grid_round_trip, 4, str(tmp_path), legs, GAS, CLIP, model_name)
    assert all(r["global_steps"] == 5 for r in results)
    assert_matches(results, reference(model_name, [2, 2, 4, 2, 2], 5, GAS, CLIP, "SGD"), atol=1e-6)


def test_save_16bit_model_and_consolidate_write_the_unsplit_model(pool, tmp_path):
    """From a TP2 x DP2 stage-3 run: engine.save_16bit_model gathers every slice, and
    ``zerodp consolidate`` writes the same full tensors from the checkpoint's files."""
    from zerodp.checkpoint import consolidate
    from zerodp.checkpoint.tensorfile import load_file
    results = pool.run(save_and_export, 4, str(tmp_path), 3, 2)
    want = reference("gpt", 2, 2, GAS, CLIP, "SGD")["params"]
    saved = torch.load(tmp_path / "model16.pt")
    files = consolidate(tmp_path, tmp_path / "full", tag="tp")
    merged = {}
    for f in files:
        merged.update(load_file(f))
    for name, value in want.items():
        assert (results[0]["params"][name] - value).abs().max().item() <= 1e-6
        assert (saved[name] - value).abs().max().item() <= 1e-6, name
        assert (merged[name] - value).abs().max().item() <= 1e-6, name
    assert torch.equal(saved["lm_head.weight"], saved["wte.weight"])  # tied, under both names


def test_activation_checkpointing_with_tp(pool):
    """A Llama with gradient checkpointing (recomputed forwards issue the split layers'
    collectives again) on TP2 x DP2 at stage 3."""
    from tp_tasks import llama_checkpointed
    results = pool.run(llama_checkpointed, 4, 3, 2, STEPS)
    assert_matches(results, reference("llama", 2, STEPS, GAS, CLIP, "SGD"), atol=1e-6)


@pytest.mark.parametrize("loss_parallel,sequence_parallel", [(False, False), (True, False), (False, True),
                                                             (True, True)])
def test_tensor_group_bytes_are_the_collectives_torch_ran(pool, loss_parallel, sequence_parallel):
    """What comm_stats counts for the tensor group is what DTensor issued (torch's CommDebugMode,
    its functional collectives; the engine's own data-group collectives are c10d's), one step.
    Per block: the attention and MLP outputs summed (all-reduce; with sequence parallelism a
    reduce-scatter, and an all-gather of its gradient) and the column splits' input gradients
    summed (all-reduce; with sequence parallelism an all-gather of the input and a reduce-scatter
    of its gradient). Then the embedding likewise, the output layer's input likewise, its logits
    gathered (or, with loss parallelism, three all-reduces of one number per row: max, sum and
    target logit), with sequence parallelism the position embedding's gradient gathered and each
    norm parameter's partial gradient summed."""
    from tp_tasks import count_tensor_collectives
    results = pool.run(count_tensor_collectives, 4, 2, loss_parallel, sequence_parallel)
    layers, norms = 2, 2 * 2 + 1
    want = {"all_reduce": (2 * norms if sequence_parallel else 2 + 4 * layers) + (3 if loss_parallel else 0),
            "all_gather_into_tensor": (4 * layers + 3 if sequence_parallel else 0) + (0 if loss_parallel else 1),
            "reduce_scatter_tensor": 4 * layers + 2 if sequence_parallel else 0}
    for r in results:
        got = {k: r["debug_counts"].get(k, 0) for k in want}
        assert got == want, r["debug_counts"]
        assert r["engine"]["calls"] == sum(got.values()) + 1  # + the batch check
    # bytes as the layout implies them (fp32; n = 2 ranks: an all-reduce moves 2 (n-1)/n of its
    # tensor, an all-gather or reduce-scatter (n-1)/n of the whole one)
    from tp_tasks import MICRO, SEQ, VOCAB
    act, f = MICRO * SEQ * 32 * 4, 1 / 2
    moved = 2 * act * f  # per activation summed by an all-reduce
    want_bytes = {
        "all_reduce": ((2 + 4 * layers) * moved if not sequence_parallel else 2 * norms * 2 * 32 * 4 * f)
        + (3 * 2 * MICRO * SEQ * 4 * f if loss_parallel else 0),
        "reduce_scatter": (4 * layers + 2) * act * f if sequence_parallel else 0,
        "all_gather": ((4 * layers + 2) * act * f + SEQ * 32 * 4 * f if sequence_parallel else 0)
        + (0 if loss_parallel else MICRO * SEQ * VOCAB * 4 * f)}
    for r in results:
        assert {k: r["engine"][k] for k in want_bytes} == pytest.approx(want_bytes), r["engine"]


@pytest.mark.parametrize("model_name,stage", [("gpt", 1), ("gpt", 3), ("llama_labels", 2)])
def test_loss_parallel_cross_entropy_on_split_logits(pool, model_name, stage):
    """``tensor_parallel.loss_parallel``: the logits stay split over the vocabulary and the model's
    own cross entropy runs on the slices (torch's loss_parallel, in the engine's forward and
    backward): the example GPT (its loss from ``targets``) and a Llama (transformers' loss from
    ``labels``), against one process."""
    results = pool.run(train, 4, model_name, stage, 2, STEPS, gas=GAS, clip=CLIP, optimizer_name="SGD",
                       loss_parallel=True)
    assert_matches(results, reference(model_name, 2, STEPS, GAS, CLIP, "SGD"), atol=1e-6)
    assert all(r["comm"]["tensor"]["all_gather"] == 0 for r in results)  # the logits were not gathered


@pytest.mark.parametrize("model_name,stage,loss_parallel,plain_loop", [
    ("gpt", 0, False, False), ("gpt", 1, False, False), ("gpt", 2, True, False), ("gpt", 3, False, False),
    ("gpt", 3, True, True), ("llama", 1, False, False), ("llama_labels", 3, True, False), ("qwen2", 2, False, False),
    ("qwen3", 3, False, False), ("mistral", 0, False, False), ("gpt2", 2, False, False)])
def test_sequence_parallel(pool, model_name, stage, loss_parallel, plain_loop):
    """``tensor_parallel.sequence_parallel``: norms, residuals and dropout on sequence slices, the
    column splits gathering their input and the row splits reduce-scattering their output; with the
    norms' gradients summed over the slices. Every stage, with loss parallelism, in the plain loop;
    and ``transformers``' Llama (its rotary positions and causal mask built from the whole
    sequence), also with its loss from ``labels`` on split logits, Qwen2 (biased q, k, v), Qwen3
    (a norm on each head's q and k), Mistral (a sliding-window mask, built whole) and GPT-2 (its
    split vocabulary and its position embedding both cut to the slices)."""
    results = pool.run(train, 4, model_name, stage, 2, STEPS, gas=GAS, clip=CLIP, optimizer_name="SGD",
                       loss_parallel=loss_parallel, sequence_parallel=True, plain_loop=plain_loop)
    assert_matches(results, reference(model_name, 2, STEPS, GAS, CLIP, "SGD"), atol=1e-6)
    assert all(r["comm"]["tensor"]["reduce_scatter"] > 0 for r in results)  # the sequence was split


def test_llama_sequence_parallel_bytes_are_the_collectives_torch_ran(pool):
    """The tensor group's count for a Llama with sequence and loss parallelism, call for call
    against ``CommDebugMode``: the all-gather of the final norm's output that DTensor runs inside
    the model's slice of the hidden states stands where the output layer's input gather is counted."""
    from tp_tasks import count_tensor_collectives
    results = pool.run(count_tensor_collectives, 4, 2, True, True, "llama_labels")
    functional = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")  # c10d's: the data group's
    for r in results:
        got = {k: r["debug_counts"].get(k, 0) for k in functional}
        assert got["reduce_scatter_tensor"] > 0 and got["all_gather_into_tensor"] > 0
        assert r["engine"]["calls"] == sum(got.values()) + 1, (r["debug_counts"], r["engine"])  # + the batch check


@pytest.mark.parametrize("case,message", [
    ("sequence_partition_config", "tensor_parallel.sequence_parallel: zerodp splits the sequence of the example "
                                  "GPT and of transformers' llama, mistral, qwen2, qwen3, gpt2 models"),
    ("loss_without_output_layer", "tensor_parallel.loss_parallel: the model's plan has no output layer whose "
                                  "logits are gathered")])
def test_loss_and_sequence_parallelism_refused_where_they_do_not_apply(pool, case, message):
    from tp_tasks import refused_option
    errors = pool.run(refused_option, 4, case)
    assert all(e.startswith(message) for e in errors), errors


def test_world_8_tp2_with_hybrid_shard2_x_replica2(tmp_path):
    """Eight processes: tensor groups {0,1},{2,3},..; inside each data axis of four ranks, shard
    groups of two and their replicas (``grid8_script.py``). Stage 3 against one process."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    here = Path(__file__).parent
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(here.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                           str(here / "grid8_script.py"), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert out.exists(), (proc.stdout + proc.stderr)[-4000:]  # judged by what rank 0 wrote
    got = json.loads(out.read_text())
    assert got["max_err"] <= 1e-6
    assert got["norms"] == pytest.approx(got["ref_norms"], rel=1e-6)
    assert min(got["ref_norms"]) > CLIP
    comm = got["comm"]
    assert comm["replica"]["all_reduce"] > 0 and comm["tensor"]["all_reduce"] > 0 and comm["data"]["all_gather"] > 0


def test_a_model_without_a_plan_split_by_partition_config(pool):
    """DeepSpeed's AutoTP rules in the config (regular expressions over parameter names) split a
    model zerodp has no plan for: ``up`` by columns (weight and bias), ``down`` by rows."""
    from tp_tasks import partition_config_reference, partition_config_train
    results = pool.run(partition_config_train, 4, 2, 2, STEPS)
    assert results[0]["split"] == ["down.weight", "up.bias", "up.weight"]
    assert_matches(results, partition_config_reference(2, STEPS), atol=1e-6)

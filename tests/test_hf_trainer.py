"""The Hugging Face ``Trainer`` with a DeepSpeed config trains on zerodp (``ZERODP_AS_DEEPSPEED=1``)
exactly as the plain Trainer (DDP) does: per-step loss and gradient norm, and evaluation
before and after training, at stages 0-3, with optimizer offload, with gradient accumulation, in
fp32 and bf16. One 2-rank torchrun job runs every case (``hf_trainer_tasks.py``) in the
environment without DeepSpeed (``no_deepspeed_python``); a 4-rank job runs the config's AutoTP
(``tensor_parallel.autotp_size`` 2) against the plain Trainer on the same samples."""
from __future__ import annotations

from pathlib import Path

import pytest
import torchrun_cases

HERE = Path(__file__).parent

FP32 = ["z0", "z1", "z2", "z3", "z1-off", "z2-off", "z3-off"]
GAS = ["z2-gas2", "z3-gas2"]
BF16 = ["z0-bf16", "z1-bf16", "z2-bf16", "z3-bf16", "z1-bf16-off", "z2-bf16-off", "z3-bf16-off"]
PRETRAINED = ["z2-pre", "z3-pre", "z3-off-pre"]
CHECKPOINTS = ["z2-ckpt", "z3-ckpt", "z3-off-ckpt"]
LORA = ["plain-lora", "z3-lora"]
ADALORA = ["plain-adalora", "z3-adalora"]
PRE_LORA_REFERENCE = "plain-pre-lora"
PRE_LORA = ["z2-pre-lora", "z3-pre-lora", "z3-off-pre-lora"]
PRE_LORA_MTS = ["plain-pre-lora-mts", "z3-pre-lora-mts"]
RESIZE = ["plain-pre-resize", "z2-pre-resize", "z3-pre-resize"]
MOE = ["plain-qwen3moe", "z2-qwen3moe", "z3-qwen3moe", "plain-mixtral", "z2-mixtral", "z3-mixtral",
       "z2-qwen3moe-ep2", "z3-mixtral-ep2"]
FP16 = ["plain-fp16", "z2-fp16", "z3-fp16", "z3-fp16-ovf"]
MISSING = ["plain-pre-miss", "z2-pre-miss", "z3-pre-miss"]
CASES = ["plain", *FP32, "plain-gas2", *GAS, "plain-bf16", *BF16, *PRETRAINED, "z3-bf16-pre", *CHECKPOINTS, *LORA,
         *FP16, *MISSING, PRE_LORA_REFERENCE, *PRE_LORA, *PRE_LORA_MTS, *MOE, *RESIZE, *ADALORA]


# 4 ranks: tensor parallelism over pairs, and the reference with one sample per device (the same 4 samples a step)
TP_REFERENCE = "plain-half-nodrop"
TP = ["z0-tp2", "z1-tp2", "z2-tp2", "z3-tp2", "z2-tp2-sp", "z3-tp2-lp", "z1-tp2-sp-lp", "z2-tp2-off", "z3-tp2-off",
      "z3-tp2-gc", "z3-tp2-sp-gc", "z3-mics2-half-nodrop"]
TP_CHECKPOINTS = ["z1-tp2-ckpt", "z3-tp2-ckpt"]
TP_BF16 = ["plain-bf16-half-nodrop", "z2-tp2-bf16", "z3-tp2-bf16"]
TP_LORA_REFERENCE = "plain-lora-half-nodrop"
TP_LORA = ["z2-tp2-lora", "z3-tp2-sp-lora", "z1-tp2-lp-lora"]


def run_cases(python: str, tmp: Path, cases: list[str], ranks: int) -> dict:
    return torchrun_cases.run_cases(python, HERE / "hf_trainer_tasks.py", tmp / "results.json", [], cases, ranks,
                                    ZERODP_AS_DEEPSPEED="1", TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="module")
def results(no_deepspeed_python, tmp_path_factory) -> dict:
    return run_cases(no_deepspeed_python, tmp_path_factory.mktemp("hf_trainer"), CASES, 2)


def close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * max(abs(x), abs(y)) for x, y in zip(a, b))


def same_run(got: dict, ref: dict, rel: float) -> None:
    assert len(got["loss"]) == 3
    assert close(got["loss"], ref["loss"], rel), (got["loss"], ref["loss"])
    assert close(got["grad_norm"], ref["grad_norm"], rel), (got["grad_norm"], ref["grad_norm"])
    assert close([got["eval_after"]], [ref["eval_after"]], rel)
    if "eval_before" in got and "eval_before" in ref:  # stage 3: an engine without optimizer
        assert close([got["eval_before"]], [ref["eval_before"]], rel)


@pytest.mark.parametrize("case", FP32)
def test_trainer_on_zerodp_equals_plain_trainer(results, case):
    same_run(results[case], results["plain"], rel=1e-5)


@pytest.mark.parametrize("case", PRETRAINED)
def test_from_pretrained_under_zero3_keeps_the_loaded_weights(results, case):
    """``from_pretrained`` after ``TrainingArguments(deepspeed=...)``: at stage 3 transformers builds
    the model inside ``deepspeed.zero.Init`` (every parameter a slice) and loads each module on
    rank 0 inside ``GatheredParameters(modifier_rank=0)``. The weights saved are those the plain
    run starts from, so every step equals it; before, stage 3 trained from random weights."""
    same_run(results[case], results["plain"], rel=1e-5)
    assert results[case]["built_in_init"] == case.startswith("z3")


@pytest.mark.parametrize("case", ["z2-pre-miss", "z3-pre-miss"])
def test_weights_a_checkpoint_lacks_are_initialized_as_without_zero(results, case):
    """A checkpoint without two of the model's weights: transformers initializes them (at stage 3
    on rank 0 inside ``GatheredParameters(modifier_rank=0)``); every step then equals the plain
    Trainer's from the same checkpoint, and differs from the run whose checkpoint had them."""
    same_run(results[case], results["plain-pre-miss"], rel=1e-5)
    assert not close(results[case]["loss"], results["plain"]["loss"], 1e-5)
    assert results[case]["built_in_init"] == (case == "z3-pre-miss")


def test_from_pretrained_under_zero3_in_bf16(results):
    same_run(results["z3-bf16-pre"], results["z0-bf16"], rel=1e-5)
    assert results["z3-bf16-pre"]["built_in_init"]


@pytest.mark.parametrize("case", CHECKPOINTS)
def test_save_resume_and_generate_through_the_trainer(results, case):
    """A checkpoint saved during training (``engine.save_checkpoint``) resumes a new Trainer to the
    same last step; ``save_model`` (at stage 3 ``_zero3_consolidated_16bit_state_dict``) writes
    weights that, loaded without DeepSpeed, evaluate and generate as the trained engine did;
    ``model.generate`` on the stage-3 model works (it is called outside ``engine(...)``)."""
    r = results[case]
    assert close(r["loss"], results["plain"]["loss"], 1e-5)
    assert close(r["resumed_loss"], r["loss"], 1e-5)
    assert close([r["saved_eval"]], [r["eval_after"]], 1e-5)
    assert r["generated"] == r["saved_generated"] and len(r["generated"][0]) == 9


def test_peft_lora_through_the_trainer_at_stage_3(results):
    """A PEFT LoRA model trains at stage 3 as without DeepSpeed; ``save_model`` writes the adapter
    (PEFT's files), which reloaded onto the base model evaluates as the trained engine did."""
    got, want = results["z3-lora"], results["plain-lora"]
    assert close(got["loss"], want["loss"], 1e-5) and not close(got["loss"], results["plain"]["loss"], 1e-4)
    assert close([got["eval_after"]], [want["eval_after"]], 1e-5)
    assert close([got["saved_eval"]], [got["eval_after"]], 1e-5)
    assert "adapter_model.safetensors" in got["adapter_files"] and "adapter_config.json" in got["adapter_files"]


@pytest.mark.parametrize("case", PRE_LORA + PRE_LORA_MTS[1:])
def test_peft_lora_after_from_pretrained_under_zero3(results, case):
    """``from_pretrained`` (at stage 3 inside ``zero.Init``), then ``get_peft_model``: peft puts each
    new adapter on its base layer's weight's device. A stage-3 parameter there is on the real device
    (empty data, ``ds_shape``, as DeepSpeed's), so the adapters keep the values peft gave them
    (``lora_B`` zero) and every step equals the plain Trainer's from the first loss on, gradient norms
    included. Before, the base reported ``meta``, the adapters were moved there and lost their values,
    and ``initialize`` gave them others: the first loss and norm differed. With ``modules_to_save``,
    peft copies a base module inside ``GatheredParameters`` (it sees ``numel() == 0`` and ``ds_numel``)
    and the copy trains as without DeepSpeed."""
    got = results[case]
    want = results[PRE_LORA_MTS[0] if case.endswith("-mts") else PRE_LORA_REFERENCE]
    assert got["adapters"] == {"devices": ["cpu"], "lora_B_max": 0.0}, got["adapters"]
    assert want["adapters"] == got["adapters"]
    assert got["built_in_init"] == case.startswith("z3")
    assert close(got["loss"], want["loss"], 1e-5) and close(got["grad_norm"], want["grad_norm"], 1e-5)
    assert close([got["eval_after"]], [want["eval_after"]], 1e-5)
    assert close([got["saved_eval"]], [got["eval_after"]], 1e-5)
    if case.endswith("-mts"):
        assert not close(got["loss"], results[PRE_LORA_REFERENCE]["loss"], 1e-6)


@pytest.mark.parametrize("case", RESIZE[1:])
def test_resize_token_embeddings_after_from_pretrained(results, case):
    """``resize_token_embeddings`` on a model loaded under a stage-3 config: transformers makes the new
    (tied) embedding on the old weight's device, a real one, and copies the old rows in; the new
    parameter keeps its values through ``initialize`` (rank 0's), so every step equals the plain
    Trainer's with the same resized model."""
    same_run(results[case], results[RESIZE[0]], rel=1e-5)
    assert not close(results[RESIZE[0]]["loss"], results["plain"]["loss"], 1e-6)  # the resize changed the model


@pytest.mark.parametrize("case", [c for c in MOE if not c.startswith("plain")])
def test_transformers_moe_models_through_the_trainer(results, case):
    """transformers' own Qwen3-MoE and Mixtral (fused 3-D experts, router aux loss) at stages 2 and 3
    equal the plain Trainer at every step, also with their experts split over the 2 ranks by the
    config's ``expert_parallel`` block (``-ep2``). At stage 3, with every module a unit, the sparse
    MoE block is a leaf without being asked (DeepSpeed's default ``leaf_module.classes``)."""
    kind = case.split("-")[1]
    same_run(results[case], results[f"plain-{kind}"], rel=1e-5)
    block = {"qwen3moe": "Qwen3MoeSparseMoeBlock", "mixtral": "MixtralSparseMoeBlock"}[kind]
    assert results[case]["leaves"] == ([block] if case.startswith("z3") else [])


def test_fp16_through_the_trainer_and_a_skipped_step(results):
    """fp16 (parameters in fp16, fp32 masters, dynamic loss scaling) at stages 2 and 3 gives the
    same numbers, within fp16 precision of the plain Trainer's fp16 autocast. A loss scale so
    large that the first step overflows skips it: its gradient norm is inf, and the learning-rate
    schedule is not advanced (the engine steps it only on applied steps, and optimizer.overflow
    tells Accelerate the step was skipped), so the schedule runs one step behind."""
    z2, z3, ovf = results["z2-fp16"], results["z3-fp16"], results["z3-fp16-ovf"]
    same_run(z3, z2, rel=1e-5)
    same_run(z2, results["plain-fp16"], rel=1e-3)
    assert ovf["grad_norm"][0] == float("inf") and all(n < 10 for n in ovf["grad_norm"][1:])
    assert ovf["learning_rate"][0] == 1e-3 and z3["learning_rate"][0] < 1e-3
    assert close(ovf["learning_rate"][1:], z3["learning_rate"][:-1], 1e-9)


@pytest.mark.parametrize("case", GAS)
def test_gradient_accumulation_equals_plain_trainer(results, case):
    same_run(results[case], results["plain-gas2"], rel=1e-5)
    assert not close(results[case]["loss"], results["plain"]["loss"], rel=1e-3)  # the case is its own


@pytest.mark.parametrize("case", BF16)
def test_bf16_every_stage_the_same_and_near_the_plain_trainer(results, case):
    """bf16 parameters with fp32 masters (DeepSpeed's bf16) against the plain Trainer's bf16
    autocast over fp32 weights: the same to bf16 precision, and every stage the same to fp32's."""
    same_run(results[case], results["z0-bf16"], rel=1e-5)
    same_run(results[case], results["plain-bf16"], rel=1e-2)
    assert "eval_before" in results[case] or not case.startswith("z3")


@pytest.fixture(scope="module")
def tp_results(no_deepspeed_python, tmp_path_factory) -> dict:
    return run_cases(no_deepspeed_python, tmp_path_factory.mktemp("hf_trainer_tp"),
                     [TP_REFERENCE, *TP, *TP_CHECKPOINTS, *TP_BF16, TP_LORA_REFERENCE, *TP_LORA], 4)


@pytest.mark.parametrize("case", TP)
def test_trainer_with_autotp_equals_plain_trainer(tp_results, case):
    """``"tensor_parallel": {"autotp_size": 2}`` in the Trainer's DeepSpeed config, 4 ranks:
    transformers splits the model (``tp_model_init``), accelerate gives each pair the same batches,
    and every step's loss and gradient norm and the evaluation equal the plain Trainer's on the
    same 4 samples a step (one per device on 4 ranks). The Trainer fills ``train_batch_size`` as
    DeepSpeed counts it under AutoTP (every rank: 8, not the 4 samples a step takes), and reads the
    gradient norm after the engine's step, when no ``.grad`` may be left (zeros would make it 0).
    The config's ``sequence_parallel`` and ``loss_parallel`` reach the split too (``-sp``, ``-lp``):
    the loss on split logits comes back a plain tensor the Trainer may scale in place. Also with the
    Trainer's gradient checkpointing (``-gc``), and hybrid sharding without TP (``-mics2``: 4 ranks
    sharding in pairs, one sample per device)."""
    got = tp_results[case]
    assert got["split"] == ("tp2" in case) and not tp_results[TP_REFERENCE]["split"]
    same_run(got, tp_results[TP_REFERENCE], rel=1e-5)


@pytest.mark.parametrize("case", TP_CHECKPOINTS)
def test_save_resume_and_generate_with_autotp(tp_results, case):
    """Under AutoTP, a checkpoint saved during training resumes a new Trainer to the same last step,
    and ``save_model`` (Accelerate calls ``_consolidated_16bit_state_dict``, which puts the
    tensor-parallel slices together) writes weights that, loaded without DeepSpeed, evaluate and
    generate as the trained engine did."""
    r = tp_results[case]
    assert close(r["loss"], tp_results[TP_REFERENCE]["loss"], 1e-5)
    assert close(r["resumed_loss"], r["loss"], 1e-5)
    assert close([r["saved_eval"]], [r["eval_after"]], 1e-5)
    assert r["generated"] == r["saved_generated"] and len(r["generated"][0]) == 9


def test_trainer_with_autotp_in_bf16(tp_results):
    """bf16 under AutoTP (``tp_model_init`` casts the split model): stages 2 and 3 give the same numbers,
    within bf16 precision of the plain Trainer's bf16 autocast on the same samples."""
    z2, z3 = tp_results["z2-tp2-bf16"], tp_results["z3-tp2-bf16"]
    assert z2["split"]
    same_run(z3, z2, rel=1e-5)
    same_run(z2, tp_results["plain-bf16-half-nodrop"], rel=1e-2)


@pytest.mark.parametrize("case", TP_LORA)
def test_peft_lora_with_autotp(tp_results, case):
    """A PEFT LoRA model (adapters on GPT-2's fused q/k/v, MLP-in and both output layers) under AutoTP,
    also with sequence or loss parallelism: each adapter splits with its layer (``lora_B`` with a
    column split, ``lora_A`` with a row split), every loss and the evaluation equal the plain
    Trainer's LoRA run on the same samples, and the adapter ``save_model`` writes (its slices put
    together), reloaded onto the base model without DeepSpeed, evaluates as the trained engine did."""
    got, want = tp_results[case], tp_results[TP_LORA_REFERENCE]
    assert got["adapter_split"] and not want["adapter_split"]
    assert close(got["loss"], want["loss"], 1e-5) and close([got["eval_after"]], [want["eval_after"]], 1e-5)
    assert close([got["saved_eval"]], [got["eval_after"]], 1e-5)


def test_peft_adalora_reads_reduced_gradients_at_stage_3(results):
    """PEFT AdaLoRA's rank allocation reads each adapter's gradient after backward, under DeepSpeed
    with ``deepspeed.utils.safe_get_full_grad`` (a collective at stage 3): it prunes the same ranks
    as without DeepSpeed, and every step equals the plain Trainer's."""
    got, want = results["z3-adalora"], results["plain-adalora"]
    assert got["rank_pattern"] == want["rank_pattern"]
    kept = [x for mask in got["rank_pattern"].values() for x in mask]
    assert any(kept) and not all(kept)
    assert close(got["loss"], want["loss"], 1e-5) and close(got["grad_norm"], want["grad_norm"], 1e-5)
    assert close([got["eval_after"]], [want["eval_after"]], 1e-5)

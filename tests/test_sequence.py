"""Ulysses sequence parallelism (``parallel/sequence.py``): parity with one process on the whole
batch and sequence at ZeRO stages 1-3, sequence-parallel size 2 (beside 2 data-parallel ranks) and 4,
through the engine API, and the refusals."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("sp,kv_heads,layer", [(2, 4, "function"), (4, 2, "function"), (2, 2, "deepspeed")])
def test_sequence_parallel_trains_as_one_process(pool, stage, sp, kv_heads, layer):
    from sequence_tasks import train_sequence_parallel
    results = pool.run(train_sequence_parallel, 4, stage, sp, kv_heads, layer)
    for r in results:
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["ref_losses"])
        for got, want in zip(r["norms"], r["ref_norms"]):  # the gradients themselves, before clipping
            assert abs(got - want) <= 1e-5 * abs(want), (r["norms"], r["ref_norms"])
        for name, want in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)
    assert len(results) == 4


@pytest.mark.parametrize("stage", [2, 3])
def test_sequence_parallel_with_offload_and_accumulation_trains_as_one_process(pool, stage):
    """Optimizer states in host memory and 2 micro-batches per step, sp 2 beside 2 data-parallel ranks."""
    from sequence_tasks import train_sequence_parallel
    for r in pool.run(train_sequence_parallel, 4, stage, 2, 2, "function", gas=2, offload=True):
        assert len(r["losses"]) == 6 and len(r["norms"]) == 3
        for got, want in zip(r["norms"] + r["losses"], r["ref_norms"] + r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["norms"], r["ref_norms"], r["losses"], r["ref_losses"])
        for name, want in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeeds_parallel_state_module_is_the_mpu(pool, stage):
    """``initialize(mpu=parallel_state_sp)`` after ``initialize_sequence_parallel``, as DeepSpeed's users
    (and Accelerate) do; ``deepspeed.sequence.layer.DistributedAttention`` finds the group itself."""
    from sequence_tasks import train_sequence_parallel
    for r in pool.run(train_sequence_parallel, 4, stage, 2, 2, "deepspeed", road="mpu"):
        for got, want in zip(r["norms"] + r["losses"], r["ref_norms"] + r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * abs(want)
        for name, want in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_sequence_parallel_refuses_what_does_not_split(pool):
    from sequence_tasks import refusals
    r = pool.run(refusals, 4)[0]
    assert "6 attention heads do not split over 4" in r["heads"]
    assert "3 key/value heads neither split over nor divide 4" in r["kv_heads"]
    assert "does not split over the 4 ranks" in r["sequence"]
    assert "2 key/value heads are fewer than the 4" in r["deepspeed_kv"]
    assert "cannot use 2 as well" in r["other_size"]
    assert "sequence parallelism with tensor is not supported" in r["with_tensor"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_saved_with_sequence_parallelism_loads_without_it_and_at_another_size(pool, tmp_path, stage):
    from sequence_tasks import save_with_sequence_parallel_load_without
    for r in pool.run(save_with_sequence_parallel_load_without, 4, str(tmp_path), stage):
        assert r[1] and r[4] and r["steps1"] == 2 == r["steps4"], r


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("sp,kv_heads", [(2, 2), (4, 2)])
def test_transformers_llama_with_deepspeeds_ulysses_trains_as_one_process(pool, stage, sp, kv_heads):
    """``UlyssesSPAttentionHF.register_with_transformers`` on a small Llama (sdpa), the Trainer's
    sequence-parallel loss, against the same Llama on one process: losses, gradient norms and
    parameters within 1e-5."""
    pytest.importorskip("transformers")
    from sequence_hf_tasks import train_hf_sequence_parallel
    for r in pool.run(train_hf_sequence_parallel, 4, stage, sp, kv_heads):
        for got, want in zip(r["norms"] + r["losses"], r["ref_norms"] + r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["norms"], r["ref_norms"], r["losses"], r["ref_losses"])
        for name, want in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_the_data_loader_adapter_serves_each_ranks_batch_sliced(pool):
    from sequence_hf_tasks import adapter_slices
    results = pool.run(adapter_slices, 4)
    for rank, r in enumerate(results):
        assert r["length"] == 4 and r["stopped"]
        for source, b in enumerate(r["served"]):
            ids = [100 * source + i for i in range(8)]
            assert b["input_ids"] == [ids[2 * rank:2 * rank + 2]]
            assert b["position_ids"] == [list(range(2 * rank, 2 * rank + 2))]
            assert b["shift_labels"] == [(ids[1:] + [-100])[2 * rank:2 * rank + 2]]
            assert b["tag"] == source and "labels" not in b
        assert "no 'position_ids'" in r["error"]


def test_flex_attention_under_ulysses_gives_the_whole_sequences_output(pool):
    """The model's flex ``BlockMask`` is made for a rank's slice; the wrapper attends causally over
    the whole sequence instead. Forward only: torch has no flex attention backward on the CPU."""
    from sequence_hf_tasks import flex_forward
    for diff in pool.run(flex_forward, 4):
        assert diff < 1e-5, diff


def test_eager_attention_is_refused_with_what_to_use():
    pytest.importorskip("transformers")
    from zerodp.parallel.sequence_hf import UlyssesSPAttentionHF
    with pytest.raises(ValueError, match="'eager'.*use sdpa, flash_attention_2/3 or flex_attention"):
        UlyssesSPAttentionHF.register_with_transformers("unused", "eager", 2, 1)

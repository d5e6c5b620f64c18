"""The engine's measured memory and communication equal the ZeRO accounting (SPEC.md).

fp32 AdamW: parameters 4 bytes, gradients 4 bytes, Adam moments 8 bytes per element;
stage 1 shards the moments, stage 2 the gradients as well. Communication per step, counted
as ring bytes sent per rank: 2 x 4 bytes x Psi x (N-1)/N at every stage 0-2.
"""
import pytest
from theory_tasks import collective_buffers, measure

WIDTHS = [16, 16, 16, 16]          # three 16x16 weights: Psi = 768, divisible by 4 x 4 elements
PSI = 3 * 16 * 16


def expected_memory(stage: int, psi: int, n: int) -> dict:
    shard = psi // n
    return {"parameters": 4 * (shard if stage >= 3 else psi),
            "gradients": 4 * (shard if stage >= 2 else psi),
            "optimizer_states": 8 * (shard if stage >= 1 else psi),
            "master_weights": 0}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_and_comm_match_theory(pool, stage, world):
    """Stage 3: 16 bytes x Psi / N of model state; every 16x16 layer is a unit, gathered for
    forward and again for backward, so traffic is 3 x 4 bytes x Psi x (N-1)/N, less one
    all-gather of the last layer: with prefetching on it stays gathered from its forward to
    its backward, which comes next (``test_stage3_without_prefetch_moves_three_psi``: all of it)."""
    results = pool.run(measure, world, stage, WIDTHS)
    ring = (world - 1) / world
    for rank, res in enumerate(results):
        # one 768-element group needs no padding; stage 3's three 256-element units are
        # padded to 16-byte shards (at N = 3: 3 x 264)
        psi = sum(p for _, p in res["layout"])
        assert 0 <= psi - PSI < 4 * world * len(res["layout"])
        assert psi == PSI or (stage == 3 and world == 3)
        mem = res["memory"]
        want = expected_memory(stage, psi, world)
        if psi != PSI:  # Adam moments exist for real elements only, none for padding
            want["optimizer_states"] = None
            assert sum(r["memory"]["optimizer_states"] for r in results) == 8 * PSI
        for key, value in want.items():
            assert value is None or mem[key] == value, f"rank {rank} {key}: {mem[key]} != {value}"
        assert mem["gradient_buckets"] == 0 and mem["gathered_parameters"] == 0
        # stages 2-3 free the gradient shard after the update (the next backward makes it again)
        assert res["grads_between_steps"] == (mem["gradients"] if stage < 2 else 0)
        if psi == PSI:
            assert mem["model_states"] == sum(want.values())
        comm = res["comm"]
        bulk = comm["all_reduce"] + comm["reduce_scatter"] + comm["all_gather"]
        last_unit = psi // 3  # three equal units
        passes = 3 if stage == 3 else 2
        kept = last_unit if stage == 3 else 0
        assert bulk == pytest.approx(4 * (passes * psi - kept) * ring, abs=4), f"rank {rank}: {comm}"
        if world > 1:
            if stage == 3:
                assert comm["all_gather"] == pytest.approx(4 * (2 * psi - last_unit) * ring, abs=3)
                assert comm["reduce_scatter"] == pytest.approx(4 * psi * ring, abs=3)
            elif stage == 0:
                assert comm["all_reduce"] == pytest.approx(2 * 4 * PSI * ring, abs=1)
            else:
                assert comm["reduce_scatter"] == pytest.approx(4 * PSI * ring, abs=1)
                assert comm["all_gather"] == pytest.approx(4 * PSI * ring, abs=1)
            assert 0 < comm["control"] < 200  # one small vector: grad norm and usage flags
        else:
            assert comm["total"] == 0


@pytest.mark.parametrize("world", [2, 3])
def test_stage3_without_prefetch_moves_three_psi(pool, world):
    """Without prefetching every unit is gathered for its forward and again for its backward,
    the last one too: 2 x Psi gathered and Psi reduce-scattered, ring bytes."""
    results = pool.run(measure, world, 3, WIDTHS, prefetch=0)
    ring = (world - 1) / world
    for res in results:
        psi = sum(p for _, p in res["layout"])
        assert res["comm"]["all_gather"] == pytest.approx(2 * 4 * psi * ring, abs=3)
        assert res["comm"]["reduce_scatter"] == pytest.approx(4 * psi * ring, abs=3)


def expected_mixed_memory(stage: int, psi: int, n: int) -> dict:
    """SPEC's mixed-precision accounting: 16-bit parameters 2, 16-bit gradients 2, fp32 master
    4 and Adam moments 8 bytes per element: 16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N, 16 Psi/N."""
    shard = psi // n
    return {"parameters": 2 * (shard if stage >= 3 else psi),
            "gradients": 2 * (shard if stage >= 2 else psi),
            "master_weights": 4 * (shard if stage >= 1 else psi),
            "optimizer_states": 8 * (shard if stage >= 1 else psi)}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_memory_and_comm_match_theory(pool, stage, world, precision):
    """16-bit training: the ledger is (2 + 2 + 12) Psi split as SPEC says, and every
    collective moves 16-bit gradients and parameters: half the fp32 bytes."""
    results = pool.run(measure, world, stage, WIDTHS, precision=precision)
    ring = (world - 1) / world
    want = expected_mixed_memory(stage, PSI, world)
    totals = {0: 16 * PSI, 1: 4 * PSI + 12 * PSI // world, 2: 2 * PSI + 14 * PSI // world,
              3: 16 * PSI // world}
    for rank, res in enumerate(results):
        assert sum(p for _, p in res["layout"]) == PSI  # no padding at these sizes
        mem = res["memory"]
        for key, value in want.items():
            assert mem[key] == value, f"rank {rank} {key}: {mem[key]} != {value}"
        assert mem["model_states"] == totals[stage]
        comm = res["comm"]
        bulk = comm["all_reduce"] + comm["reduce_scatter"] + comm["all_gather"]
        passes = 3 if stage == 3 else 2
        kept = PSI // 3 if stage == 3 else 0  # the last unit, gathered once (see above)
        assert bulk == pytest.approx(2 * (passes * PSI - kept) * ring, abs=4), f"rank {rank}: {comm}"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_accumulation_traffic(pool, stage):
    """With 3 micro-batches per step, stages 0-1 still reduce once per step (gradients
    accumulate in the full buffer); stage 2 reduce-scatters every micro-batch."""
    world = 2
    results = pool.run(measure, world, stage, WIDTHS, gas=3)
    half = 4 * PSI * (world - 1) / world
    comm = results[0]["comm"]
    if stage == 0:
        assert comm["all_reduce"] == pytest.approx(2 * half, abs=1)
    elif stage == 1:
        assert comm["reduce_scatter"] == pytest.approx(half, abs=1)
    else:
        assert comm["reduce_scatter"] == pytest.approx(3 * half, abs=2)


@pytest.mark.parametrize("stage", [1, 2])
def test_padding_is_bounded(pool, stage):
    """Odd sizes and many small buckets: the ledger equals the theory on the padded sizes,
    and padding is less than one 16-byte unit per rank per flat group."""
    world = 3
    widths = [5, 7, 3, 9]
    psi = 5 * 7 + 7 * 3 + 3 * 9
    results = pool.run(measure, world, stage, widths, bucket=30)
    layout = results[0]["layout"]
    assert sum(numel for numel, _ in layout) == psi
    padded = sum(p for _, p in layout)
    for numel, p in layout:
        assert p % (world * 4) == 0 and 0 <= p - numel < world * 4
    mem = results[0]["memory"]
    assert mem["parameters"] == 4 * padded
    # moments exist for real elements only, each on exactly one rank
    assert sum(r["memory"]["optimizer_states"] for r in results) == 8 * psi
    assert mem["gradients"] == (4 * padded // world if stage == 2 else 4 * padded)


def test_stage2_buckets_are_bounded(pool):
    """Stage 2 holds full-size gradient buckets only transiently: at most the buckets in
    flight plus the one filling, never the whole model's gradients."""
    widths = [16] * 9                       # eight 16x16 layers, one flat group each
    results = pool.run(measure, 2, 2, widths, bucket=256)
    group_bytes = 4 * 256
    for res in results:
        assert len(res["layout"]) == 8
        assert res["memory"]["gradient_buckets"] == 0
        assert group_bytes <= res["memory"]["gradient_buckets_peak"] <= 3 * group_bytes


@pytest.mark.parametrize("stage", [2, 3])
def test_the_ledger_counts_the_buffers_kept_for_collectives(pool, stage):
    """On gloo the all-to-all's transient buffers are kept for reuse: the ledger reports them
    (at least what the largest group's reduce-scatter needed; at stage 2 at most a full-size
    buffer per operation that can be in flight, at stage 3 one: the units' gathers and the
    reductions take turns with the stage-3 object's buffer), and destroying the engine frees them.
    At world size 2 the reduce-scatter is an exchange: a step's first reduction of a group lands
    in its gradient shard (no buffer); a later one, in gradient accumulation, receives the peer's
    half into a buffer of the pool."""
    widths = [8, 64, 16, 32, 8]
    for world, gas, least in ((3, 1, 1.0), (2, 2, 0.5), (2, 1, 0.0)):
        results = pool.run(collective_buffers, world, stage, widths, gas)
        for res in results:
            largest = 4 * max(padded for _, padded in res["layout"])
            held = res["memory"]["collective_buffers"]
            if least == 0 and stage == 2:  # nothing gathered, and no reduction through the pool
                assert held == 0, held
            most = largest if stage == 3 else 4 * largest
            assert least * largest <= held <= most, (world, gas, held, largest)
            assert res["held_after_destroy"] == 0

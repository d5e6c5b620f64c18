"""``Comm`` on gloo: each form of reduce-scatter and all-gather gives the sums and gathers (the
reduce-scatter in place or into a tensor of its own), and
each counts as one collective in the engine's counter; ``auto`` is the all-to-all at every
size, whose transient buffers come from a pool and go back to it."""
import pytest
from collective_tasks import capped_pool_operations, each_form, pooled_operations

from zerodp.core.collectives import GLOO_FORMS

SMALL, LARGE = 1000, (1 << 20) // 4 + 8  # elements per chunk: 4 kB, just over 1 MiB


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("form,chunk", [(f, SMALL) for f in GLOO_FORMS] + [("auto", LARGE)])
def test_reduce_scatter_and_all_gather_in_each_form(pool, world, form, chunk):
    results = pool.run(each_form, world, chunk, form)
    want = form if form != "auto" else "all_to_all"
    for r in results:
        assert r["backend"] == "gloo"
        assert r["form"] == want
        assert r["reduce_scatter"] and r["reduce_scatter_out"] and r["all_gather"]
        assert r["calls"] == 3


def test_an_unknown_form_is_refused(monkeypatch):
    from zerodp.core.collectives import GLOO_FORMS_ENV, gloo_form
    monkeypatch.setenv(GLOO_FORMS_ENV, "ring")
    with pytest.raises(ValueError,
                       match="ZERODP_GLOO_COLLECTIVES='ring': allowed: auto, all_to_all, per_owner, tensor"):
        gloo_form()


@pytest.mark.parametrize("world", [2, 3])
def test_the_all_to_all_reuses_its_buffers(pool, world):
    """Three reduce-scatters and two all-gathers in flight at once, in fp32 and bf16, twice:
    every result right, a buffer of its own for each operation in flight (at world size 2 the
    exchange needs one for a reduce-scatter only, of one chunk), and the second round served
    from the first round's buffers (the pool holds the same bytes after it, all given back)."""
    for r in pool.run(pooled_operations, world):
        assert r["results_ok"] == [True] * 10
        assert r["lent_in_flight"] == ([3, 3] if world == 2 else [5, 5])
        assert r["held_after_first"] == r["held_after_second"] > 0
        assert r["lent_after"] == 0
    if world == 2:  # one chunk per reduce-scatter: 3000 + 1000 + 5000 elements, fp32 / bf16 / fp32
        assert r["held_after_first"] == 4 * 3000 + 2 * 1000 + 4 * 5000


def test_a_pool_of_capacity_one_lends_one_buffer_at_a_time(pool):
    """Stage 3's pool: five operations issued at once at world size 3 each wait for the one
    holding the buffer; every result is right and the pool holds one buffer, the size of the
    largest operation (an all-gather of 5000-element chunks), and the default pool is not used."""
    for r in pool.run(capped_pool_operations, 3):
        assert r["results_ok"] == [True] * 5
        assert r["lent_in_flight"] == [1] * 5
        assert r["held"] == 4 * 5000 * 3
        assert r["lent_after"] == 0 and r["default_pool_grew"] == 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_collectives_per_step_do_not_grow_with_the_world_size(pool, stage):
    """A training step (clipping on) calls the same collectives, as many times, at world sizes
    2 and 4: every reduce-scatter and all-gather is one collective whatever the number of
    owners, and so is the ranks' check that they run the same units (stage 3)."""
    from collective_tasks import collectives_per_step
    two, four = pool.run(collectives_per_step, 2, stage), pool.run(collectives_per_step, 4, stage)
    assert all(r == two[0] for r in two + four), (two, four)
    assert sum(two[0].values()) > 0


def test_the_count_sees_collectives_that_grow_with_the_world_size(pool):
    """The same count with one broadcast per owner (``per_owner``) grows from 2 to 4 ranks."""
    from collective_tasks import collectives_per_step
    two = pool.run(collectives_per_step, 2, 3, "per_owner")[0]
    four = pool.run(collectives_per_step, 4, 3, "per_owner")[0]
    assert sum(four.values()) > sum(two.values()), (two, four)

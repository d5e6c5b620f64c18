"""``Comm`` on gloo: both forms of reduce-scatter and all-gather give the sums and gathers, and
each counts as one collective in the engine's counter."""
import pytest
from collective_tasks import both_forms

from zerodp.core.collectives import GLOO_OWNER_MIN_BYTES


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("chunk", [1000, GLOO_OWNER_MIN_BYTES // 4 + 8])
def test_reduce_scatter_and_all_gather_in_both_forms(pool, world, chunk):
    results = pool.run(both_forms, world, chunk)
    for r in results:
        assert r["backend"] == "gloo"
        assert r["owner_form"] == (chunk * 4 >= GLOO_OWNER_MIN_BYTES)
        assert r["reduce_scatter"] and r["all_gather"]
        assert r["calls"] == 2

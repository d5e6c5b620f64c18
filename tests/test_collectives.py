"""``Comm`` on gloo: each form of reduce-scatter and all-gather gives the sums and gathers, and
each counts as one collective in the engine's counter; ``auto`` picks the all-to-all below
``GLOO_OWNER_MIN_BYTES`` per chunk and one operation per owner from there."""
import pytest
from collective_tasks import each_form

from zerodp.core.collectives import GLOO_FORMS, GLOO_OWNER_MIN_BYTES

SMALL, LARGE = 1000, GLOO_OWNER_MIN_BYTES // 4 + 8


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("form,chunk", [(f, SMALL) for f in GLOO_FORMS] + [("auto", LARGE)])
def test_reduce_scatter_and_all_gather_in_each_form(pool, world, form, chunk):
    results = pool.run(each_form, world, chunk, form)
    want = form if form != "auto" else ("per_owner" if chunk == LARGE else "all_to_all")
    for r in results:
        assert r["backend"] == "gloo"
        assert r["form"] == want
        assert r["reduce_scatter"] and r["all_gather"]
        assert r["calls"] == 2


def test_an_unknown_form_is_refused(monkeypatch):
    from zerodp.core.collectives import GLOO_FORMS_ENV, gloo_form
    monkeypatch.setenv(GLOO_FORMS_ENV, "ring")
    with pytest.raises(ValueError,
                       match="ZERODP_GLOO_COLLECTIVES='ring': allowed: auto, all_to_all, per_owner, tensor"):
        gloo_form()

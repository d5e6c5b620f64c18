"""Each flat group shards and reduces over its own axis (``core/axes.py``): the ground on which
expert parameters shard over the expert-data ranks while dense ones use the whole data axis."""
from __future__ import annotations

import pytest

from zerodp.core.axes import DATA, ShardAxes


def test_the_axes_always_hold_the_data_axis_and_name_a_missing_one():
    with pytest.raises(ValueError, match="'data'"):
        ShardAxes({"pair": object()})
    axes = ShardAxes({DATA: "data-comm"}).with_axis("pair", "pair-comm")
    assert axes.names == [DATA, "pair"] and axes.comm("pair") == "pair-comm"
    with pytest.raises(ValueError, match="already"):
        axes.with_axis("pair", "again")
    with pytest.raises(KeyError, match="no shard axis 'expert'"):
        axes.comm("expert")


@pytest.mark.parametrize("stage", [1, 2])
def test_a_group_reduces_over_its_own_axis(pool, stage):
    from axes_tasks import reduce_over_own_axis
    for rank, r in enumerate(pool.run(reduce_over_own_axis, 4, stage)):
        by_axis = {g["axis"]: g for g in r["groups"]}
        assert set(by_axis) == {DATA, "pair"}
        assert by_axis[DATA]["partitions"] == 4 and by_axis[DATA]["rank"] == rank
        assert by_axis["pair"]["partitions"] == 2 and by_axis["pair"]["rank"] == rank % 2
        assert all(g["ok"] for g in r["groups"]), r


def test_a_stage3_group_gathers_from_its_own_axis(pool):
    from axes_tasks import gather_over_own_axis
    for r in pool.run(gather_over_own_axis, 4):
        assert r["released"] and r["same"] and r["axes"] == [DATA, "pair"], r

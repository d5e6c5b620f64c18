"""The grid's layout (``core/layout.py``): ordered named axes, the rank formula and its inverse, the
groups along some axes, and how many of a group's ranks share a node; the grid, the checkpoint's file
numbering, the estimator and the simulator all use it."""
from __future__ import annotations

import itertools

import pytest

from zerodp.core.layout import ORDER, Layout


def test_axes_keep_the_grid_order_whatever_order_they_are_given_in():
    assert Layout.of(tensor=2, pipe=3, shard=4).names == ("pipe", "shard", "tensor")
    assert [n for n in ORDER] == ["pipe", "replica", "shard", "sequence", "expert", "tensor"]
    with pytest.raises(ValueError, match="unknown grid axes"):
        Layout.of(data=2)
    with pytest.raises(ValueError, match="positive"):
        Layout.of(shard=0)


@pytest.mark.parametrize("sizes", [dict(pipe=2, shard=3, tensor=2), dict(replica=2, shard=2, tensor=1),
                                   dict(pipe=2, replica=1, shard=2, sequence=2, expert=2, tensor=2)])
def test_rank_of_is_the_mixed_radix_number_and_coords_its_inverse(sizes):
    layout = Layout.of(**sizes)
    names = layout.names
    seen = []
    for values in itertools.product(*(range(sizes[n]) for n in names)):
        coords = dict(zip(names, values))
        rank = layout.rank_of(coords)
        expected = 0
        for n in names:  # the last axis varies fastest
            expected = expected * sizes[n] + coords[n]
        assert rank == expected and layout.coords(rank) == coords
        seen.append(rank)
    assert sorted(seen) == list(range(layout.world))
    with pytest.raises(ValueError, match="outside"):
        layout.coords(layout.world)


def test_groups_partition_the_ranks_and_differ_only_along_their_axes():
    layout = Layout.of(pipe=2, replica=2, shard=3, tensor=2)
    for along in (["tensor"], ["shard"], ["replica", "shard"], ["pipe"], ["pipe", "tensor"]):
        groups = layout.groups(along)
        assert sorted(r for g in groups for r in g) == list(range(layout.world))
        assert all(len(g) == layout.size(*along) for g in groups)
        for g in groups:
            fixed = [{k: v for k, v in layout.coords(r).items() if k not in along} for r in g]
            assert all(f == fixed[0] for f in fixed)
            moving = [tuple(layout.coords(r)[k] for k in layout.names if k in along) for r in g]
            assert moving == sorted(moving)  # in order of their coordinates along the axes
    # the data axis without a pipeline or tensor split is the ranks in order; a tensor group adjacent ranks
    assert Layout.of(shard=4).groups(["shard"]) == [[0, 1, 2, 3]]
    assert Layout.of(shard=2, tensor=2).groups(["tensor"]) == [[0, 1], [2, 3]]
    assert Layout.of(shard=2, tensor=2).groups(["shard"]) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("per_node,pp,dp,tp", [(8, 1, 16, 1), (8, 1, 8, 2), (8, 2, 4, 2), (4, 1, 2, 8),
                                               (8, 4, 2, 1), (16, 2, 8, 2), (1, 2, 2, 2)])
def test_together_counts_a_groups_ranks_on_one_node(per_node, pp, dp, tp):
    """Nodes are consecutive ranks; with the tensor axis innermost the closed forms hold when the sizes
    divide the node: a tensor group has min(tp, per_node) there, a data group min(dp, per_node / tp)
    (at least the one rank), and a pipeline of two stages or more is inside one node when the whole grid is."""
    layout = Layout.of(pipe=pp, shard=dp, tensor=tp)
    assert layout.together(["tensor"], per_node) == min(tp, per_node)
    assert layout.together(["shard"], per_node) == max(1, min(dp, per_node // tp))
    if pp > 1:
        assert (layout.together(["pipe"], per_node) == pp) == (pp * dp * tp <= per_node)

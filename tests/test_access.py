"""Stage 3 gathers a parameter that a module reads without calling its owner (``core/access.py``), as
DeepSpeed does: PyTorch's own ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``
(``nn.MultiheadAttention`` reads ``out_proj.weight``), a torchvision-style ViT and a hand-written
attention train at stage 3 exactly as in one process, forward and backward, and evaluate alike; a
parameter reached another way is named in the error with the module whose forward failed."""
from __future__ import annotations

import access_tasks as at
import pytest


@pytest.mark.parametrize("kind,prefetch", [("encoder", 0), ("encoder", 10**6), ("decoder", 0), ("vit", 0),
                                           ("vit", 10**6), ("custom", 0)])
def test_a_parameter_read_without_its_module_is_gathered(pool, kind, prefetch):
    """Every module a unit (threshold 0), so ``out_proj`` (never called) is a unit no hook of its own
    gathers. Before, the first forward stopped with torch's ``mat2 must be a matrix, got 1-D tensor``."""
    world = 2
    out = pool.run(at.train, world, kind, prefetch)
    want = at.reference(kind, world)
    for rank, r in enumerate(out):
        for got, ref in zip(r["losses"], want["losses"]):
            assert abs(got - ref) <= 1e-6 * max(1.0, abs(ref)), (rank, r["losses"], want["losses"])
        assert abs(r["eval"] - want["eval"]) <= 1e-6 * max(1.0, abs(want["eval"])), (rank, r["eval"], want["eval"])
        assert set(r["params"]) == set(want["params"])
        for name, value in want["params"].items():
            err = (r["params"][name] - value).abs().max().item()
            assert err <= 2e-6, f"rank {rank} {name}: {err:.3g}"
        assert r["gathered_after"] == 0  # what a read gathered was released with its reader


def test_a_parameter_reached_another_way_is_named(pool):
    """A weight kept in a plain list and read through it is not noticed; the error names the module
    whose forward failed and the parameters under it that were not gathered, after torch's own message."""
    for e in pool.run(at.unreachable, 2):
        assert "the forward of the model (a KeepsAList)" in e, e
        assert "inner.weight" in e and "register_external_parameter" in e, e

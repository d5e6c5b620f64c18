"""``activation_checkpointing.cpu_checkpointing``: checkpointed layers' inputs wait in host memory
(``zerodp/offload/activations.py``) and training is unchanged."""
from __future__ import annotations

import pytest
import torch
from activation_offload_tasks import BATCH, LAYERS, SEQ, train_llama
from torch import nn


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_checkpoints_train_as_without_them(pool, stage):
    plain = pool.run(train_llama, 2, stage, False, False)
    off = pool.run(train_llama, 2, stage, True, True, True)
    for a, b in zip(plain, off):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
        torch.testing.assert_close(b["params"], a["params"], rtol=1e-6, atol=1e-7)
    steps = len(off[0]["losses"])
    for r in off:
        # every decoder layer's hidden states, each step, went out and came back
        assert r["marked"] == r["offloaded"] == r["restored"] == LAYERS * steps
        assert r["bytes"] == LAYERS * steps * BATCH * SEQ * 32 * 4


def test_only_checkpointed_layers_are_marked_and_a_cpu_run_copies_nothing(pool):
    no_gc, cpu, late = (pool.run(train_llama, 2, 3, gc, True, False, 2, after)
                        for gc, after in ((False, False), (True, False), (True, True)))
    assert no_gc[0]["marked"] == 0
    assert cpu[0]["marked"] == LAYERS * 2 and cpu[0]["offloaded"] == 0  # already in host memory
    assert late[0]["marked"] == LAYERS * 2  # gradient checkpointing turned on after initialize


def test_deepspeed_checkpoint_with_checkpoint_in_cpu_moves_its_inputs():
    import zerodp.checkpointing as ckpt
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    x = torch.randn(8, 64, requires_grad=True)
    want = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    ckpt.configure(deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    ckpt._OWN.copy_host_tensors = True
    ckpt._OWN.reset()
    try:
        got = torch.autograd.grad(ckpt.checkpoint(block, x).square().sum(), [x, *block.parameters()])
        assert ckpt._OWN.stats.offloaded == 1 and ckpt._OWN.stats.restored == 1
    finally:
        ckpt.configure(checkpoint_in_cpu=False)
        ckpt._OWN.copy_host_tensors = False
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a)

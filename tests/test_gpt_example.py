"""Tests for the example GPT model and the standard-library byte corpus."""

import math

import pytest
import torch

from zerodp.examples import GPT, ByteCorpus, GPTConfig, build_gpt


@pytest.fixture(scope="module")
def corpus():
    return ByteCorpus(max_bytes=1 << 20)


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    model = build_gpt("tiny")
    idx = torch.randint(0, 256, (3, 40))
    logits, loss = model(idx)
    assert logits.shape == (3, 40, 256)
    assert loss is None
    logits, loss = model(idx, torch.randint(0, 256, (3, 40)))
    assert loss.ndim == 0
    assert abs(loss.item() - math.log(256)) < 0.3
    loss.backward()
    assert model.wte.weight.grad is not None


def test_tied_weights_and_parameter_count():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    assert model.lm_head.weight is model.wte.weight
    unique = {id(p): p for p in model.parameters()}
    assert model.num_parameters() == sum(p.numel() for p in unique.values())
    untied = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, tie_weights=False))
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.num_parameters() == model.num_parameters() + 256 * 32


def test_deterministic_init_and_presets():
    torch.manual_seed(1)
    a = build_gpt("tiny")
    torch.manual_seed(1)
    b = build_gpt("tiny")
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert a.config.n_layer == 2 and a.config.n_embd == 64 and a.config.block_size == 64
    with pytest.raises(ValueError):
        build_gpt("huge")
    with pytest.raises(ValueError):
        a(torch.zeros(1, 65, dtype=torch.long))


def test_byte_corpus(corpus):
    assert len(corpus) > 100_000
    assert corpus.data.dtype == torch.uint8
    assert len(corpus.train) + len(corpus.val) == len(corpus)
    assert len(corpus.val) == pytest.approx(0.05 * len(corpus), abs=2)
    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        x, y = corpus.batch(split, 4, 32, generator=g)
        assert x.shape == y.shape == (4, 32)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert int(x.min()) >= 0 and int(x.max()) < 256
    xa, _ = corpus.batch("train", 2, 16, generator=torch.Generator().manual_seed(5))
    xb, _ = corpus.batch("train", 2, 16, generator=torch.Generator().manual_seed(5))
    assert torch.equal(xa, xb)
    with pytest.raises(ValueError):
        corpus.batch("test", 1, 8)


def test_byte_corpus_windows_are_contiguous_text(corpus):
    x, y = corpus.batch("train", 1, 16, generator=torch.Generator().manual_seed(3))
    data = corpus.train
    # Locate the window and check y is exactly the next bytes of the corpus.
    window = torch.cat([x[0], y[0, -1:]]).to(torch.uint8)
    assert bool((data.unfold(0, 17, 1) == window).all(dim=1).any())

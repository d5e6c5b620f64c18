"""The estimator with Ulysses sequence parallelism, ALST's tiled MLP and loss, and checkpointed
activations in host memory (``zerodp estimate --sp N --seq L --tiled --offload-activations``).

The tiny example GPT: 2 layers, h 64, a 2 heads, MLP width f 256, vocabulary V 256; bf16 (p 2).
Every expected number is worked out by hand from the formulas in ``estimator/activations.py``'s
docstrings, never read back from the estimator.
"""
import pytest

import zerodp
from zerodp.estimator import EstimateError
from zerodp.estimator import activations as acts_mod
from zerodp.tools import cli

GPT = "zerodp.examples.gpt:build_gpt"
TINY = {"preset": "tiny"}


def _est(**kw):
    kw.setdefault("ranks_per_node", 2)
    return zerodp.estimate(GPT, model_kwargs=TINY, micro_batch=2, **kw)


def test_sequence_parallel_activations_split_the_tokens_and_the_heads():
    """sp 2, s 64, b 2: each rank 32 tokens, attention over 64 for 1 head. Per layer
    34·32·2·64 + 5·1·64²·2 = 139,264 + 40,960; logits 32·2·256·(2 + 4) = 98,304."""
    est = _est(seq_len=64, sp=2)
    a = est.activations
    assert a.per_layer == 139_264 + 40_960
    assert a.logits == 98_304
    assert a.bytes == 2 * 180_224 + 98_304
    plain = _est(seq_len=64).activations
    assert plain.bytes == 2 * (34 * 64 * 2 * 64 + 5 * 2 * 64 * 64 * 2) + 64 * 2 * 256 * 6
    # ZeRO still shards over both ranks: the model states are those of 2 data-parallel ranks
    assert est.row(3).model_states == _est(seq_len=64).row(3).model_states
    assert est.to_dict()["sp"] == 2


def test_tiled_mlp_and_loss_keep_one_tile():
    """s 512 over sp 2: 256 tokens per rank, in ceil(256 / 64) = 4 MLP tiles of 64. The MLP keeps
    its input 256·2·2·64 = 65,536 and one tile's 64·2·(64 + 4·256) = 139,264 instead of
    256·2·(3·64 + 4·256) = 622,592; the rest of the layer 15·256·2·64 = 491,520 and the scores
    5·1·512²·2 = 2,621,440 are unchanged. With one loss tile held to 16 tokens (3,072 bytes of
    logits a token): 256·2·64·2 = 65,536 hidden states + 16·3,072."""
    rest = 491_520 + 2_621_440
    plain = _est(seq_len=512, sp=2).activations
    assert plain.per_layer == rest + 622_592 and plain.logits == 256 * 3_072
    tiled = _est(seq_len=512, sp=2, tiled=True).activations
    assert tiled.per_layer == rest + 65_536 + 139_264
    old = acts_mod.LOSS_TILE_BYTES
    acts_mod.LOSS_TILE_BYTES = 16 * 3_072
    try:
        assert _est(seq_len=512, sp=2, tiled=True).activations.logits == 65_536 + 16 * 3_072
    finally:
        acts_mod.LOSS_TILE_BYTES = old


def test_offloaded_checkpoints_leave_two_layer_inputs_on_the_device():
    """Checkpointing at s 512, sp 2: a layer's input is 256·2·64·2 = 65,536 bytes; the device keeps
    both layers' (131,072) or, offloaded, two in flight (131,072 as well with 2 layers) and the
    host the 2 layers' 131,072. With 2 layers the device saving is nil, so the test reads the host."""
    kept = _est(seq_len=512, sp=2, checkpointing=True).activations
    off = _est(seq_len=512, sp=2, checkpointing=True, offload_activations=True).activations
    assert off.host == 2 * 65_536 and kept.host == 0
    assert off.bytes == kept.bytes  # 2 inputs either way with 2 layers
    with pytest.raises(EstimateError) as e:
        _est(seq_len=512, offload_activations=True)
    assert e.value.name == "offload_activations"


def test_the_longest_sequence_that_fits_is_the_last_that_does():
    for kw in ({}, {"sp": 2}, {"sp": 2, "tiled": True, "checkpointing": True, "offload_activations": True}):
        est = _est(device_memory="8MB", **kw)
        sp = kw.get("sp", 1)
        for row in (est.row(0), est.row(3)):
            s = row.longest_seq
            assert s is not None and s % sp == 0
            left = 8 * 10**6 - (row.device_total - row.activations)
            assert _est(seq_len=s, **kw).activations.bytes <= left < _est(seq_len=s + sp, **kw).activations.bytes
    # more ranks per sequence: a longer sequence fits
    assert _est(device_memory="8MB", sp=2).row(3).longest_seq > _est(device_memory="8MB").row(3).longest_seq


@pytest.mark.parametrize("kw,name", [
    ({"sp": 3}, "sp"),                                     # 3 does not divide 2 ranks
    ({"sp": 2, "tp": 2, "ranks_per_node": 4}, "sp"),       # refused with tensor parallelism
    ({"sp": 4, "ranks_per_node": 4}, "sp"),                # 2 heads do not split over 4
    ({"sp": 2, "seq_len": 63}, "seq_len"),                 # 63 tokens do not split over 2
    ({"sp": 2, "shard_size": 1}, "sp"),                    # hybrid sharding
    ({"sp": 2, "cluster": "h100-8x"}, "sp"),               # step times are not modelled
])
def test_sequence_parallel_refusals(kw, name):
    with pytest.raises(EstimateError) as e:
        _est(**kw)
    assert e.value.name == name


def test_cli_sequence_options(capsys):
    code = cli.main(["estimate", "--model", GPT, "--model-kwargs", '{"preset": "tiny"}', "--ranks-per-node", "2",
                     "--sp", "2", "--seq", "64", "--micro-batch", "2", "--device-memory", "8MB", "--tiled",
                     "--checkpointing", "--offload-activations"])
    out = capsys.readouterr().out
    assert code == 0
    assert "sequence 64, 32 per rank" in out and "in host memory" in out
    assert "longest sequence within 8.0 MB (micro-batch 2, sequence-parallel 2): stage 0 " in out
    assert cli.main(["estimate", "--model", GPT, "--model-kwargs", '{"preset": "tiny"}', "--sp", "2"]) == 2
    assert "--sp: 2 does not divide the 1 ranks" in capsys.readouterr().err

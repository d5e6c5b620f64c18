"""Tensor files: valid safetensors, range reads into any destination, checksums that catch damage."""
from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from zerodp.checkpoint import tensorfile as tf
from zerodp.checkpoint.source import CheckpointError

ROUNDS = 40


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 256 bytes and reads of 1 KiB, so a small file has many of each."""
    monkeypatch.setattr(tf, "BLOCK", 256)
    monkeypatch.setattr(tf, "READ_CHUNK", 1024)
    monkeypatch.setattr(tf, "WRITEBACK_BYTES", 512)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(301, generator=g), "b": torch.randn(7, 11, generator=g).to(torch.bfloat16),
            "c": torch.randint(0, 1000, (53,), generator=g), "d": torch.randint(0, 255, (29,), dtype=torch.uint8),
            "e": torch.randn(5, generator=g).double()}


def write(path, ts, parts: int = 1):
    specs = [tf.TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in ts.items()]
    w = tf.TensorWriter(path, specs, metadata={"x": "y"})
    for spec in w.order:
        flat = ts[spec.name].reshape(-1)
        w.write(spec.name, list(flat.chunk(parts)) if flat.numel() >= parts else [flat])
    return w.close()


def test_files_are_safetensors_written_in_parts(tmp_path, small_blocks):
    ts = tensors()
    record = write(tmp_path / "f.safetensors", ts, parts=3)
    assert record.block == 256 and len(record.crc32) == -(-record.bytes // 256)
    back = load_file(str(tmp_path / "f.safetensors"))
    assert back.keys() == ts.keys() and all(torch.equal(back[k], ts[k]) for k in ts)
    f = tf.TensorFile(tmp_path / "f.safetensors", record)
    assert f.metadata == {"x": "y"}
    for e in f.entries.values():  # every tensor starts at a multiple of its element size
        assert e.begin % e.element_size == 0


def test_random_range_reads_into_any_destination(tmp_path, small_blocks):
    ts = tensors()
    record = write(tmp_path / "f.safetensors", ts)
    f = tf.TensorFile(tmp_path / "f.safetensors", record)
    rng = random.Random(1)
    for _ in range(ROUNDS):
        requests, wants = [], []
        for _ in range(rng.randint(1, 6)):
            name = rng.choice(list(ts))
            flat = ts[name].reshape(-1)
            lo = rng.randrange(flat.numel())
            hi = rng.randint(lo, flat.numel())
            kind = rng.choice(["same", "cast", "strided"])
            if kind == "same":
                out = torch.empty(hi - lo, dtype=flat.dtype)
            elif kind == "cast":
                out = torch.empty(hi - lo, dtype=torch.float64)
            else:
                out = torch.empty(2 * (hi - lo), dtype=flat.dtype)[::2]
            requests.append((name, lo, hi, out))
            wants.append(flat[lo:hi])
        f.read_ranges(requests)  # requests may overlap one another
        for (name, lo, hi, out), want in zip(requests, wants):
            assert torch.equal(out, want.to(out.dtype)), (name, lo, hi, out.dtype)


def test_a_damaged_block_is_found_where_it_is_read(tmp_path, small_blocks):
    ts = {"a": torch.arange(1000, dtype=torch.float32)}
    path = tmp_path / "f.safetensors"
    record = write(path, ts)
    raw = bytearray(path.read_bytes())
    raw[2000] ^= 1  # a byte of block 7 (bytes 1792-2047)
    path.write_bytes(bytes(raw))
    f = tf.TensorFile(path, record)
    begin = f.entries["a"].begin
    first_bad = (1792 - begin) // 4
    ok = torch.empty(100)
    f.read_ranges([("a", 0, 100, ok)])  # blocks before the damage
    assert torch.equal(ok, ts["a"][:100])
    with pytest.raises(CheckpointError, match=r"f.safetensors: checksum mismatch in bytes 1792-2048"):
        f.read_ranges([("a", first_bad + 10, first_bad + 20, torch.empty(10))])


def test_truncation_is_found_on_open(tmp_path):
    path = tmp_path / "f.safetensors"
    record = write(path, tensors())
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=f"{record.bytes - 10} bytes on disk, {record.bytes} when written"):
        tf.TensorFile(path, record)

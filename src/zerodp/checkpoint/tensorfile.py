"""Tensor files: safetensors-format files written as a stream, with a CRC-32 per block, and
read back by byte range.

The file layout is safetensors' own (an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the raw bytes back to back), so any
safetensors reader opens these files. zerodp writes them itself because it needs two things
the library does not give: a checksum computed while the bytes go out, and tensors written
in parts (a shard assembled from several pieces, a consolidated tensor converted chunk by
chunk), so nothing is copied whole before it is written.

Integrity: the writer returns a :class:`FileRecord` with the file's size and the CRC-32 of
every ``BLOCK``-byte block. The reader checks the size when it opens a file (truncation) and
the CRC of every block it reads, so a rank that reads only its byte ranges still verifies all
it uses, and never reads the whole file to do so.

Tensors are laid out in order of decreasing element size, so every tensor starts at a
multiple of its element size (the header is padded to 8 bytes) and byte ranges can be
reinterpreted as their dtype without copying.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from .source import CheckpointError

#: Bytes per checksummed block.
BLOCK = 4 << 20
#: Bytes read at once when verifying and copying out ranges (a multiple of BLOCK).
READ_CHUNK = 8 * BLOCK
#: Segments at least this long are checksummed in a second thread while they are written.
_PARALLEL_CRC = 1 << 20
#: Bytes this process has read from tensor files (what range reads cost, for tests and reports).
STATS = {"bytes_read": 0}

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPE_CODES[getattr(torch, _name)] = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}[_name]
        CODE_DTYPES[DTYPE_CODES[getattr(torch, _name)]] = getattr(torch, _name)

DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
               "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the names checkpoint indexes use)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in DTYPE_NAMES:
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint index")
    return DTYPE_NAMES[name]


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


@dataclass
class FileRecord:
    """Size and per-block CRC-32 of a written file."""

    bytes: int
    crc32: list[int]
    block: int

    def to_json(self) -> dict:
        return {"bytes": self.bytes, "block": self.block, "crc32": self.crc32}

    @classmethod
    def from_json(cls, d: dict) -> "FileRecord":
        return cls(bytes=int(d["bytes"]), crc32=[int(c) for c in d["crc32"]], block=int(d["block"]))


#: Written bytes are handed to the kernel's writeback every this many bytes, so the disk works
#: while the rest is written instead of from the final fsync on (Linux's dirty-page thresholds
#: would otherwise hold gigabytes in the page cache first).
WRITEBACK_BYTES = 64 << 20

_SYNC_FILE_RANGE_WRITE = 2


def _libc_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return fn


_sync_file_range = _libc_sync_file_range()


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing the range to disk without waiting (Linux ``sync_file_range``; elsewhere a no-op:
    the final fsync writes it)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class _Checksum:
    """Running per-block CRC-32 over a byte stream."""

    def __init__(self, block: Optional[int] = None) -> None:
        self.block = block or BLOCK
        self.crcs, self._crc, self._fill = [], 0, 0

    def update(self, mv: memoryview) -> None:
        pos = 0
        while pos < len(mv):
            take = min(len(mv) - pos, self.block - self._fill)
            self._crc = zlib.crc32(mv[pos:pos + take], self._crc)
            self._fill += take
            pos += take
            if self._fill == self.block:
                self.crcs.append(self._crc)
                self._crc, self._fill = 0, 0

    def finish(self) -> list[int]:
        if self._fill:
            self.crcs.append(self._crc)
            self._crc, self._fill = 0, 0
        return self.crcs


def checksum(data: bytes) -> FileRecord:
    """The record of a file holding ``data``."""
    crc = _Checksum()
    crc.update(memoryview(data))
    return FileRecord(bytes=len(data), crc32=crc.finish(), block=crc.block)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def _layout(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """Specs in file order: decreasing element size, then as given (stable)."""
    size = {s.name: torch.empty((), dtype=s.dtype).element_size() for s in specs}
    return sorted(specs, key=lambda s: -size[s.name])


def encode_header(specs: Sequence[TensorSpec], metadata: Optional[dict[str, str]] = None
                  ) -> tuple[bytes, list[TensorSpec]]:
    """The header bytes (length prefix included) and the specs in file order."""
    ordered = _layout(specs)
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for s in ordered:
        if s.dtype not in DTYPE_CODES:
            raise TypeError(f"tensor {s.name!r}: dtype {s.dtype} cannot be stored in a safetensors file")
        header[s.name] = {"dtype": DTYPE_CODES[s.dtype], "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, ordered


class TensorWriter:
    """Write a safetensors file tensor by tensor, each possibly in several parts.

    ``specs`` fixes every tensor's name, dtype and shape up front (the header comes first);
    :meth:`write` must then be called in :attr:`order`, with CPU tensors whose elements,
    concatenated, make up that tensor. :meth:`close` flushes and fsyncs the file and returns
    its :class:`FileRecord`.
    """

    def __init__(self, path: Path, specs: Sequence[TensorSpec],
                 metadata: Optional[dict[str, str]] = None, fsync: bool = True) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("tensor names in one file must be unique")
        header, self.order = encode_header(specs, metadata)
        self.path, self._fsync = Path(path), fsync
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._crc = _Checksum()
        self._pool = ThreadPoolExecutor(1)
        self._next = 0
        self._left = 0  # bytes still owed to the tensor being written
        self._size = 0
        self._flushed = 0  # bytes handed to the disk's writeback so far
        self._write(memoryview(header))

    def _write(self, mv: memoryview) -> None:
        if len(mv) >= _PARALLEL_CRC:
            done = self._pool.submit(self._crc.update, mv)  # zlib and os.write release the GIL
            self._write_all(mv)
            done.result()
        else:
            self._crc.update(mv)
            self._write_all(mv)

    def _write_all(self, mv: memoryview) -> None:
        pos = 0
        while pos < len(mv):
            n = os.write(self._fd, mv[pos:pos + WRITEBACK_BYTES])
            pos += n
            self._size += n
            if self._size - self._flushed >= WRITEBACK_BYTES:  # let the disk start on it now
                _start_writeback(self._fd, self._flushed, self._size - self._flushed)
                self._flushed = self._size

    def write(self, name: str, parts: Iterable[torch.Tensor] | torch.Tensor) -> None:
        """Write tensor ``name`` (the next in :attr:`order`) from ``parts``."""
        if self._next >= len(self.order) or self.order[self._next].name != name:
            want = self.order[self._next].name if self._next < len(self.order) else "nothing"
            raise ValueError(f"tensor {name!r} written out of order: expected {want!r}")
        spec = self.order[self._next]
        self._left = spec.nbytes
        for part in ([parts] if isinstance(parts, torch.Tensor) else parts):
            if part.dtype != spec.dtype:
                raise TypeError(f"tensor {name!r}: part of dtype {part.dtype}, expected {spec.dtype}")
            if part.device.type != "cpu":
                raise ValueError(f"tensor {name!r}: parts must be CPU tensors")
            mv = byte_view(part.contiguous())
            if len(mv) > self._left:
                raise ValueError(f"tensor {name!r}: parts hold more than its {spec.nbytes} bytes")
            self._write(mv)
            self._left -= len(mv)
        if self._left:
            raise ValueError(f"tensor {name!r}: parts hold {spec.nbytes - self._left} of its {spec.nbytes} bytes")
        self._next += 1

    def close(self) -> FileRecord:
        try:
            if self._next != len(self.order):
                raise ValueError(f"file closed with tensor {self.order[self._next].name!r} unwritten")
            if self._fsync:
                os.fsync(self._fd)
        finally:
            self._release()
        return FileRecord(bytes=self._size, crc32=self._crc.finish(), block=self._crc.block)

    def abort(self) -> None:
        """Close without checks (the caller discards the file)."""
        self._release()

    def _release(self) -> None:
        fd, self._fd = self._fd, -1  # closed once: the number may be reused right after
        if fd >= 0:
            os.close(fd)
        self._pool.shutdown()


def write_tensors(path: Path, tensors: dict[str, torch.Tensor],
                  metadata: Optional[dict[str, str]] = None, fsync: bool = True) -> FileRecord:
    """Write whole CPU tensors to a safetensors file (small files: the client state, weights)."""
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    w = TensorWriter(path, specs, metadata, fsync=fsync)
    try:
        for s in w.order:
            w.write(s.name, tensors[s.name].detach().reshape(-1))
    except BaseException:
        w.abort()
        raise
    return w.close()


def _plan_chunks(chunks: list[tuple[int, int]], spans: list[tuple]) -> list[tuple[list, list]]:
    """Per chunk [a, b): the segments one ``preadv`` fills, in file order, as ``(x, y, view)``
    (``view`` the bytes of an out, or None for scratch at offset ``x - a``), and the copies from
    scratch to outs that follow, as ``(x, y, dtype, out slice)``."""
    shared = set()  # spans whose bytes another span also wants: read through scratch
    reach, reach_k = -1, -1
    for k, (lo, hi, _, _) in enumerate(spans):
        if lo < reach:
            shared.update((k, reach_k))
        if hi > reach:
            reach, reach_k = hi, k
    plans = []
    si = 0
    for a, b in chunks:
        while si < len(spans) and spans[si][1] <= a:
            si += 1
        segments: list[tuple[int, int, Optional[memoryview]]] = []
        copies = []
        pos = a
        k = si
        while k < len(spans) and spans[k][0] < b:
            lo, hi, dtype, out = spans[k]
            if hi <= a:  # ends before this chunk (behind a longer span that does not)
                k += 1
                continue
            s0, s1 = max(lo, a), min(hi, b)
            size = torch.empty((), dtype=dtype).element_size()
            piece = out[(s0 - lo) // size:(s1 - lo) // size]
            direct = (k not in shared and out.device.type == "cpu" and out.dtype == dtype
                      and piece.is_contiguous())
            k += 1
            if s0 > pos:
                segments.append((pos, s0, None))
            if direct:
                segments.append((s0, s1, byte_view(piece)))
                pos = s1
            else:  # through scratch (read once even where requests overlap)
                if s1 > pos:
                    segments.append((max(s0, pos), s1, None))
                copies.append((s0, s1, dtype, piece))
                pos = max(pos, s1)
        if pos < b:
            segments.append((pos, b, None))
        plans.append((_merge_scratch(segments), copies))
    return plans


def _merge_scratch(segments: list[tuple]) -> list[tuple]:
    """Adjacent scratch segments as one (fewer iovecs)."""
    merged: list[tuple] = []
    for seg in segments:
        if merged and seg[2] is None and merged[-1][2] is None and merged[-1][1] == seg[0]:
            merged[-1] = (merged[-1][0], seg[1], None)
        else:
            merged.append(seg)
    return merged


_IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024))


def _preadv_all(fd: int, views: list[memoryview], offset: int, path: Path) -> None:
    """Fill ``views`` with the file's bytes from ``offset`` on, in order (short reads resumed)."""
    pending = [v for v in views if len(v)]
    i = 0
    while i < len(pending):
        n = os.preadv(fd, pending[i:i + _IOV_MAX], offset)
        if n <= 0:
            raise CheckpointError(f"{path}: short read at byte {offset}")
        offset += n
        while n:
            if n >= len(pending[i]):
                n -= len(pending[i])
                i += 1
            else:
                pending[i] = pending[i][n:]
                n = 0


def load_file(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, by name (a small reader: no checksum record)."""
    f = TensorFile(path)
    try:
        return {name: f.read(name).to(device) for name in f.entries}
    finally:
        f.close()


@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


class TensorFile:
    """A safetensors file opened for range reads, checked against its :class:`FileRecord`
    (when one is given): size on open, block CRCs on every read."""

    def __init__(self, path: Path, record: Optional[FileRecord] = None) -> None:
        self.path, self.record = Path(path), record
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file missing") from None
        size = os.fstat(self._fd).st_size
        if record is not None and size != record.bytes:
            self.close()
            raise CheckpointError(f"{self.path}: {size} bytes on disk, {record.bytes} when written: "
                                  "the file is truncated or was overwritten")
        self.size = size
        try:
            head = os.pread(self._fd, 8, 0)
            if len(head) < 8:
                raise ValueError("shorter than a header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise ValueError(f"header length {n} does not fit the file")
            raw = os.pread(self._fd, n, 8)
            if record is not None:
                self._check_range(0, 8 + n)
            header = json.loads(raw)
            self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
            base = 8 + n
            self.entries: dict[str, Entry] = {}
            for name, e in header.items():
                lo, hi = e["data_offsets"]
                self.entries[name] = Entry(CODE_DTYPES[e["dtype"]], tuple(e["shape"]), base + lo, base + hi)
                if base + hi > size:
                    raise ValueError(f"tensor {name!r} ends past the end of the file")
        except CheckpointError:
            self.close()
            raise
        except (ValueError, KeyError, TypeError) as e:
            self.close()
            raise CheckpointError(f"{self.path}: not a readable tensor file ({e})") from None

    def close(self) -> None:
        """Close the file (once: a descriptor number closed twice may belong to someone else by then)."""
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- integrity ------------------------------------------------------------------------

    def _check_range(self, lo: int, hi: int) -> None:
        """Read and verify the blocks covering bytes [lo, hi)."""
        b = self.record.block
        start, stop = lo // b * b, min(-(-hi // b) * b, self.size)
        data = os.pread(self._fd, stop - start, start)
        STATS["bytes_read"] += len(data)
        if len(data) != stop - start:
            raise CheckpointError(f"{self.path}: short read at byte {start}")
        self._verify(start, [memoryview(data)])

    # -- reads ----------------------------------------------------------------------------

    def read(self, name: str) -> torch.Tensor:
        """A whole tensor (small tensors: the client state, buffers)."""
        e = self._entry(name)
        out = torch.empty(e.shape, dtype=e.dtype)
        self.read_ranges([(name, 0, out.numel(), out.view(-1))])
        return out

    def _entry(self, name: str) -> Entry:
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: tensor {name!r} missing")
        return self.entries[name]

    def read_ranges(self, requests: list[tuple[str, int, int, torch.Tensor]]) -> None:
        """Fill each ``(name, lo, hi, out)``: elements [lo, hi) of tensor ``name`` into the
        1-D tensor ``out`` (cast to its dtype, on any device).

        Reads go in file order, in chunks of ``READ_CHUNK`` bytes aligned to checksum blocks:
        one ``preadv`` per chunk puts the bytes of each request straight into its ``out`` where
        that is a contiguous CPU tensor of the stored dtype, and everything else (bytes between
        requests, requests to cast or to move to a device) into a scratch buffer. Every block is
        verified against its CRC as read; a second thread reads and verifies the next chunk while
        this one's scratch bytes are copied out."""
        spans = []
        for name, lo, hi, out in requests:
            e = self._entry(name)
            n = (e.end - e.begin) // e.element_size
            if not 0 <= lo <= hi <= n or out.numel() != hi - lo:
                raise ValueError(f"{self.path}: bad read of {name!r} [{lo}, {hi}) of {n} elements "
                                 f"into {out.numel()}")
            if hi > lo:
                spans.append((e.begin + lo * e.element_size, e.begin + hi * e.element_size, e.dtype, out))
        if not spans:
            return
        spans.sort(key=lambda s: s[0])
        align = self.record.block if self.record is not None else 1 << 16
        windows: list[tuple[int, int]] = []  # runs of aligned blocks that cover the requests
        for lo, hi, _, _ in spans:
            a, b = lo // align * align, min(-(-hi // align) * align, self.size)
            if windows and a <= windows[-1][1]:
                windows[-1] = (windows[-1][0], max(windows[-1][1], b))
            else:
                windows.append((a, b))
        step = max(READ_CHUNK // align, 1) * align
        chunks = [(a, min(a + step, w1)) for w0, w1 in windows for a in range(w0, w1, step)]
        plans = _plan_chunks(chunks, spans)
        longest = max(b - a for a, b in chunks)
        scratch = [torch.empty(longest, dtype=torch.uint8) for _ in range(min(2, len(chunks)))]
        pool = ThreadPoolExecutor(1)
        try:
            ahead = pool.submit(self._read_chunk, chunks[0], plans[0], scratch[0])
            for ci in range(len(chunks)):
                buf = ahead.result()
                if ci + 1 < len(chunks):
                    ahead = pool.submit(self._read_chunk, chunks[ci + 1], plans[ci + 1], scratch[(ci + 1) % 2])
                a = chunks[ci][0]
                for s0, s1, dtype, target in plans[ci][1]:  # scratch bytes that belong to an out
                    target.copy_(buf[s0 - a:s1 - a].view(dtype))
        finally:
            pool.shutdown()

    def _read_chunk(self, chunk: tuple[int, int], plan, scratch: torch.Tensor) -> torch.Tensor:
        """Read bytes [a, b) as ``plan`` lays them out (into outs, or ``scratch`` at their offset
        from ``a``) and verify their blocks; returns the scratch buffer."""
        a, b = chunk
        segments, _ = plan
        scratch_mv = byte_view(scratch[:b - a])
        views = [mv if mv is not None else scratch_mv[x - a:y - a] for x, y, mv in segments]
        _preadv_all(self._fd, views, a, self.path)
        STATS["bytes_read"] += b - a
        if self.record is not None:
            self._verify(a, views)
        return scratch

    def _verify(self, start: int, views: list[memoryview]) -> None:
        """Check the CRC of the blocks that ``views`` (the file's bytes from ``start``, a block
        boundary, to a block boundary or the end of the file) make up."""
        rec = self.record
        block, crc, fill = start // rec.block, 0, 0
        for mv in views:
            pos = 0
            while pos < len(mv):
                take = min(len(mv) - pos, rec.block - fill)
                crc = zlib.crc32(mv[pos:pos + take], crc)
                fill += take
                pos += take
                if fill == rec.block:
                    self._check_block(block, crc)
                    block, crc, fill = block + 1, 0, 0
        if fill:
            self._check_block(block, crc)

    def _check_block(self, block: int, crc: int) -> None:
        rec = self.record
        if block >= len(rec.crc32) or crc != rec.crc32[block]:
            lo = block * rec.block
            raise CheckpointError(f"{self.path}: checksum mismatch in bytes {lo}-{min(lo + rec.block, self.size)}: "
                                  "the file is corrupted")

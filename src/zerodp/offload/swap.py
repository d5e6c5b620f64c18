"""Tensors that live in a file and are in memory only while in use (disk offload).

A :class:`SwapDir` is one rank's directory under ``nvme_path`` (made at start, removed when the
engine ends) with a pool of I/O threads. A :class:`PagedTensors` is one tile's tensors (a flat
group's fp32 master and optimizer states): ``page_out`` writes them to their file and frees
their memory; ``page_in`` allocates it again and reads them back. The tensors keep their identity
while paged out: only their storage is resized to zero bytes, so the optimizer's state and the
parameter pieces that are views of them stay valid, and touching them while paged out fails
loudly (torch: "storage of size 0") instead of reading stale data.

I/O is positional reads and writes (``os.preadv`` / ``os.pwritev``) of ``block_size`` bytes,
``queue_depth`` of them in flight at once on a thread pool: the system calls release the GIL,
so the reads of the next tile and the writes of the previous one run while the CPU updates the
current one (``benchmarks/offload.py`` measures this against O_DIRECT and mmap).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable buffer over ``t``'s bytes (for preadv / pwritev). Made from the address, not
    with ``.numpy()``, which would mark the storage as not resizable."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class SwapDir:
    """This rank's swap directory and I/O threads (see module docstring)."""

    def __init__(self, nvme_path: str, rank: int, block_size: int, queue_depth: int) -> None:
        root = Path(nvme_path)
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.dir = Path(tempfile.mkdtemp(prefix=f"zerodp-rank{rank}-", dir=root))
        except OSError as e:
            raise OSError(f"offload nvme_path {str(root)!r}: cannot make a swap directory there: {e}") from None
        self.block_size = block_size
        self.queue_depth = queue_depth
        # tiles: one page-in and one page-out at a time; blocks: their requests, in parallel
        self.tiles = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zerodp-tile")
        self.pool = ThreadPoolExecutor(max_workers=max(1, queue_depth), thread_name_prefix="zerodp-swap")
        self._finalizer = weakref.finalize(self, SwapDir._cleanup, self.tiles, self.pool, self.dir)

    @staticmethod
    def _cleanup(tiles: ThreadPoolExecutor, pool: ThreadPoolExecutor, path: Path) -> None:
        tiles.shutdown(wait=True)
        pool.shutdown(wait=True)
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Wait for I/O in flight and remove the directory."""
        self._finalizer()

    def transfer(self, fd: int, tensors: list[torch.Tensor], offsets: list[int], write: bool) -> None:
        """Read or write ``tensors`` at byte ``offsets`` of ``fd`` in blocks, ``queue_depth`` at a time."""
        jobs = []
        for t, off in zip(tensors, offsets):
            view = _byte_view(t)
            for lo in range(0, len(view), self.block_size):
                jobs.append((view[lo:lo + self.block_size], off + lo))
        op = _pwrite_all if write else _pread_all
        if len(jobs) <= 1:
            for buf, off in jobs:
                op(fd, buf, off)
        else:
            for f in [self.pool.submit(op, fd, buf, off) for buf, off in jobs]:
                f.result()


def _pread_all(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.preadv(fd, [buf], offset)
        if n <= 0:
            raise OSError(f"swap file: short read at byte {offset}")
        buf, offset = buf[n:], offset + n


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.pwritev(fd, [buf], offset)
        buf, offset = buf[n:], offset + n


class PagedTensors:
    """One tile's tensors, kept in ``name.swp`` under the swap directory while paged out."""

    def __init__(self, swap: SwapDir, name: str) -> None:
        self.swap = swap
        self.path = swap.dir / f"{name}.swp"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        weakref.finalize(self, os.close, self.fd)
        self.tensors: list[torch.Tensor] = []
        self.offsets: list[int] = []
        self.size = 0
        self.resident = True
        self._busy: Future | None = None  # a page-in or page-out in flight

    def add(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (a whole, contiguous CPU tensor, resident now) in this tile's file."""
        self.wait()
        if not self.resident:
            raise RuntimeError("PagedTensors.add while paged out")
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or \
                tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            raise ValueError("a paged tensor must be a whole contiguous CPU tensor")
        self.tensors.append(tensor)
        self.offsets.append(self.size)
        self.size += -(-tensor.untyped_storage().nbytes() // 4096) * 4096
        os.ftruncate(self.fd, self.size)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def page_out(self, wait: bool = False, write: bool = True) -> None:
        """Write the tensors to the file and free their memory (in the background unless
        ``wait``); ``write=False`` frees them only (the file already holds what they hold)."""
        self.wait()
        if not self.resident:
            return
        self.resident = False
        if wait or not write:
            self._write_and_free(write)
        else:
            self._busy = self.swap.tiles.submit(self._write_and_free, write)

    def _write_and_free(self, write: bool = True) -> None:
        if write:
            self.swap.transfer(self.fd, self.tensors, self.offsets, write=True)
        for t in self.tensors:
            t.untyped_storage().resize_(0)

    def page_in(self, wait: bool = True, read: bool = True) -> None:
        """Allocate the tensors and read them back (in the background unless ``wait``; a later
        ``wait()`` or ``page_in()`` finishes it); ``read=False`` only allocates them, for a
        caller that overwrites them whole."""
        self.wait()
        if self.resident:
            return
        self.resident = True
        if not read:
            self._allocate_and_read(read=False)
            return
        self._busy = self.swap.tiles.submit(self._allocate_and_read)
        if wait:
            self.wait()

    def _allocate_and_read(self, read: bool = True) -> None:
        for t in self.tensors:
            t.untyped_storage().resize_(t.numel() * t.element_size())
        if read:
            self.swap.transfer(self.fd, self.tensors, self.offsets, write=False)

    def wait(self) -> None:
        """Finish a page-in or page-out in flight (raising its error, if any)."""
        busy, self._busy = self._busy, None
        if busy is not None:
            busy.result()

"""Agreement between ranks around checkpoint I/O, so a rank that fails tells the others.

Every phase of a save or load ends with :meth:`Coordinator.agree`: each rank says whether its
part worked and, if not, why; every rank learns the outcome of all, and all raise together
when any failed, naming the failing ranks and their messages. No rank waits for a peer that
already gave up.

The collectives run on a gloo group (CPU tensors whatever the training backend): the
data-parallel group itself when it is gloo, otherwise one made for checkpoints. An
asynchronous save agrees from a background thread on a group of its own, so its collectives
never interleave with the training step's.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.distributed as dist

from .source import CheckpointError

#: Bytes of each rank's failure message shared with the others.
MESSAGE_BYTES = 1024

_GROUPS: dict[tuple, dist.ProcessGroup] = {}
_LOCK = threading.Lock()


def gloo_group(ranks: list[int], purpose: str) -> dist.ProcessGroup:
    """A gloo group over ``ranks`` (global ranks) for ``purpose``, made once and kept.

    Only the members call this (``use_local_synchronization``), so it works inside a
    subgroup of the world too.
    """
    key = (tuple(ranks), purpose)
    with _LOCK:
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True)
        return _GROUPS[key]


class Coordinator:
    """Agreement over a data-parallel group (see module docstring)."""

    def __init__(self, comm, separate: bool = False) -> None:
        self.world_size, self.rank = comm.world_size, comm.rank
        self.group: Optional[dist.ProcessGroup] = None
        if self.world_size > 1:
            if comm.backend == "gloo" and not separate:
                self.group = comm.group
            else:
                self.group = gloo_group(comm._global_ranks, "checkpoint-async" if separate else "checkpoint")

    def agree(self, error: Optional[BaseException], what: str) -> None:
        """Share whether this rank's part of ``what`` failed; raise on every rank if any did."""
        failures = self.gather_failures(error)
        if failures:
            detail = "; ".join(f"rank {r}: {m}" for r, m in failures)
            if error is not None and len(failures) == 1:
                raise CheckpointError(f"{what} failed on rank {failures[0][0]}: {failures[0][1]}") from error
            raise CheckpointError(f"{what} failed on {len(failures)} of {self.world_size} ranks: {detail}")

    def gather_failures(self, error: Optional[BaseException]) -> list[tuple[int, str]]:
        text = "" if error is None else (str(error) or type(error).__name__)
        if self.world_size == 1:
            return [(0, text)] if error is not None else []
        raw = text.encode("utf-8")[:MESSAGE_BYTES - 1]
        mine = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        mine[0] = 1 if error is not None else 0
        if raw:
            mine[1:1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        failures = []
        for r, t in enumerate(out):
            if t[0].item():
                msg = bytes(t[1:].tolist()).rstrip(b"\0").decode("utf-8", "replace")
                failures.append((r, msg))
        return failures

    def same_everywhere(self, value: int) -> list[int]:
        """Every rank's ``value`` (e.g. a hash of the tag), in rank order."""
        if self.world_size == 1:
            return [value]
        mine = torch.tensor([value], dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return [int(t.item()) for t in out]

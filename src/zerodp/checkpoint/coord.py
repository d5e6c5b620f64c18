"""Agreement between ranks around checkpoint I/O, so a rank that fails tells the others.

Every phase of a save or load ends with :meth:`Coordinator.agree`: each rank says whether its
part worked and, if not, why; every rank learns the outcome of all, and all raise together
when any failed, naming the failing ranks and their messages. No rank waits for a peer that
already gave up.

When the data-parallel group is gloo, the agreement is a small all-gather on it. Otherwise (an
NCCL group, or an asynchronous save agreeing from a background thread while training goes
on) it goes through the job's key-value store (the one ``torch.distributed`` was initialized
with): each rank writes its outcome under a key and reads everyone's. That needs no new process
group, so it works from any thread and inside any subgroup, and never interleaves with the
training step's collectives.
"""
from __future__ import annotations

import itertools
import os
import threading
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from .. import health
from ..core.collectives import Comm
from .source import CheckpointError

#: Bytes of each rank's failure message shared with the others.
MESSAGE_BYTES = 1024
#: How long a store-based agreement waits for the slowest rank (writing a large shard).
STORE_TIMEOUT = timedelta(hours=2)

_COUNTERS: dict[tuple, "itertools.count"] = {}
_LOCK = threading.Lock()


def _store_prefix(ranks: tuple[int, ...]) -> str:
    """A key prefix unique to this agreement: ranks create coordinators in the same order (saves
    and loads are collective), so the n-th one of a group has the same prefix on every rank."""
    with _LOCK:
        n = next(_COUNTERS.setdefault(ranks, itertools.count()))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a store may outlive a restart
    return f"zerodp/checkpoint/{attempt}/{'_'.join(map(str, ranks))}/{n}/"


class Coordinator:
    """Agreement over a data-parallel group (see module docstring)."""

    def __init__(self, comm, separate: bool = False) -> None:
        self.world_size, self.rank = comm.world_size, comm.rank
        self.global_ranks = list(comm.global_ranks)
        self.comm: Optional[Comm] = None  # the agreement's collectives (gloo), watched for hangs
        self.store = None
        self._round = 0
        if self.world_size > 1:
            if comm.backend == "gloo" and not separate:
                self.comm = Comm(comm.group, "checkpoint")
                self.comm.watched = True
            else:
                self.store = dist.PrefixStore(_store_prefix(tuple(comm.global_ranks)),
                                              dist.distributed_c10d._get_default_store())

    def _exchange(self, value: str) -> list[str]:
        """Every rank's ``value`` through the store, in rank order."""
        self._round += 1
        keys = [f"{self._round}/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank], value.encode("utf-8"))
        health.wait(health.StoreWait(self.store, keys, STORE_TIMEOUT), "a checkpoint agreement", self.global_ranks)
        return [self.store.get(k).decode("utf-8") for k in keys]

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
        if self.store is not None:
            got = self._exchange(("1" if error is not None else "0") + text[:MESSAGE_BYTES])
            return [(r, v[1:]) for r, v in enumerate(got) if v.startswith("1")]
        raw = text.encode("utf-8")[:MESSAGE_BYTES - 1]
        mine = [1 if error is not None else 0, *raw, *([0] * (MESSAGE_BYTES - 1 - len(raw)))]
        failures = []
        for r, got in enumerate(self.comm.all_gather_ints(mine, what="a checkpoint agreement")):
            if got[0]:
                msg = bytes(got[1:]).rstrip(b"\0").decode("utf-8", "replace")
                failures.append((r, msg))
        return failures

    def same_everywhere(self, value: int) -> list[int]:
        """Every rank's ``value`` (e.g. a hash of the tag), in rank order."""
        if self.world_size == 1:
            return [value]
        if self.store is not None:
            return [int(v) for v in self._exchange(str(int(value)))]
        return [got[0] for got in self.comm.all_gather_ints([int(value)], what="a checkpoint agreement")]

"""Collectives that do not wait forever for a rank that stopped answering.

A rank waits for a collective in periods of ``comms_timeout_s`` seconds (``work.wait(timeout)``;
on gloo, whose waits block the host). After each period without the collective done, it reads
the other ranks' progress records twice, a few beats apart (``progress.py``), and decides:

* a rank whose heartbeat did not advance has **stopped answering** (``SIGSTOP``, a frozen or
  swapped-out process, a hung driver call): :class:`RankTimeoutError` at once, naming it and
  where it was last seen;
* every other rank waits in a collective too, each for a period or more: the ranks wait in
  collectives the others never issue, which no wait ends: :class:`RankTimeoutError`, naming
  where each rank is;
* otherwise the ranks not there are alive and busy (a slow step, a large file being written):
  a warning names them and where they are, and the wait goes on, up to ``HARD_PERIODS``
  periods, then :class:`RankTimeoutError`.

Every rank that waits decides for itself, so every surviving rank raises, and torchrun then
ends the job (or restarts it under ``--max-restarts``). ``comms_timeout_s: "auto"`` (the
default) is ``AUTO_FACTOR`` times the slowest optimizer step so far, kept within
``FLOOR_S``-``CEILING_S`` (``FLOOR_S`` before the first step); ``"off"`` waits as torch does. On
NCCL a wait does not block the host, so the timed wait is not used there: torch's NCCL watchdog
ends a collective at the process group's timeout, which a numeric ``comms_timeout_s`` sets.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Optional, Union

import torch.distributed as dist

from . import progress

logger = logging.getLogger("zerodp")

FLOOR_S = 30.0
CEILING_S = 600.0
AUTO_FACTOR = 5.0
HARD_PERIODS = 20


class RankTimeoutError(RuntimeError):
    """A collective that cannot finish: a rank stopped answering, or the ranks wait in different
    collectives, or live ranks did not arrive within ``HARD_PERIODS`` periods.

    Once raised, the process ends as soon as the interpreter exits, without tearing the process
    group down: the collective it gave up on is still pending in gloo's threads, which would hold
    the exit until the group's own timeout (:func:`_exit_at_once`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        _exit_at_once()


_END = None  # the exit handler, once registered


def _exit_at_once():
    """At interpreter exit, flush and end the process (code 1) before anything waits for the
    abandoned collective; registered last, so it runs before earlier exit handlers. Returns the
    handler (guard()'s thread calls it at once: it cannot raise into the main thread)."""
    global _END
    if _END is not None:
        return _END
    hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and \
        dist.is_initialized() and dist.get_rank() == 0

    def end() -> None:
        if hosts_store:  # the job's store lives in this process: the others still read it to judge
            time.sleep(3 * progress.INTERVAL)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)
    _END = end
    atexit.register(end)
    return end


def _here(rank: int, waited: float, kind: str) -> str:
    """``rank 0 waited 4 s in <kind> (step 2, backward)``: where this rank waits, for the errors."""
    return (f"rank {rank} waited {waited:.0f} s in {kind} "
            f"({progress.describe(progress.current.record(), waiting=False)})")


class Watch:
    """The process's hang detection (one per process; the engines that use it share it)."""

    def __init__(self, setting: Union[str, float], store, rank: int) -> None:
        self.setting = setting
        self.rank = rank
        self.store = store
        self.slowest_step = 0.0
        self.heartbeat = progress.Heartbeat(store, rank)
        self.heartbeat.start()

    def period(self) -> float:
        if self.setting != "auto":
            return float(self.setting)
        return min(CEILING_S, max(FLOOR_S, AUTO_FACTOR * self.slowest_step))

    def wait(self, work, kind: str, ranks: list[int], seq: int) -> None:
        """``work.wait()``, in periods, judging the other ``ranks`` (global) after each."""
        p = progress.current
        before = (p.waiting, p.wait_start)
        p.waiting, p.wait_start = f"{kind} #{seq}", time.monotonic()
        waited = 0.0
        try:
            while True:
                period = self.period()
                if _done_within(work, period):
                    return
                waited += period
                first = self.read(kind, seq, ranks, waited)
                pause = 2.5 * self.heartbeat.interval  # a few beats, still waiting for the work
                if _done_within(work, pause):
                    return
                waited += pause
                self.judge(kind, seq, ranks, waited, period, first)
        finally:
            p.waiting, p.wait_start = before

    def read(self, kind: str, seq: int, ranks: list[int], waited: float) -> dict[int, Optional[dict]]:
        """The other ranks' records; a store that no longer answers ends the wait."""
        try:
            return progress.read(self.store, [r for r in ranks if r != self.rank])
        except progress.StoreGone as e:
            raise RankTimeoutError(
                f"{_here(self.rank, waited, f'{kind} #{seq}')}, and the job's store does not answer ({e}): "
                "the process serving it (rank 0, or torchrun's agent) has ended or stopped") from None

    def judge(self, kind: str, seq: int, ranks: list[int], waited: float, period: float,
              first: dict[int, Optional[dict]]) -> None:
        """After ``waited`` seconds in collective ``seq``, given the other ranks' records read a
        few beats ago (``first``): raise if it cannot finish (module docstring), else warn."""
        others = [r for r in ranks if r != self.rank]
        now = self.read(kind, seq, ranks, waited)
        stopped = _stopped(others, first, now)
        waiting = [r for r in others if r not in stopped and now[r] is not None and now[r]["waiting"]]
        busy = [r for r in others if r not in stopped and r not in waiting]
        here = _here(self.rank, waited, f"{kind} #{seq}")
        if stopped:
            raise RankTimeoutError(_stopped_message(here, stopped, now))
        late = [r for r in waiting if (now[r].get("wait_s") or 0.0) >= period]
        if not busy and late == waiting and waiting:
            names = "; ".join(f"rank {r}: {progress.describe(now[r])}" for r in waiting)
            raise RankTimeoutError(
                f"{here}, and every other rank waits in a collective too, for {period:.0f} s or more: "
                f"{names}. The ranks issued different collectives (a branch taken on some ranks only?), "
                "which no wait ends")
        if waited >= HARD_PERIODS * period:
            names = "; ".join(f"rank {r}: {progress.describe(now[r])}" for r in busy + waiting)
            raise RankTimeoutError(f"{here}; the ranks not there are alive but did not arrive in "
                                   f"{HARD_PERIODS} periods: {names}")
        names = "; ".join(f"rank {r} at {progress.describe(now[r])}" for r in busy) or "none known"
        logger.warning("%s; alive and not there yet: %s", here, names)

    def note_step(self, seconds: float) -> None:
        self.slowest_step = max(self.slowest_step, seconds)

    def close(self) -> None:
        self.heartbeat.stop()


def _stopped(others: list[int], first: dict, now: dict) -> list[int]:
    """The ranks whose heartbeat did not advance between the two reads."""
    return [r for r in others if first[r] is not None and now[r] is not None and first[r]["beat"] == now[r]["beat"]]


def _stopped_message(here: str, stopped: list[int], now: dict) -> str:
    names = "; ".join(f"rank {r} (last seen at {progress.describe(now[r])})" for r in stopped)
    return (f"{here} for ranks that stopped answering: {names}. Their processes live but do not run "
            "(no heartbeat for several seconds): stopped (SIGSTOP), frozen, swapped out, or stuck in a "
            "driver or file-system call; see comms_timeout_s in docs/configuration.md")


@contextlib.contextmanager
def guard(kind: str, ranks: list[int]):
    """Around waits that cannot be run in periods (a pipeline's sends and receives, which torch's
    schedules issue and wait for themselves; on gloo a send or receive whose wait times out closes
    its connection): a watchdog thread judges the other ``ranks`` each period while inside. One
    that stopped answering is named (logged and on stderr) and this process ends at once (code 1),
    since the main thread cannot be woken from its wait; torchrun then ends the job."""
    watch = _watch
    others = [r for r in ranks if watch is not None and r != watch.rank]
    if not others:
        yield
        return
    done = threading.Event()
    started = time.monotonic()

    def run() -> None:
        while True:
            if done.wait(watch.period()):
                return
            try:
                first = progress.read(watch.store, others)
                if done.wait(2.5 * watch.heartbeat.interval):
                    return
                now = progress.read(watch.store, others)
            except progress.StoreGone:
                return  # the store's host ended: so does the job
            stopped = _stopped(others, first, now)
            if stopped:
                here = _here(watch.rank, time.monotonic() - started, kind)
                message = "zerodp.health.RankTimeoutError: " + _stopped_message(here, stopped, now)
                logger.error(message)
                print(message, file=sys.stderr, flush=True)
                _exit_at_once()()

    thread = threading.Thread(target=run, name="zerodp-guard", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(10.0)  # not left inside a store read at exit (``progress.Heartbeat.stop``)


def _done_within(work, seconds: float) -> bool:
    """Whether ``work`` finished within ``seconds`` (its own errors raised)."""
    try:
        work.wait(timedelta(seconds=seconds))
        return True
    except RuntimeError as e:
        if "timed out" not in str(e).lower():
            raise
        return False


_watch: Optional[Watch] = None
_users = 0


def wait(work, kind: str, ranks: list[int], seq: Optional[int] = None) -> None:
    """Wait for ``work`` (a collective on a gloo group over ``ranks``, global ranks; ``seq``: its
    number among this rank's collectives, counted here if not given), watched if a watch runs."""
    if seq is None:
        progress.current.seq += 1
        seq = progress.current.seq
    if _watch is None:
        work.wait()
    else:
        _watch.wait(work, kind, ranks, seq)


class StoreWait:
    """``store.wait(keys)`` in the form of a collective's work, for :func:`wait`: agreement through
    the store (checkpoints on NCCL, an asynchronous save's thread) is watched like a collective."""

    def __init__(self, store, keys: list[str], limit: timedelta) -> None:
        self.store, self.keys, self.limit = store, keys, limit

    def wait(self, timeout: Optional[timedelta] = None) -> None:
        try:
            self.store.wait(self.keys, timeout or self.limit)
        except Exception as e:  # the store's timeout: as a collective's wait reports it
            if timeout is not None and "timeout" in str(e).lower().replace(" ", ""):
                raise RuntimeError("timed out") from e
            raise


class Monitor:
    """An engine's interface to hang detection: ``phase(name)`` around each phase of a step,
    ``stepped(step, micro)`` after each optimizer step, ``close()`` at ``destroy()``."""

    def __init__(self, setting: Union[str, float]) -> None:
        global _watch, _users
        self.on = False
        self._last = None
        store = progress.default_store()
        if setting == "off" or store is None or dist.get_world_size() == 1 or dist.get_backend() == "fake":
            return  # (a fake group, ``zerodp simulate``'s, has no other ranks to watch)
        if _watch is None:
            _watch = Watch(setting, store, dist.get_rank())
        else:
            _watch.setting = setting
        _users += 1
        self.on = True
        if setting != "auto":  # torch's own timeout: past the last period the wait would take
            with contextlib.suppress(Exception):
                dist.distributed_c10d._set_pg_timeout(timedelta(seconds=(HARD_PERIODS + 1) * float(setting)))

    @contextlib.contextmanager
    def phase(self, name: str, what: str = ""):
        p = progress.current
        before = (p.phase, p.what)
        p.phase, p.what = name, what
        if self.on and _watch is not None:
            _watch.heartbeat.publish()
        try:
            yield
        finally:
            p.phase, p.what = before

    def stepped(self, step: int, micro: int) -> None:
        progress.current.step, progress.current.micro = step, micro
        now = time.monotonic()
        if self._last is not None and _watch is not None:
            _watch.note_step(now - self._last)
        self._last = now

    def close(self) -> None:
        global _watch, _users
        if not self.on:
            return
        self.on = False
        _users -= 1
        if _users == 0 and _watch is not None:
            _watch.close()
            _watch = None

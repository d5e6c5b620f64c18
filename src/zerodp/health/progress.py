"""Where this rank is, published where the other ranks can read it without a collective.

:class:`Progress` is the rank's place: the optimizer step and micro-step, the phase (``forward``,
``backward``, ``step``, ``save_checkpoint`` ...), the stage-3 unit or other thing it is working on,
how many collectives it has issued, and the collective it is waiting in (with how long). The
engine and the collectives set its fields as they go: an attribute write each, nothing more.

:class:`Heartbeat` is a daemon thread that writes the record, with a beat counter, to the job's
key-value store (the one ``torch.distributed`` was started with) every ``interval`` seconds, under
``zerodp/progress/<global rank>``; the engine also writes it as each phase of a step begins, so
the record names the phase a rank stopped in, however short its steps. A rank that is stopped
(``SIGSTOP``, a swapped-out or frozen process) stops beating; a rank that is slow keeps beating.
:func:`read` gives the records of some ranks; reading them twice an interval or more apart tells
the stopped ranks from the live ones.
"""
from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from typing import Optional

import torch.distributed as dist

logger = logging.getLogger("zerodp")

KEY = "zerodp/progress/"
#: Seconds between two beats of a rank's record.
INTERVAL = 1.0


class Progress:
    """This rank's place (see module docstring); one per process."""

    def __init__(self) -> None:
        self.step = 0
        self.micro = 0
        self.phase = "start"
        self.what = ""                 # the unit, bucket or file being worked on
        self.seq = 0                   # collectives issued so far
        self.waiting: Optional[str] = None  # the collective waited in, if any
        self.wait_start = 0.0          # time.monotonic() when that wait began

    def record(self) -> dict:
        waited = time.monotonic() - self.wait_start if self.waiting else None
        return {"step": self.step, "micro": self.micro, "phase": self.phase, "what": self.what,
                "seq": self.seq, "waiting": self.waiting, "wait_s": waited}


#: The process's progress (engines and collectives write it; the heartbeat reads it).
current = Progress()


def describe(rec: Optional[dict], waiting: bool = True) -> str:
    """A record in words: ``step 3, backward, unit 'blocks.1'``, and the collective waited in."""
    if rec is None:
        return "no progress record"
    text = f"step {rec['step']}, {rec['phase']}"
    if rec.get("what"):
        text += f", {rec['what']}"
    if not waiting:
        return text
    if rec.get("waiting"):
        text += f", waiting in {rec['waiting']} for {rec['wait_s']:.0f} s"
    else:
        text += f", {rec['seq']} collectives issued"
    return text


def default_store():
    """The store ``torch.distributed`` was started with, or None (no group, or none to reach)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


class Heartbeat:
    """The daemon thread that publishes :data:`current` (see module docstring). Started once per
    process by the first engine that watches its collectives, stopped when the last one goes."""

    def __init__(self, store, rank: int, interval: Optional[float] = None) -> None:
        self.store, self.rank = store, rank
        self.interval = INTERVAL if interval is None else interval
        self._beats = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zerodp-heartbeat", daemon=True)

    def start(self) -> None:
        self.publish()  # the record exists before any collective waits on it
        self._thread.start()

    def publish(self) -> None:
        """Write the record now (the thread does every ``interval``; the engine at each phase)."""
        rec = dict(current.record(), beat=next(self._beats))
        self.store.set(f"{KEY}{self.rank}", json.dumps(rec))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.publish()
            except Exception as e:  # the store is gone (the job is ending): stop quietly
                logger.debug("zerodp heartbeat stopped: %s", e)
                return

    def stop(self, wait: float = 10.0) -> None:
        """Stop beating, and wait (up to ``wait`` seconds) for a write in progress to end. A daemon
        thread still inside a store call when the interpreter finalizes ends the process with
        "terminate called without an active exception" (SIGABRT) as it returns into Python: its
        exit unwinds through C++ frames that may not unwind. This was the abort a finished job met
        about once in 40 runs (``tests/heartbeat_exit_script.py`` makes it certain)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(wait)


class StoreGone(RuntimeError):
    """The store does not answer: the process that serves it (rank 0's, under torchrun the agent's)
    has ended or stopped."""


def read(store, ranks: list[int]) -> dict[int, Optional[dict]]:
    """The published records of ``ranks`` (global ranks); None for a rank that has none. Raises
    :class:`StoreGone` when the store cannot be reached."""
    out: dict[int, Optional[dict]] = {}
    for r in ranks:
        key = f"{KEY}{r}"
        try:
            out[r] = json.loads(store.get(key)) if store.check([key]) else None
        except (ValueError, TypeError):  # unreadable: as if there were none
            out[r] = None
        except Exception as e:
            raise StoreGone(f"{type(e).__name__}: {e}") from e
    return out

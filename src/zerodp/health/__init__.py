"""Hang detection: a rank that stops answering is named, instead of a job that waits for the
process group's timeout.

Every rank publishes where it is (``progress.py``: step, phase, unit, the collective it waits in)
to the job's store from a heartbeat thread; a wait for a collective on gloo runs in periods of
``comms_timeout_s`` and, after each, judges the other ranks from their records (``watch.py``).

The engine's interface: ``Monitor(config.comms_timeout_s)``, its ``phase(name)`` around each phase,
``stepped(step, micro)`` after each optimizer step, and ``close()``; the collectives call
``wait(work, kind, ranks, seq)`` and count their issues on ``progress.current``.
"""
from . import progress
from .watch import Monitor, RankTimeoutError, StoreWait, guard, wait

__all__ = ["Monitor", "RankTimeoutError", "StoreWait", "guard", "progress", "wait"]

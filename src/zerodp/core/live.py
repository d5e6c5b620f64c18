"""The engines alive in this process: read by ``zerodp.comm.log_summary()`` and by the
teardown at interpreter exit (``teardown.py``), written by each engine as it is built.

A module of its own so that neither reader imports the engine."""
from __future__ import annotations

import weakref
from typing import Any

_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()


def track(engine: Any) -> None:
    """Count ``engine`` among the live ones until it is garbage-collected."""
    _LIVE.add(engine)


def live_engines() -> list[Any]:
    """The engines (``ZeroEngine``) alive in this process, in no particular order."""
    return list(_LIVE)

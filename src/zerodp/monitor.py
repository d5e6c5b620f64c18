"""Training metrics written while training runs (opt-in through the config).

The engine calls ``monitor_from_config(config, engine)`` once; when it returns a monitor,
the engine calls ``monitor.on_backward(loss)`` for every ``engine.backward`` and
``monitor.on_step(engine)`` after every optimizer step (skipped steps included).
"""
from __future__ import annotations

from typing import Any, Optional


def monitor_from_config(config: Any, engine: Any) -> Optional[Any]:
    """The monitor the config asks for, or None."""
    return None

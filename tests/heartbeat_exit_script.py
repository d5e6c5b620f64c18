"""A process whose hang-detection heartbeat is inside a store call when the engine stops it, and
which then ends at once (as a job does after zerodp's exit handler has torn its engines down):

    python heartbeat_exit_script.py

The heartbeat's store holds each write in a C++ wait of 300 ms (the GIL released), so when
``Heartbeat.stop()`` returns the thread is in the middle of one unless ``stop()`` waited for it. A
daemon thread that returns from C++ into Python while the interpreter finalizes ends the process
with "terminate called without an active exception" (SIGABRT). Prints ``stopped, alive False``.
"""
import time
from datetime import timedelta

import torch.distributed as dist

from zerodp.health import progress

store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))


class SlowStore:
    """The store, each write held 300 ms in C++ first."""

    def set(self, key: str, value: str) -> None:
        try:
            store.wait(["never-set"], timedelta(milliseconds=300))
        except Exception:  # noqa: BLE001 - the wait times out, as meant
            pass
        store.set(key, value)


beat = progress.Heartbeat(SlowStore(), 0, interval=0.001)
beat.start()
time.sleep(0.05)  # the thread is inside a write now
beat.stop()
print(f"stopped, alive {beat._thread.is_alive()}", flush=True)

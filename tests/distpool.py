"""A pool of worker processes that join one gloo world once and run test tasks.

Starting processes and process groups is slow on small machines, so the suite starts
``WORLD`` workers once per session. Each keeps a subgroup of ranks ``[0, k)`` for every
``k``; ``pool.run(fn, k, ...)`` runs ``fn(group, *args)`` on ranks ``0..k-1`` with that
group and returns their results in rank order. ``fn`` must be a module-level function
in a module importable from ``tests/``.

A task that does not finish within its timeout fails the test and the pool is restarted
(its workers may be stuck in a collective). Workers end with ``os._exit`` after
reporting, so a crash while tearing gloo down cannot lose a result.
"""
from __future__ import annotations

import importlib
import os
import queue
import socket
import sys
import time
import traceback

import torch.multiprocessing as mp

WORLD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results, path: list[str]) -> None:
    sys.path[:] = path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = {k: dist.new_group(list(range(k))) for k in range(1, world + 1)}
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, module, name, k, args, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((task_id, rank, True, fn(groups[k], *args, **kwargs)))
        except BaseException:  # report, keep serving
            results.put((task_id, rank, False, traceback.format_exc()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class TaskFailed(AssertionError):
    pass


class WorkerPool:
    def __init__(self, world: int = WORLD) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, world, port, self._tasks[r], self._results, list(sys.path)))
                       for r in range(world)]
        for p in self._procs:
            p.start()
        self._next_id = 0
        self.broken = False

    def run(self, fn, world_size: int, *args, timeout: float = 240, **kwargs) -> list:
        if not 1 <= world_size <= self.world:
            raise ValueError(f"world_size must be in 1..{self.world}")
        self._next_id += 1
        tid = self._next_id
        for r in range(world_size):
            self._tasks[r].put((tid, fn.__module__, fn.__name__, world_size, args, kwargs))
        out: dict[int, object] = {}
        errors = []
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < world_size:
            try:
                got_id, rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.broken = True
                    why = (f"worker rank(s) {dead} died" if dead
                           else f"did not finish in {timeout}s; a rank may be stuck in a collective")
                    raise TaskFailed(f"{fn.__name__} on {world_size} ranks: {why} (finished ranks: "
                                     f"{sorted(out)}){''.join(chr(10) + e for e in errors)}") from None
                continue
            if got_id != tid:
                continue
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise TaskFailed(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [out[r] for r in range(world_size)]

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=1 if self.broken else 10)
            if p.is_alive():
                p.kill()

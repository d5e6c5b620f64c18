"""What happens at interpreter exit: zerodp tears down what it started.

Scripts written for DeepSpeed end without any teardown: no ``engine.destroy()``, no
``destroy_process_group()``. A gloo process group left alive into interpreter finalization can
take the process down with it: a gloo worker thread torn down during finalization aborts
("terminate called without an active exception", SIGABRT), and the finished job exits non-zero
(plain torch + gloo on CPU: 5 of 12 runs without destroy_process_group, 0 of 12 with it).

So the first time zerodp starts a process group or builds an engine it registers
:func:`at_exit` with :mod:`atexit`. Python runs it after the main module has ended and after
the non-daemon threads are joined (an asynchronous checkpoint save's writer, the offload I/O
pools), before finalization. It

1. tears down every live engine with ``engine.destroy()`` (idempotent): waits for an
   asynchronous save still in flight (its error, if it failed, is logged), removes the
   gradient hooks, closes the metrics files and stops the offload I/O threads and files;
2. destroys the default process group if zerodp started it (``zerodp.init_distributed``,
   ``zerodp.comm.init_distributed``, or ``zerodp.initialize`` under a launcher), with every
   group made from it.

A group the script started itself (``torch.distributed.init_process_group``) is left to the
script while its exit handlers may still need it: zerodp does not destroy it in :func:`at_exit`.
Such a script should end with ``torch.distributed.destroy_process_group()``. Many do not
(Accelerate starts the group of a CPU job itself and leaves it), and a gloo group left alive
into finalization aborts the finished job now and then, as above. So a second handler,
:func:`at_last_exit`, registered when zerodp is imported and therefore run after every exit
handler registered later (:mod:`atexit` runs them last in, first out), destroys a gloo default
group still alive then, in a process that built an engine, and collects it.

A group destroyed by ``destroy_process_group()`` still lives on while any Python object refers
to it, and so do its gloo threads. One such reference is torch's own: ``torch.distributed.nn``
binds its functions' ``group=`` default to the default group object when it is imported, and
``torch._dynamo`` (hence the first optimizer built) imports it. Imported after the group was
started, it keeps that group, destroyed or not, and its threads alive into finalization, where
they abort the process as above (a script that destroys its own group: 3 of 55 runs). So the
handler then sets those defaults back to ``None`` (the default group, what they mean) and
collects, so that a destroyed group is freed, and its threads joined, before finalization.

A process forked from one that registered the handler (and so inheriting it) does nothing at
its exit: the engines and the group are its parent's.

There is no barrier before the group is destroyed. Destroying a group is local (gloo closes its
connections, NCCL aborts its communicators) and completes whether or not a peer has already
exited; a barrier would instead wait, up to the group's timeout, for a peer that ended early or
failed. Ranks therefore leave independently, each as soon as it is done.
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import threading
from typing import Callable, Optional

import torch.distributed as dist

from .live import live_engines

logger = logging.getLogger("zerodp")

_lock = threading.Lock()
_installed_in: Optional[int] = None  # the process that registered at_exit
_our_group: Optional[object] = None  # the default group zerodp started (compared by identity)
_releases: list[Callable[[], None]] = []  # what drops zerodp's references to process groups


def at_last_exit() -> None:
    """After the script's own exit handlers: destroy a gloo default group that a process which used
    zerodp (built an engine or started a group) left alive, so that its threads are joined before
    finalization (see the module docstring)."""
    if _installed_in is None or os.getpid() != _installed_in:
        return  # zerodp was imported and not used here, or this is a forked child
    group = _default_group()
    if group is None:
        return
    try:
        if dist.get_backend() != "gloo":
            return
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the process is ending either way
        logger.debug("at exit: destroying the script's gloo group failed: %s: %s", type(e).__name__, e)
        return
    for release in _releases:
        release()
    unpin_group_defaults()
    gc.collect()


atexit.register(at_last_exit)  # at import, so it runs after the handlers registered later


def on_exit_release(release: Callable[[], None]) -> None:
    """Have :func:`at_exit` call ``release`` (which drops references zerodp keeps to process
    groups, such as the subgroups of a process grid) before it collects: a destroyed group still
    referred to keeps its gloo threads alive into finalization."""
    _releases.append(release)


def install() -> None:
    """Register :func:`at_exit` with :mod:`atexit` (once per process)."""
    global _installed_in
    with _lock:
        if _installed_in is None:
            atexit.register(at_exit)
            _installed_in = os.getpid()


def _default_group() -> Optional[object]:
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def group_started() -> None:
    """Record that zerodp has just started the default process group (so it destroys it at
    exit) and register :func:`at_exit`."""
    global _our_group
    _our_group = _default_group()
    install()


def owns_default_group() -> bool:
    """Whether the default process group alive now is the one zerodp started."""
    return _our_group is not None and _default_group() is _our_group


def at_exit() -> None:
    """Tear down the live engines and the process group zerodp started (see the module
    docstring). Safe to call more than once, and at any time nothing more will be trained."""
    global _our_group
    if _installed_in is not None and os.getpid() != _installed_in:
        return  # a forked child that inherited the handler: the engines and the group are its parent's
    for engine in live_engines():
        try:
            engine.destroy()
        except Exception as e:  # noqa: BLE001 - one engine's failure must not stop the rest
            logger.error("at exit: tearing down an engine failed: %s: %s", type(e).__name__, e)
    if owns_default_group():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - the process is ending either way
            logger.warning("at exit: destroying the process group failed: %s: %s", type(e).__name__, e)
    _our_group = None
    for release in _releases:
        release()
    unpin_group_defaults()
    gc.collect()  # a destroyed group no longer referred to is freed now, its threads joined


def unpin_group_defaults() -> int:
    """Set every ``group=`` default of ``torch.distributed.nn.functional`` that holds a process
    group object back to ``None`` (the default group, the same meaning) and return how many
    were reset. Such a default, bound when the module was imported after a group was started,
    keeps that group alive after it is destroyed (see the module docstring)."""
    mod = sys.modules.get("torch.distributed.nn.functional")
    if mod is None or not dist.is_available():
        return 0
    reset = 0
    for fn in list(vars(mod).values()):
        defaults = getattr(fn, "__defaults__", None)
        if getattr(fn, "__module__", None) != mod.__name__ or not defaults:
            continue
        if any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)
            reset += 1
    return reset

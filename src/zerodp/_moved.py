"""Module paths that moved keep working: ``import zerodp.estimator`` gives ``zerodp.tools.estimate``.

Scripts and notebooks name ``zerodp.memory_check``, ``zerodp.plot``, ``zerodp.engine`` and the
other modules that lived at the top level before the package took its shape (the engine in
``core/``, the commands in ``tools/``). Importing an old name returns the module that holds
that code now, the same object, so its attributes and ``isinstance`` checks agree. (``python -m``
takes the new names: ``zerodp.tools.cli``, ``zerodp.tools.train``.)
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

#: old module (under ``zerodp.``) -> where its code lives now
MOVED = {
    **{name: f"core.{name}" for name in ("engine", "engine_api", "flat", "stages", "precision", "collectives",
                                         "assemble", "memory", "plain_loop", "data")},
    "fetch": "core.gather",
    "cli": "tools.cli",
    "train": "tools.train",
    "plot": "tools.plot",
    "monitor": "tools.monitor",
    "estimator": "tools.estimate",
    "memory_check": "tools.memory_check",
}


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``zerodp.<old name>`` to the module in :data:`MOVED`."""

    def find_spec(self, fullname, path, target=None):
        prefix, _, name = fullname.partition(".")
        if prefix == "zerodp" and name in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(f"zerodp.{MOVED[spec.name.partition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system sets __spec__ to the old name's: put it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # already executed under its own name


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())

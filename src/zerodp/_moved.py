"""Module paths that moved keep working: ``import zerodp.tools.estimate`` gives ``zerodp.estimator``.

Scripts and notebooks name ``zerodp.memory_check``, ``zerodp.plot``, ``zerodp.engine_api`` and the
other modules that lived at the top level before the package took its shape (the engine's parts
in ``core/``, its API in ``engine/``, the commands in ``tools/``). Importing an old name returns the module that holds
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
    "engine_api": "engine.engine_api",
    "core.engine": "engine.engine",
    "core.engine_api": "engine.engine_api",
    "parallel.pipeline": "engine.pipeline",
    **{name: f"core.{name}" for name in ("flat", "stages", "precision", "collectives",
                                         "assemble", "memory", "plain_loop", "data")},
    "fetch": "core.gather",
    "cli": "tools.cli",
    "train": "tools.train",
    "plot": "tools.plot",
    "tools.monitor": "monitor",
    "tools.estimate": "estimator",
    "memory_check": "tools.memory_check",
}


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``zerodp.<old name>`` (and a module under an old package name,
    ``zerodp.tools.estimate.inputs``) to the module in :data:`MOVED`."""

    @staticmethod
    def new_name(fullname: str):
        """Where ``fullname``'s code lives now, or None if it did not move."""
        prefix, _, name = fullname.partition(".")
        if prefix != "zerodp":
            return None
        if name in MOVED:
            return f"zerodp.{MOVED[name]}"
        for old, new in MOVED.items():
            if name.startswith(old + "."):
                return f"zerodp.{new}{name[len(old):]}"
        return None

    def find_spec(self, fullname, path, target=None):
        if self.new_name(fullname) is not None:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(self.new_name(spec.name))
        spec.loader_state = module.__spec__  # the import system sets __spec__ to the old name's: put it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # already executed under its own name


def install() -> None:
    """Put the finder first, so that a module under a moved package is found under its new name
    (the path finder would load the file a second time, under the old name)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())

"""``ZERODP_AS_DEEPSPEED=1``: ``import deepspeed`` and the ``deepspeed`` distribution resolve to
zerodp, in this process only.

Hugging Face's Trainer, Accelerate and TRL use DeepSpeed when they find an installed
distribution named ``deepspeed`` with a version, then import ``deepspeed`` and its modules.
With the switch on, this module answers both: the distribution's metadata (name ``deepspeed``,
version :data:`DEEPSPEED_API` with zerodp's own as a local label, so that version checks see the
DeepSpeed API level zerodp mirrors) and the modules (``deepspeed`` is a thin module whose
names are zerodp's, ``deepspeed.<path>`` is ``zerodp.<path>``, the same module object).

It is started by ``zerodp-as-deepspeed.pth``, which the zerodp distribution installs beside
its package, so the switch is read at interpreter start-up: workers started by ``torchrun`` or
``accelerate launch`` inherit the variable and get the same, before anything imports
transformers. Without the variable the ``.pth`` line does nothing else than read it. Nothing is
written under DeepSpeed's name: the resolution lives in this process's import system.

When a real ``deepspeed`` is importable the switch refuses: ``import deepspeed`` raises an
``ImportError`` that says so, instead of one of the two shadowing the other. This module
imports nothing heavy (not torch, not zerodp) until ``deepspeed`` is imported.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
from typing import Optional

#: the environment variable that turns the switch on ("1", "true", "yes", "on")
ENV = "ZERODP_AS_DEEPSPEED"
#: the DeepSpeed release whose API zerodp mirrors: the version ``deepspeed`` reports
DEEPSPEED_API = "0.19.8"

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def requested(environ=os.environ) -> bool:
    """Whether the switch is on in ``environ``; an unrecognized value is an error (a typo
    must not silently leave DeepSpeed in place)."""
    value = environ.get(ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{ENV}={environ.get(ENV)!r}: expected 1 (on) or 0 (off)")


def real_deepspeed() -> Optional[str]:
    """Where a real ``deepspeed`` is importable from (its path), or None."""
    spec = importlib.machinery.PathFinder.find_spec("deepspeed")
    if spec is None:
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or []) or "a namespace package"


def version() -> str:
    """``deepspeed``'s version under the switch: the mirrored API level, zerodp's version as the
    local label (``0.19.8+zerodp.0.1.0``)."""
    try:
        own = importlib.metadata.version("zerodp")
    except importlib.metadata.PackageNotFoundError:
        own = "0"
    return f"{DEEPSPEED_API}+zerodp.{own}"


def refusal(where: str) -> str:
    return (f"{ENV}=1 asks zerodp to stand in for deepspeed, but a real deepspeed is installed in this "
            f"environment ({where}). zerodp does not shadow it: uninstall it (pip uninstall deepspeed) "
            f"to use zerodp under DeepSpeed's name, or unset {ENV} to use DeepSpeed.")


class _Distribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution's metadata, answered by zerodp."""

    def read_text(self, filename: str) -> Optional[str]:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version()}\n"
                    f"Summary: zerodp standing in for DeepSpeed ({ENV}=1)\nAuthor: zerodp\n"
                    f"Requires-Dist: zerodp\n")
        if filename == "top_level.txt":
            return "deepspeed\n"
        if filename == "INSTALLER":
            return "zerodp\n"
        return None

    def locate_file(self, path):
        import pathlib
        return pathlib.Path(os.path.dirname(os.path.abspath(__file__))) / path


class _Finder(importlib.metadata.DistributionFinder, importlib.abc.Loader):
    """Resolves ``deepspeed`` and ``deepspeed.<path>`` to zerodp, and finds the distribution."""

    # -- modules --
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "deepspeed" or fullname.startswith("deepspeed."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        if spec.name == "deepspeed":
            import zerodp
            module = _TopLevel("deepspeed", zerodp)
            module.__spec__ = spec
            if "lightning" in sys.modules:  # Lightning's DeepSpeedStrategy: its CPU refusal names zerodp's
                from zerodp.integrations.lightning.common import point_deepspeed_strategies_to_zerodp
                point_deepspeed_strategies_to_zerodp()
            return module
        try:
            target = importlib.import_module("zerodp." + spec.name.partition(".")[2])
        except ModuleNotFoundError as e:
            if e.name is None or not e.name.startswith("zerodp."):
                raise
            raise ModuleNotFoundError(f"No module named {spec.name!r} (under {ENV}=1 deepspeed is zerodp, "
                                      f"which has no {e.name!r})", name=spec.name) from None
        spec.loader_state = target.__spec__  # the import system sets __spec__ to the alias's: put it back
        return target

    def exec_module(self, module):
        if isinstance(module, _TopLevel):
            return
        module.__spec__ = module.__spec__.loader_state  # already executed under its own name

    # -- distribution metadata --
    def find_distributions(self, context=None):
        name = None if context is None else context.name
        if name is None or name.replace("_", "-").lower() == "deepspeed":
            yield _Distribution()

    def invalidate_caches(self):
        pass


class _Refuser(importlib.abc.MetaPathFinder):
    """With a real deepspeed installed: ``import deepspeed`` says why the switch does not apply."""

    def __init__(self, where: str) -> None:
        self.where = where

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "deepspeed":
            raise ImportError(refusal(self.where), name="deepspeed")
        return None


class _TopLevel(types.ModuleType):
    """``deepspeed`` itself: zerodp's names, DeepSpeed's version."""

    def __init__(self, name: str, target: types.ModuleType) -> None:
        super().__init__(name, "zerodp standing in for DeepSpeed")
        self.__path__ = []          # a package: its submodules come through _Finder
        self.__version__ = version()
        self.__file__ = target.__file__
        self._zerodp = target

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return getattr(self._zerodp, name)
        except AttributeError:
            pass
        if importlib.util.find_spec(f"zerodp.{name}") is not None:  # a submodule not imported yet
            return importlib.import_module(f"deepspeed.{name}")
        raise AttributeError(f"module 'deepspeed' (zerodp under {ENV}=1) has no attribute {name!r}")

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(dir(self._zerodp)))


def install() -> None:
    """Put the switch in place in this process (idempotent). Called by the ``.pth`` line when
    :func:`requested`; tests and ``python -c`` may call it too."""
    if any(isinstance(f, (_Finder, _Refuser)) for f in sys.meta_path):
        return
    where = real_deepspeed()
    if where is not None:
        sys.meta_path.insert(0, _Refuser(where))
        return
    sys.meta_path.insert(0, _Finder())


_started = False


def _start() -> None:
    """The ``.pth`` entry point: install when the switch is on; a bad value is reported, not raised
    (an exception in a ``.pth`` line would only print a traceback and go on). Once per process
    (a virtual environment's ``lib64`` link shows site-packages, and the line, twice)."""
    global _started
    if _started:
        return
    _started = True
    try:
        on = requested()
    except ValueError as e:
        print(f"zerodp: {e}; the switch stays off", file=sys.stderr)
        return
    if on:
        install()

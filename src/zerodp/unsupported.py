"""DeepSpeed names zerodp does not implement, and the error that says so.

A script ported by ``import zerodp as deepspeed`` that reaches for one of these gets
:class:`NotImplementedInZerodp` naming the feature, whether it reads an attribute
(``deepspeed.init_inference``: the package's ``__getattr__``) or imports a module
(``from deepspeed.compression.compress import init_compression``: :class:`UnsupportedFinder`). Such imports succeed,
because real scripts import these modules whether or not they use them; what they import is a placeholder that
raises when called or instantiated. The error is an ``AttributeError`` for attributes of the
package (so ``hasattr`` probes answer False) and a ``NotImplementedError`` either way.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

#: DeepSpeed name -> what it is.
NOT_IMPLEMENTED: dict[str, str] = {
    "init_inference": "the inference engine (deepspeed.init_inference)",
    "InferenceEngine": "the inference engine",
    "inference": "the inference engine (deepspeed.inference)",
    "module_inject": "kernel injection (deepspeed.module_inject)",
    "compression": "model compression (deepspeed.compression)",
    "autotuning": "the autotuner (deepspeed.autotuning)",
    "profiling": "the FLOPs profiler (deepspeed.profiling)",
    "elasticity": "elastic batch sizes (deepspeed.elasticity)",
    "linear": "LoRA-optimized linear layers (deepspeed.linear)",
    "OnebitAdam": "1-bit Adam", "OnebitLamb": "1-bit LAMB", "ZeroOneAdam": "0/1 Adam",
}

_WHY = ("zerodp is a ZeRO data-parallel engine and implements DeepSpeed's everyday training API "
        "(initialize, the engine, checkpoints, zero.Init, comm, accelerator; see the README's table "
        "of DeepSpeed names)")


class NotImplementedInZerodp(AttributeError, NotImplementedError):
    """A DeepSpeed feature zerodp does not implement."""


class _Refused:
    """What ``from zerodp.compression.X import Y`` gives: anything reached from it is another
    placeholder, and calling it raises :class:`NotImplementedInZerodp` naming the feature."""

    def __init__(self, feature: str, path: str) -> None:
        self._feature, self._path = feature, path

    def __getattr__(self, name: str) -> "_Refused":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Refused(self._feature, f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedInZerodp(f"{self._path}: zerodp does not implement {NOT_IMPLEMENTED[self._feature]}: "
                                     f"{_WHY}")


def error(name: str) -> NotImplementedInZerodp:
    return NotImplementedInZerodp(f"zerodp does not implement {NOT_IMPLEMENTED[name]}: {_WHY}")


class UnsupportedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import zerodp.compression.compress`` (and the other submodules in :data:`NOT_IMPLEMENTED`)
    succeed with modules of placeholders (:class:`_Refused`) instead of "No module named"."""

    def find_spec(self, fullname, path, target=None):
        parts = fullname.split(".")
        if len(parts) >= 2 and parts[0] == "zerodp" and parts[1] in NOT_IMPLEMENTED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        feature = module.__name__.split(".")[1]

        def refused(name: str) -> _Refused:
            if name.startswith("__"):  # what tools read of every module (__file__, __path__): absent
                raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
            return _Refused(feature, f"{module.__name__}.{name}")

        module.__getattr__ = refused


def install() -> None:
    if not any(isinstance(f, UnsupportedFinder) for f in sys.meta_path):
        sys.meta_path.append(UnsupportedFinder())

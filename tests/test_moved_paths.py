"""Module paths that scripts and the docs name keep importing after the package took its shape
(the engine in ``core/``, the commands in ``tools/``), as the same module objects."""
import importlib
import subprocess
import sys

import pytest

import zerodp
from zerodp._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_new_module(old):
    module = importlib.import_module(f"zerodp.{old}")
    assert module is importlib.import_module(f"zerodp.{MOVED[old]}")
    assert module.__spec__.name == f"zerodp.{MOVED[old]}"  # its own spec, not the alias's


@pytest.mark.parametrize("old, new", [("tools.estimate", "estimator"), ("tools.monitor", "monitor")])
def test_the_estimator_and_the_monitor_left_tools(old, new):
    """``zerodp.estimator`` and ``zerodp.monitor`` are the library's own modules (no alias), and
    their old paths under ``tools/`` give the same module objects."""
    assert MOVED[old] == new and new not in MOVED
    module = importlib.import_module(f"zerodp.{new}")
    assert module.__spec__.name == module.__name__ == f"zerodp.{new}"
    assert not isinstance(module.__spec__.loader, zerodp._moved.MovedFinder)
    assert module.__file__.replace("\\", "/").endswith(
        f"/zerodp/{new}/__init__.py" if new == "estimator" else f"/zerodp/{new}.py")
    assert importlib.import_module(f"zerodp.{old}") is module


def test_documented_names_resolve():
    from zerodp.memory_check import compare_with_engine, format_comparison  # noqa: F401
    from zerodp.plot import plot_runs, plot_stage_memory  # noqa: F401

    from zerodp.checkpoint.consolidate import consolidate  # noqa: F401
    from zerodp.estimator import EstimateError, estimate  # noqa: F401
    from zerodp.examples.gpt import build_gpt  # noqa: F401
    from zerodp.inference import stream  # noqa: F401
    from zerodp.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: F401
    assert zerodp.estimate is estimate
    from zerodp.engine import ZeroEngine
    assert ZeroEngine is zerodp.ZeroEngine


def test_unknown_module_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("zerodp.no_such_module")


def test_fresh_interpreter_imports_old_path_first():
    """Without zerodp imported before, ``import zerodp.plot`` imports the package, then the alias."""
    code = "import zerodp.plot as p, zerodp.tools.plot as q; assert p is q; print(p.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "zerodp.tools.plot"


def test_fresh_interpreter_imports_old_tools_paths_first():
    code = ("import zerodp.tools.estimate as e, zerodp.tools.monitor as m, zerodp.estimator, zerodp.monitor\n"
            "assert e is zerodp.estimator and m is zerodp.monitor and zerodp.estimate is e.estimate\n"
            "print(e.__name__, m.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "zerodp.estimator zerodp.monitor"


def test_a_module_under_a_moved_package_is_the_new_one():
    """``zerodp.tools.estimate.inputs`` is ``zerodp.estimator.inputs``, loaded once under its own
    name (not a second copy under the old name, whose relative imports would miss)."""
    code = ("import zerodp.tools.estimate.inputs as a, zerodp.estimator.inputs as b; assert a is b; "
            "import zerodp.core.engine as e, zerodp.engine.engine as f; assert e is f; print(a.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "zerodp.estimator.inputs"

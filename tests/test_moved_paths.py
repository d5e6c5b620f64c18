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


def test_documented_names_resolve():
    from zerodp.estimator import EstimateError, estimate  # noqa: F401
    from zerodp.memory_check import compare_with_engine, format_comparison  # noqa: F401
    from zerodp.plot import plot_runs, plot_stage_memory  # noqa: F401

    from zerodp.checkpoint.consolidate import consolidate  # noqa: F401
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

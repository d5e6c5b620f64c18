"""``pip install zerodp`` brings only torch, pydantic, tqdm and numpy: the README's main job, a
checkpoint and its resume must work with nothing else installed. The test environment has the
optional libraries (transformers, bitsandbytes, safetensors, DeepSpeed ...), so these runs use a
Python whose site-packages holds only the package's declared dependencies and what they need."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from importlib.metadata import distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement

OPTIONAL = ["transformers", "bitsandbytes", "safetensors", "peft", "accelerate", "deepspeed", "lightning"]
CLI = "import sys; from zerodp.tools.cli import main; sys.argv[0] = 'zerodp'; sys.exit(main())"


def required_distributions(name: str) -> set[str]:
    """``name`` and every distribution it requires, recursively, extras left out."""
    seen, todo = set(), [name]
    while todo:
        dist = distribution(todo.pop())
        key = dist.metadata["Name"].lower()
        if key in seen:
            continue
        seen.add(key)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


@pytest.fixture(scope="module")
def core_python(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("core")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    python = str(root / "venv" / "bin" / "python")
    theirs = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    for name in required_distributions("zerodp"):
        dist = distribution(name)
        tops = {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}
        for top in tops:
            if (ours / top).exists() and not (theirs / top).exists():
                (theirs / top).symlink_to(ours / top)
    return python


def test_the_view_holds_no_optional_library(core_python):
    found = subprocess.run([core_python, "-c", "import importlib.util as u, sys; "
                            "print([n for n in sys.argv[1:] if u.find_spec(n)])", *OPTIONAL],
                           check=True, capture_output=True, text=True).stdout.strip()
    assert found == "[]"
    subprocess.run([core_python, "-c", "import torch, pydantic, tqdm, numpy, zerodp"], check=True)


@pytest.mark.parametrize("preset", ["zero3"])
def test_train_save_and_resume_with_the_core_dependencies(core_python, tmp_path, preset):
    """``zerodp train`` on 2 ranks saves at step 2; ``--resume`` loads it and trains on to step 4
    (loading once needed bitsandbytes, an optional dependency, for every model)."""
    def train(*extra):
        proc = subprocess.run([core_python, "-c", CLI, "train", "--model", "tiny", "--preset", preset,
                               "--save-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), *extra],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=dict(os.environ, PYTHONPATH=""))
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        return proc.stdout
    train("--steps", "2", "--save-interval", "2")
    out = train("--steps", "4", "--resume")
    assert "resumed at step 2" in out
    assert (tmp_path / "ckpt" / "global_step4").is_dir()

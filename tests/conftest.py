import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from distpool import WorkerPool

_pool = None


@pytest.fixture
def pool():
    """The session's worker pool (restarted after a task that hung)."""
    global _pool
    if _pool is None or _pool.broken:
        if _pool is not None:
            _pool.close()
        _pool = WorkerPool()
    yield _pool


def pytest_sessionfinish(session, exitstatus):
    if _pool is not None:
        _pool.close()


@pytest.fixture(scope="session")
def no_deepspeed_python(tmp_path_factory) -> str:
    """A Python whose site-packages is ours without DeepSpeed: a virtual environment whose
    site-packages links every entry of ours except DeepSpeed's (the test environment installs the
    real DeepSpeed, whose checkpoint files some tests read). Made once per session."""
    root = tmp_path_factory.mktemp("no_deepspeed")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    theirs = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    linked = 0
    for entry in ours.iterdir():
        if entry.name.lower().startswith("deepspeed") or (theirs / entry.name).exists():
            continue
        (theirs / entry.name).symlink_to(entry)
        linked += 1
    assert linked > 10 and not any(p.name.lower().startswith("deepspeed") for p in theirs.iterdir())
    return str(python)

import subprocess
import sys
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
    """A Python whose site-packages is ours without DeepSpeed (``benchmarks/_common.py``): the test
    environment installs the real DeepSpeed, whose checkpoint files some tests read, and beside it
    ``ZERODP_AS_DEEPSPEED=1`` refuses. Made once per session."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from _common import python_without_deepspeed
    python = python_without_deepspeed(str(tmp_path_factory.mktemp("no_deepspeed")))
    theirs = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip())
    entries = [p.name.lower() for p in theirs.iterdir()]
    assert len(entries) > 10 and not any(name.startswith("deepspeed") for name in entries)
    return python

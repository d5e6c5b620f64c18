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

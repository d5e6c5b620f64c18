"""Helpers shared by the benchmark scripts in this folder.

Driver side: the environment every worker runs with, launching one run under ``torchrun``
in a process group of its own (killed whole on a timeout), and reading the ``RESULT`` line
rank 0 prints. Worker side: the example GPT loaded on its own (without importing the
``zerodp`` package, so that peers' workers carry none of it), the per-rank batches, and
resident-memory readings.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from typing import Iterable, Optional

RESULT_PREFIX = "RESULT "

# ---------------------------------------------------------------------------- driver side


#: glibc serves allocations of this many bytes or more with ``mmap`` in a memory run
#: (``worker_env(memory=True)``).
MMAP_THRESHOLD = "65536"


def worker_env(world: int, extra: Optional[dict] = None, memory: bool = True) -> dict:
    """Environment for a run's workers; the cores are split evenly between the ranks (one
    thread each on a 2-core machine).

    ``memory``: ``MALLOC_MMAP_THRESHOLD_`` makes glibc serve large allocations with mmap, so
    freed memory goes back to the OS and peak RSS shows what a system really keeps. It also
    makes every large allocation fault its pages in afresh, which slows every system (DDP's
    step by a fifth at world size 2 here, its activations) and those that free and allocate
    again within a step (stage 3's gathered parameters) the most; a run that times steps
    leaves glibc's own settings (``memory=False``), as a user's process has them.
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)))
    if memory:
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    env.update(extra or {})
    return env


@dataclasses.dataclass
class Launch:
    """What one ``torchrun`` invocation left behind."""

    returncode: Optional[int]  # None: killed after the timeout
    stdout: str
    stderr: str
    seconds: float

    def result(self):
        """The JSON payload of the last ``RESULT`` line, or None."""
        found = None
        for line in self.stdout.splitlines():
            if line.startswith(RESULT_PREFIX):
                found = json.loads(line[len(RESULT_PREFIX):])
        return found


def torchrun(script: str, world: int, script_args: list[str], env: dict,
             timeout: Optional[float] = None, python: str = sys.executable) -> Launch:
    """Run ``script`` on ``world`` local ranks with ``python -m torch.distributed.run``.

    The launcher gets a session (process group) of its own, so a run past ``timeout``
    seconds is ended with all its workers.
    """
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           os.path.abspath(script), *script_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        out, err = proc.communicate()
        code = None
    return Launch(code, out, err, time.perf_counter() - t0)


def failure_reason(launch: Launch, limit: int = 160) -> str:
    """One line saying why a run gave no result: a timeout, or the last error line a worker
    printed (a traceback's last line names the exception)."""
    if launch.returncode is None:
        return f"timed out after {launch.seconds:.0f} s"
    text = launch.stderr + "\n" + launch.stdout
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # torchrun's own summary repeats the failure without its cause; prefer a worker's
    # exception line ("SomeError: message", possibly behind a "[rank0]:" prefix)
    for ln in reversed(lines):
        bare = ln.split("]:", 1)[1].strip() if ln.startswith("[rank") and "]:" in ln else ln
        head = bare.split(":", 1)[0]
        if (head.endswith(("Error", "Exception", "Interrupt")) and " " not in head
                and not head.endswith("ChildFailedError")):  # torchrun's own, not the cause
            return bare[:limit]
    return f"exit code {launch.returncode}" + (f": {lines[-1][:limit]}" if lines else "")


def python_without_deepspeed(root: str, also: tuple[str, ...] = ()) -> str:
    """A Python whose site-packages is this one's without DeepSpeed: a virtual environment in
    ``root`` whose site-packages links every entry of this one's except DeepSpeed's (for
    ``ZERODP_AS_DEEPSPEED=1``, which refuses beside a real DeepSpeed) and those of the
    distributions named in ``also`` (``"lightning"``: its package and dist-info, not
    ``lightning_fabric``'s). Returns its python."""
    import sysconfig
    from pathlib import Path
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", os.path.join(root, "venv")], check=True)
    python = os.path.join(root, "venv", "bin", "python")
    theirs = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip())

    def left_out(name: str) -> bool:
        name = name.lower()
        return name.startswith("deepspeed") or any(name == n or name.startswith(n + "-") for n in also)
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not left_out(entry.name) and not (theirs / entry.name).exists():
            (theirs / entry.name).symlink_to(entry)
    return python


# ---------------------------------------------------------------------------- statistics


def median(values: Iterable[float]) -> Optional[float]:
    """Median of the values that are not None; None when there are none."""
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ratio(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    """``value / reference``, or None when either is missing or the reference is 0."""
    if value is None or not reference:
        return None
    return value / reference


# ---------------------------------------------------------------------------- the disk


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def evict(path: str) -> float:
    """Fsync every file under ``path`` and drop it from the page cache (twice: the first pass
    can miss pages not yet on the kernel's LRU lists); returns the seconds the fsyncs took
    (zero-ish for files already durable)."""
    spent = 0.0
    for attempt in range(2):
        for name in files_under(path):
            fd = os.open(name, os.O_RDONLY)
            try:
                if attempt == 0:
                    t0 = time.perf_counter()
                    os.fsync(fd)
                    spent += time.perf_counter() - t0
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return spent


def write_file(path: str, nbytes: int, chunk: int = 8 << 20) -> tuple[int, float]:
    """Write ``nbytes`` (rounded to whole ``chunk`` writes, at least one) of random bytes to
    ``path`` and fsync; returns the bytes written and the seconds to the end of the fsync."""
    view = memoryview(bytearray(os.urandom(chunk)))
    nbytes = max(chunk, nbytes // chunk * chunk)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.write(fd, view)
        os.fsync(fd)
        return nbytes, time.perf_counter() - t0
    finally:
        os.close(fd)


def read_file(path: str, chunk: int = 8 << 20) -> tuple[int, float]:
    """Read ``path`` sequentially in ``chunk`` reads into one reused buffer; returns the bytes
    read and the seconds (evict it first for a read from the disk)."""
    view = memoryview(bytearray(chunk))
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        got = 0
        while (n := os.preadv(fd, [view], got)) > 0:
            got += n
        return got, time.perf_counter() - t0
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- worker side


def load_example_gpt():
    """The module ``zerodp/examples/gpt.py``, loaded from its file without importing the
    ``zerodp`` package (the file needs only torch)."""
    name = "_benchmark_example_gpt"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec("zerodp")
    if spec is None or spec.origin is None:
        raise ImportError("zerodp is not installed: pip install -e .")
    path = os.path.join(os.path.dirname(spec.origin), "examples", "gpt.py")
    file_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    file_spec.loader.exec_module(module)
    return module


def make_batches(gpt_module, block_size: int, micro_batch: int, count: int, seed: int, rank: int):
    """``count`` (x, y) micro-batches for ``rank``: random windows of the standard library's
    source (the first 2 MB), drawn from a generator seeded by ``seed`` and the rank, so every
    system sees the same data in the same order on each rank."""
    import torch

    corpus = gpt_module.ByteCorpus(max_bytes=2_000_000)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return [corpus.batch("train", micro_batch, block_size, generator=gen) for _ in range(count)]


def rss_now_mib() -> float:
    """Resident set size of this process now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def proc_status_mib(key: str) -> float:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``RssAnon`` ...) in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------- worker processes


def start_worker() -> bool:
    """In a torchrun worker: the process group (NCCL and this rank's GPU where CUDA is there, else
    gloo); whether it runs on CUDA."""
    import torch
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return cuda


class AddedPeak:
    """What a worker's steps add to its memory at their peak (MiB): on CUDA the allocator's peak over
    what was allocated at the start, else the resident high-water mark over the RSS at the start
    (reset through ``/proc/self/clear_refs``). ``sync()`` waits for the GPU before a clock is read."""

    def __init__(self, cuda: bool) -> None:
        import torch
        self.cuda, self.torch = cuda, torch
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
        else:
            self.base = proc_status_mib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the high-water mark starts again from now

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def mib(self) -> float:
        return (self.torch.cuda.max_memory_allocated() / 2**20 if self.cuda else proc_status_mib("VmHWM")) - self.base

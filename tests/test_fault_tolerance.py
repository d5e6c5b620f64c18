"""Fault tolerance with real processes: one worker is killed with SIGKILL in the middle of
training, torchrun restarts the group (``--max-restarts 1``), every rank resumes from the
newest checkpoint, and the run ends with exactly the weights of a run never interrupted.

Each launcher runs in a session of its own and marks its processes with a tag in their
environment; whatever is left of them when a test ends is killed."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zerodp.tools.train import WORKER_ENV

HERE = Path(__file__).parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STEPS = 60
TRAIN_ARGS = ["--model", "tiny", "--preset", "zero3", "--steps", str(STEPS), "--save-interval", "10",
              "--max-bytes", "200000", "--eval-every", "0", "--resume"]
SCRIPT_STEPS = 200
TAG_VAR = "ZERODP_FT_TAG"
RESTARTED = "will restart worker group"
POLL_S = 0.02
# torchrun's c10d rendezvous shares its TCPStore with the workers and keeps it across restarts,
# so a restarted group reads the killed workers' gloo addresses from it and cannot connect
# (pytorch/pytorch#135712, #167288); with this set, every attempt gets a store of its own.
# `zerodp train` sets it for the torchrun it launches; a script launched with torchrun
# directly needs it in torchrun's environment (the README's recipe says so).
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
RUN_TIMEOUT_S = 240


# -- processes ------------------------------------------------------------------------------

def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _environ(pid: int) -> dict[str, str]:
    pairs = (item.partition(b"=") for item in _read(f"/proc/{pid}/environ").split(b"\0") if item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def _cmdline(pid: int) -> list[str]:
    return [a.decode(errors="replace") for a in _read(f"/proc/{pid}/cmdline").split(b"\0") if a]


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for task in tasks:
        kids += [int(k) for k in _read(f"/proc/{pid}/task/{task}/children").split()]
    return kids


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    stat = _read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(b")", 1)[1].split()[0] != b"Z"


class Launch:
    """A launcher command started in a session of its own, output to a file."""

    def __init__(self, cmd: list[str], log: Path, cwd: Path, env: dict[str, str] | None = None,
                 torchrun_env: bool = True):
        self.tag = uuid.uuid4().hex
        self.log = log
        base = {k: v for k, v in os.environ.items() if k not in RESTART_ENV}
        full_env = {**base, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO", TAG_VAR: self.tag,
                    **(RESTART_ENV if torchrun_env else {}), **(env or {})}
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=cwd, env=full_env, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self, entry: str) -> dict[int, int]:
        """Global rank -> pid of the training processes (children of the torchrun agent)."""
        found, todo = {}, [self.proc.pid]
        while todo:
            pid = todo.pop()
            kids = _children(pid)
            todo += kids
            if not any(a == "torch.distributed.run" for a in _cmdline(pid)):
                continue
            for kid in kids:
                env, argv = _environ(kid), _cmdline(kid)
                if "RANK" in env and any(entry in a for a in argv) and _alive(kid):
                    found[int(env["RANK"])] = kid
        return found

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.proc.args} did not finish in {timeout} s; its output:\n{self.output()}")

    def kill(self) -> None:
        """SIGKILL the launcher and every process that carries its tag."""
        for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
            if pid != os.getpid() and _environ(pid).get(TAG_VAR) == self.tag:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def launches():
    """Start launchers with ``launches(cmd, log, cwd, env)``; kill what is left of them at the end."""
    started: list[Launch] = []

    def start(*args, **kwargs) -> Launch:
        started.append(Launch(*args, **kwargs))
        return started[-1]
    yield start
    for launch in started:
        launch.kill()


def _step_of(tag: str) -> int:
    m = re.fullmatch(r"global_step(\d+)", tag)
    assert m, f"unexpected checkpoint tag {tag!r}"
    return int(m.group(1))


def kill_worker_after_first_checkpoint(launch: Launch, save_dir: Path, entry: str, pick,
                                       timeout: float = RUN_TIMEOUT_S) -> tuple[int, int]:
    """Once ``save_dir/latest`` exists, SIGKILL the worker ``pick(workers)`` chooses (workers:
    global rank -> pid); return its pid and the step of the newest checkpoint at that moment."""
    latest = save_dir / "latest"
    deadline = time.monotonic() + timeout
    while not latest.exists():
        if launch.proc.poll() is not None:
            pytest.fail(f"the run ended before its first checkpoint:\n{launch.output()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no checkpoint after {timeout} s:\n{launch.output()}")
        time.sleep(POLL_S)
    workers = launch.workers(entry)
    step = _step_of(latest.read_text().strip())
    victim = pick(workers)
    assert victim is not None, f"no worker to kill among {workers}"
    os.kill(victim, signal.SIGKILL)
    while _alive(victim):
        time.sleep(POLL_S)
    return victim, step


def wait_all(launches: list[Launch], timeout: float = RUN_TIMEOUT_S) -> list[int | None]:
    """Exit codes of ``launches``, returned early once one fails (the others would wait for it
    at torchrun's exit barrier for minutes)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [launch.proc.poll() for launch in launches]
        if None not in codes or any(code not in (None, 0) for code in codes):
            return codes
        if time.monotonic() > deadline:
            logs = "\n\n".join(launch.output() for launch in launches)
            pytest.fail(f"not finished in {timeout} s:\n{logs}")
        time.sleep(5 * POLL_S)


def assert_same_weights(path: Path, reference: Path) -> None:
    got, want = load_file(str(path)), load_file(str(reference))
    assert sorted(got) == sorted(want)
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ from the uninterrupted run: {differ}"


def assert_restarted_after_kill(output: str, victim: int) -> None:
    """torchrun saw the killed worker die of SIGKILL and restarted the group."""
    assert re.search(rf"failed \(exitcode: -9\) local_rank: \d+ \(pid: {victim}\)", output), output
    assert "Worker group FAILED. 1/1 attempts left; " + RESTARTED in output, output


def resumed_step(output: str, pattern: str) -> int:
    found = re.findall(pattern, output)
    assert len(found) == 1, f"expected one resume line matching {pattern!r}:\n{output}"
    return int(found[0])


# -- zerodp train ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_weights(tmp_path_factory) -> Path:
    """``zerodp train --nproc 2`` with ``TRAIN_ARGS``, never interrupted: its model.safetensors."""
    d = tmp_path_factory.mktemp("reference")
    launch = Launch([sys.executable, "-m", "zerodp.tools.cli", "train", "--nproc", "2", *TRAIN_ARGS,
                     "--out", str(d / "out")], d / "log.txt", d, torchrun_env=False)
    try:
        assert launch.wait() == 0, launch.output()
    finally:
        launch.kill()
    assert "resume: no checkpoint" in launch.output()
    return d / "out" / "model.safetensors"


def test_killed_rank_restarts_and_resumes_to_same_weights(tmp_path, launches, reference_weights):
    """``zerodp train --max-restarts 1``: rank 0 is killed after the first checkpoint; torchrun
    restarts both ranks, they resume from ``latest`` and end bit-identical to an uninterrupted
    run. Nothing is set in the environment: zerodp train gives torchrun what a restart needs."""
    out = tmp_path / "out"
    launch = launches([sys.executable, "-m", "zerodp.tools.cli", "train", "--nproc", "2", "--max-restarts", "1",
                       *TRAIN_ARGS, "--out", str(out)], tmp_path / "log.txt", tmp_path, torchrun_env=False)
    victim, killed_at = kill_worker_after_first_checkpoint(launch, out / "checkpoints", "zerodp.tools.train",
                                                           lambda workers: workers.get(0))
    rc = launch.wait()
    text = launch.output()
    assert rc == 0, text
    assert 0 < killed_at < STEPS
    assert_restarted_after_kill(text, victim)
    assert "resume: no checkpoint" in text  # the first attempt started from scratch
    step = resumed_step(text, r"resume: continuing from \S+ at step (\d+)")
    assert killed_at <= step < STEPS, (killed_at, step)
    assert f"(resumed at step {step})" in text
    assert_same_weights(out / "model.safetensors", reference_weights)


# -- two nodes ------------------------------------------------------------------------------

def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_nodes():
    """Two network namespaces joined by a veth pair: [(namespace, interface, address)] * 2."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("the 'ip' command (iproute2) is not installed")
    suffix = uuid.uuid4().hex[:8]
    nodes = [(f"zdpft-{suffix}-{i}", f"zdp{suffix}{i}", f"10.231.0.{i + 1}") for i in range(2)]
    try:
        for ns, _, _ in nodes:
            _ip("netns", "add", ns)
        _ip("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])
        for ns, ifname, addr in nodes:
            _ip("link", "set", ifname, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", ifname, "up")
        yield nodes
    finally:
        for ns, ifname, _ in nodes:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "delete", ifname], capture_output=True, timeout=30)


def test_two_nodes_killed_worker_restarts_and_resumes_to_same_weights(tmp_path, two_nodes, launches,
                                                                       reference_weights):
    """One torchrun agent per network namespace (c10d rendezvous over a veth pair, gloo between
    the nodes): the second node's worker is killed after the first checkpoint; both agents
    restart their workers, which resume from the shared ``latest`` and end bit-identical to an
    uninterrupted 2-rank run."""
    out = tmp_path / "out"
    endpoint = f"{two_nodes[0][2]}:29400"
    run_id = uuid.uuid4().hex
    agents = []
    # The hostname resolves to 127.0.0.1 in every namespace, so torchrun is told which agent
    # hosts the rendezvous store (is_host) and which address each node advertises to the
    # workers (--local-addr), and gloo which interface to bind (GLOO_SOCKET_IFNAME). WORKER_ENV
    # makes the workers end as `zerodp train`'s do, with os._exit, skipping an interpreter
    # teardown that can abort while gloo's threads still run.
    for i, (ns, ifname, addr) in enumerate(two_nodes):
        cmd = ["ip", "netns", "exec", ns, *TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
               "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", addr, "--max-restarts", "1",
               "-m", "zerodp.tools.train", *TRAIN_ARGS, "--out", str(out)]
        agents.append(launches(cmd, tmp_path / f"node{i}.txt", tmp_path,
                               env={"GLOO_SOCKET_IFNAME": ifname, WORKER_ENV: "1"}))
    victim, killed_at = kill_worker_after_first_checkpoint(
        agents[1], out / "checkpoints", "zerodp.tools.train", lambda workers: next(iter(workers.values()), None))
    codes = wait_all(agents)
    texts = [agent.output() for agent in agents]
    assert codes == [0, 0], "\n\n".join(texts)
    assert 0 < killed_at < STEPS
    assert_restarted_after_kill(texts[1], victim)
    assert RESTARTED in texts[0], texts[0]  # the other node restarts its worker too
    both = "\n".join(texts)
    step = resumed_step(both, r"resume: continuing from \S+ at step (\d+)")
    assert killed_at <= step < STEPS, (killed_at, step)
    assert_same_weights(out / "model.safetensors", reference_weights)


# -- the recipe for any script ----------------------------------------------------------------

def test_script_recipe_resumes_to_same_weights(tmp_path, launches):
    """``ft_script.py`` (load_checkpoint at start, save_checkpoint every few steps) under
    ``torchrun --max-restarts 1``: rank 1 is killed after the first checkpoint, and the
    restarted run ends with the same weights as an uninterrupted one."""
    def command(d: Path) -> list[str]:
        return [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                str(HERE / "ft_script.py"), str(d / "ckpt"), str(d / "out"), str(SCRIPT_STEPS)]

    ref, run = tmp_path / "reference", tmp_path / "killed"
    ref.mkdir()
    run.mkdir()
    reference = launches(command(ref), ref / "log.txt", ref)
    assert reference.wait() == 0, reference.output()
    assert "resumed from" not in reference.output()

    launch = launches(command(run), run / "log.txt", run)
    victim, killed_at = kill_worker_after_first_checkpoint(launch, run / "ckpt", "ft_script.py",
                                                           lambda workers: workers.get(1))
    rc = launch.wait()
    text = launch.output()
    assert rc == 0, text
    assert 0 < killed_at < SCRIPT_STEPS
    assert_restarted_after_kill(text, victim)
    step = resumed_step(text, r"resumed from \S+ at step (\d+)")
    assert killed_at <= step < SCRIPT_STEPS, (killed_at, step)
    assert_same_weights(run / "out" / "model.safetensors", ref / "out" / "model.safetensors")

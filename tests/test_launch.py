"""``zerodp launch``: DeepSpeed's ``deepspeed`` launcher for one node, on torchrun.

Options and the torchrun command are checked without starting processes; four real runs of
``launch_script.py`` on 2 ranks check what the script sees (``--local_rank=<r>`` right after the
script name, as DeepSpeed's ``launcher/launch.py`` puts it, the user's arguments unchanged), that
it matches what the real ``deepspeed`` launcher gives the same script, ``--no_local_rank``, a
failing script's exit code, and Ctrl-C."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from distpool import _free_port

from zerodp.tools import cli, launch, launch_worker, train

SCRIPT = str(Path(__file__).parent / "launch_script.py")
USER_ARGS = ["--deepspeed", "--deepspeed_config", "ds config.json", "--local_rank", "7", "-h", "x=1"]
LAUNCH = [sys.executable, "-m", "zerodp.tools.cli", "launch"]
TIMEOUT_S = 120


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["launch", *argv])


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ZERODP_AS_DEEPSPEED", "LAUNCH_SCRIPT_EXIT")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def records(output: str) -> dict[int, dict]:
    """Local rank -> what ``launch_script.py`` printed on that rank."""
    found = [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("LAUNCH_SCRIPT ")]
    return {int(r["env"]["LOCAL_RANK"]): r for r in found}


# ---------------------------------------------------------------- options, without processes

@pytest.mark.parametrize("spelling", ["--num_gpus", "--num-gpus"])
def test_launcher_options_stop_at_the_script(spelling):
    args = parse(spelling, "2", "--master_port", "29600", "--no_local_rank", SCRIPT, *USER_ARGS, spelling, "3")
    assert (args.num_gpus, args.master_port, args.no_local_rank, args.module) == (2, 29600, True, False)
    assert args.script == SCRIPT and args.script_args == [*USER_ARGS, spelling, "3"]


def test_torchrun_command():
    cmd = launch.torchrun_command(parse(SCRIPT, *USER_ARGS), 3)
    assert cmd[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert cmd[4:] == ["--nproc-per-node", "3", "-m", launch.WORKER, SCRIPT, *USER_ARGS]
    cmd = launch.torchrun_command(parse("--master-port", "29600", "--master_addr", "10.0.0.1", "--module",
                                        "--no-local-rank", "pkg.train", "a"), 2)
    assert "--standalone" not in cmd
    assert cmd[cmd.index("--master-port") + 1] == "29600" and cmd[cmd.index("--master-addr") + 1] == "10.0.0.1"
    assert cmd[cmd.index(launch.WORKER):] == [launch.WORKER, "--no-local-rank", "--module", "pkg.train", "a"]


def test_process_count_and_environment(monkeypatch):
    import torch
    seen = []
    monkeypatch.setattr(launch, "run_torchrun", lambda cmd, env, command, what: seen.append((cmd, env)) or 0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for available, count, argv, want in [(False, 0, [], "1"), (True, 4, [], "4"), (True, 4, ["--num_gpus", "2"], "2"),
                                         (False, 0, ["--num_gpus", "-1"], "1")]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda a=available: a)
        monkeypatch.setattr(torch.cuda, "device_count", lambda c=count: c)
        assert cli.main(["launch", *argv, SCRIPT]) == 0
        cmd, env = seen.pop()
        assert cmd[cmd.index("--nproc-per-node") + 1] == want, (available, count, argv)
        assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // int(want)))
        assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert {**launch.torchrun_env(2), train.WORKER_ENV: "1"} == cli._worker_env(2)


@pytest.mark.parametrize("argv, option", [
    *[([name, "x"] if metavar else [name], name) for names, metavar, _, _ in launch.REFUSED for name in names],
    (["--hostfile=hosts"], "--hostfile"), (["--num_nodes", "2"], "--num_nodes"), (["--num-nodes=4"], "--num-nodes"),
    (["--num_gpus", "0"], "--num_gpus"), (["--master_port", "port"], "--master_port")])
def test_refused_options_exit_2_naming_the_option(capsys, argv, option):
    with pytest.raises(SystemExit) as e:
        cli.main(["launch", *argv, SCRIPT, "--deepspeed"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{option}" in err and "Traceback" not in err
    multi_node = option in ("--num_nodes", "--num-nodes") or any(
        option in names for names, _, _, multi in launch.REFUSED if multi)
    assert ("multi-node run with torchrun" in err) == multi_node, err


def test_a_missing_script_exits_2(tmp_path, capsys):
    assert cli.main(["launch", str(tmp_path / "nowhere.py")]) == 2
    assert "nowhere.py: no such file" in capsys.readouterr().err


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["launch", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--num_gpus", "--num-gpus", "--num_nodes", "--master_port", "--master_addr", "--no_local_rank",
                   "--module", "--hostfile", "--include", "--exclude", "--autotuning", "SCRIPT", "ARGS"):
        assert option in out, option
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices["launch"]._actions:
        assert action.help, f"undocumented option {action.option_strings}"


# ---------------------------------------------------------------- the worker, in this process

@pytest.mark.parametrize("module", [False, True])
def test_the_worker_runs_the_script_as_main(tmp_path, monkeypatch, module):
    """As ``python SCRIPT`` (its directory first on sys.path) or ``python -m`` (the working directory)."""
    package = tmp_path / "launch_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    out = tmp_path / "seen.json"
    (package / "train.py").write_text(f"import json, sys\njson.dump({{'argv': sys.argv, 'path0': sys.path[0], "
                                      f"'name': __name__}}, open({str(out)!r}, 'w'))\n")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path[1:]])  # as python -m sets it
    target = "launch_pkg.train" if module else str(package / "train.py")
    monkeypatch.setattr(sys, "argv", ["launch_worker", *["--module"] * module, target, "--deepspeed", "a"])
    try:
        launch_worker.main()
    finally:
        sys.modules.pop("launch_pkg", None)
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(package / "train.py"), "--local_rank=1", "--deepspeed", "a"]
    assert seen["path0"] == str(tmp_path if module else package)
    assert launch_worker.script_argv(["--no-local-rank", "s.py", "--module"], "3") == (False, ["s.py", "--module"])


# ---------------------------------------------------------------- real runs, 2 ranks

@pytest.fixture(scope="module")
def zerodp_run() -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCH, "--num_gpus", "2", SCRIPT, *USER_ARGS], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=environment())


def test_each_rank_gets_its_local_rank_after_the_script(zerodp_run):
    assert zerodp_run.returncode == 0, zerodp_run.stdout + zerodp_run.stderr
    ranks = records(zerodp_run.stdout)
    assert sorted(ranks) == [0, 1], zerodp_run.stdout + zerodp_run.stderr
    for local_rank, seen in ranks.items():
        # deepspeed/launcher/launch.py: cmd = [python, -u, script, f"--local_rank={local_rank}", *user_args]
        assert seen["argv"] == [SCRIPT, f"--local_rank={local_rank}", *USER_ARGS]
        assert seen["env"]["RANK"] == str(local_rank) and seen["env"]["WORLD_SIZE"] == "2"
        assert seen["name"] == "__main__" and seen["path0"] == str(Path(SCRIPT).parent)
        assert seen["sum"] == 3.0


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_the_script_sees_what_the_deepspeed_launcher_gives_it(zerodp_run):
    """The same command line under ``deepspeed`` (its runner, on CPU here) and ``zerodp launch``."""
    deepspeed = subprocess.run(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()),
         SCRIPT, *USER_ARGS], capture_output=True, text=True, timeout=TIMEOUT_S, env=environment())
    assert deepspeed.returncode == 0, deepspeed.stdout + deepspeed.stderr
    theirs = records(deepspeed.stdout)
    assert sorted(theirs) == [0, 1], deepspeed.stdout + deepspeed.stderr
    assert records(zerodp_run.stdout) == theirs


def test_no_local_rank_and_a_failing_script(tmp_path):
    proc = subprocess.run([*LAUNCH, "--num-gpus", "2", "--master_port", str(_free_port()), "--no_local_rank",
                           SCRIPT, *USER_ARGS], capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=environment(LAUNCH_SCRIPT_EXIT="3"))
    ranks = records(proc.stdout)
    assert sorted(ranks) == [0, 1], proc.stdout + proc.stderr
    assert all(seen["argv"] == [SCRIPT, *USER_ARGS] for seen in ranks.values())
    assert proc.returncode != 0
    assert "zerodp launch: error: the run failed (exit code" in proc.stderr


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("started", ["plain", "sigint_ignored"])
def test_ctrl_c_stops_the_workers_and_exits_130(started):
    # "sigint_ignored": started as a shell script's background job is, with SIGINT ignored;
    # the launcher still stops on it, and so do torchrun and the workers.
    proc = subprocess.Popen([*LAUNCH, "--num_gpus", "2", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=environment(LAUNCH_SCRIPT_WAIT="1"),
                            preexec_fn=_ignore_sigint if started == "sigint_ignored" else None)
    try:
        workers = []
        for line in proc.stdout:  # (a line two ranks wrote into at once still gives both)
            workers += [int(pid) for pid in re.findall(r"LAUNCH_SCRIPT_READY (\d+)", line)]
            if len(workers) >= 2:
                break
        assert len(workers) == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=TIMEOUT_S) == 130
    finally:
        proc.kill()
        proc.wait()
    for pid in workers:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", f"worker {pid} still runs"


def test_workers_that_ignore_the_interrupt_are_killed_after_the_grace_time(monkeypatch):
    # A "torchrun" that ignores SIGINT: after STOP_GRACE_S the launcher kills it and exits 130.
    monkeypatch.setattr(launch, "STOP_GRACE_S", 1.0)
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "print('READY', flush=True); time.sleep(600)"]
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    start = time.monotonic()
    timer.start()
    try:
        assert launch.run_torchrun(stubborn, environment(), "launch", "the run") == 130
    finally:
        timer.cancel()
    assert time.monotonic() - start < 30

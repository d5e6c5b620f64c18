"""``ZERODP_AS_DEEPSPEED=1``: ``import deepspeed`` and the ``deepspeed`` distribution resolve to
zerodp, read at interpreter start-up (``zerodp-as-deepspeed.pth``); off, nothing changes; with a
real deepspeed installed, the switch refuses.

The test environment installs the real DeepSpeed (the checkpoint tests read its files), so the
cases that need an environment without it run in a view of this one (``no_deepspeed_python`` in
``conftest.py``).
"""
from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

import zerodp_as_deepspeed as switch

ENV = "ZERODP_AS_DEEPSPEED"


def run(python: str, code: str, switch_value: str | None = "1", extra_path: str | None = None,
        args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if switch_value is not None:
        env[ENV] = switch_value
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    return subprocess.run([python, *args, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_switch_reads_only_on_and_off_values():
    assert switch.requested({ENV: "1"}) and switch.requested({ENV: " On "}) and switch.requested({ENV: "true"})
    assert not switch.requested({}) and not switch.requested({ENV: "0"}) and not switch.requested({ENV: "off"})
    with pytest.raises(ValueError, match=f"{ENV}='2': expected 1"):
        switch.requested({ENV: "2"})


def test_off_deepspeed_stays_missing(no_deepspeed_python):
    out = run(no_deepspeed_python, """
        import importlib.metadata, importlib.util, sys
        assert importlib.util.find_spec("deepspeed") is None
        try:
            importlib.metadata.version("deepspeed")
        except importlib.metadata.PackageNotFoundError:
            print("no metadata")
        import deepspeed
    """, switch_value=None)
    assert out.returncode != 0 and "no metadata" in out.stdout
    assert "No module named 'deepspeed'" in out.stderr


def test_on_deepspeed_is_zerodp_from_start_up(no_deepspeed_python):
    out = run(no_deepspeed_python, """
        import importlib.metadata
        version = importlib.metadata.version("deepspeed")      # before anything imports zerodp
        import deepspeed, zerodp
        import deepspeed.comm as dist
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from zerodp.ops.adam import DeepSpeedCPUAdam as ours
        assert deepspeed.initialize is zerodp.initialize and deepspeed.zero.Init is zerodp.zero.Init
        assert dist is zerodp.comm and DeepSpeedCPUAdam is ours
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
        from deepspeed.runtime.lr_schedules import WarmupLR
        from deepspeed.utils import logger
        from deepspeed import DeepSpeedEngine
        assert DeepSpeedEngine is zerodp.ZeroEngine and WarmupLR is zerodp.optim.WarmupLR
        assert logger.name == "zerodp" and callable(clone_tensors_for_torch_save)
        assert deepspeed.__version__ == version, (deepspeed.__version__, version)
        assert importlib.metadata.packages_distributions()["deepspeed"] == ["deepspeed"]
        from transformers.integrations.deepspeed import is_deepspeed_available as hf
        from accelerate.utils import is_deepspeed_available as acc
        assert hf() and acc()
        try:
            import deepspeed.no_such_module
        except ModuleNotFoundError as e:
            assert "zerodp" in str(e) and e.name == "deepspeed.no_such_module", e
        print("version", version)
    """)
    assert out.returncode == 0, out.stderr
    assert f"version {switch.DEEPSPEED_API}+zerodp." in out.stdout


def test_a_real_deepspeed_makes_the_switch_refuse(no_deepspeed_python, tmp_path):
    real = tmp_path / "site" / "deepspeed"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("__version__ = '0.19.8'\n")
    out = run(no_deepspeed_python, "import deepspeed", extra_path=str(real.parent))
    assert out.returncode != 0
    assert "a real deepspeed is installed in this environment" in out.stderr
    assert str(real / "__init__.py") in out.stderr and "pip uninstall deepspeed" in out.stderr
    off = run(no_deepspeed_python, "import deepspeed; print(deepspeed.__version__)", switch_value="0",
              extra_path=str(real.parent))
    assert off.returncode == 0 and off.stdout.strip() == "0.19.8"


def test_a_bad_value_leaves_the_switch_off_and_says_so(no_deepspeed_python):
    out = run(no_deepspeed_python, "import deepspeed", switch_value="yes please")
    assert out.returncode != 0 and "No module named 'deepspeed'" in out.stderr
    assert f"{ENV}='yes please': expected 1 (on) or 0 (off); the switch stays off" in out.stderr


def test_torchrun_workers_inherit_the_switch(no_deepspeed_python, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("import os, importlib.metadata\n"
                      "import deepspeed\n"
                      "line = f\"rank {os.environ['RANK']} {importlib.metadata.version('deepspeed')}\\n\"\n"
                      "os.write(1, line.encode())  # one write: the ranks' lines do not interleave\n")
    env = {**os.environ, ENV: "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([no_deepspeed_python, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--standalone", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} {switch.DEEPSPEED_API}+zerodp." in out.stdout

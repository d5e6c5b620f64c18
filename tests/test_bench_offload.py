"""benchmarks/offload.py runs and its table says what it measured (a tiny size; the real run
is the README's command)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "offload.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_offload", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_adam_case_updates_like_torch_adamw():
    """The cases time real steps: each optimizer moves its parameters as torch's AdamW does
    (weight decay 0: DeepSpeed's Adam default, which zerodp's config follows)."""
    mod = _module()
    n = 10_000
    for build in (mod._zerodp_config_adamw, mod._deepspeed_cpu_adam,
                  lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0, fused=True)):
        torch.manual_seed(0)
        want_step = mod._adam_case(n, 1, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0))
        torch.manual_seed(0)
        got_step = mod._adam_case(n, mod.PIECES, build)
        want_opt, got_opt = want_step.__self__, got_step.__self__
        want_step()
        got_step()
        want = torch.cat([p.detach() for g in want_opt.param_groups for p in g["params"]])
        got = torch.cat([p.detach() for g in got_opt.param_groups for p in g["params"]])
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert mod._zerodp_config_adamw([torch.nn.Parameter(torch.zeros(3))]).defaults["fused"] is True


def test_table(tmp_path, capsys):
    mod = _module()
    assert mod.main(["--part", "adam", "--params", "20000", "--reps", "1", "--threads", "1",
                     "--out", str(tmp_path)]) == 0
    text = (tmp_path / "offload.md").read_text()
    assert "| memory: b.copy_(a) |" in text and "zerodp, config" in text and "100%" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "ms" not in line]
    assert len(rows) == 10
    assert "G params/s" in capsys.readouterr().out


def test_disk_part(tmp_path):
    """The disk section measures every read mechanism and the tile walk (a small size)."""
    mod = _module()
    assert mod.main(["--part", "disk", "--disk-mib", "128", "--disk-dir", str(tmp_path),
                     "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "offload.md").read_text()
    for what in ("sequential write", "sequential read", "into fresh memory", "into reused memory",
                 "O_DIRECT", "mmap", "Tile walk"):
        assert what in text
    assert "nan" not in text.split("Tile walk")[0].replace("failed", "")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("zerodp-rank")]  # swap dir removed


@pytest.mark.slow
def test_steps_and_cap_parts(tmp_path):
    mod = _module()
    assert mod.main(["--part", "steps", "cap", "--disk-dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "offload.md").read_text()
    assert "zero3-nvme" in text and "ds3-offload" in text and "stage 3 + optimizer on disk" in text

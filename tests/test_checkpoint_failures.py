"""Checkpoints that go wrong: killed saves, damaged files, checkpoints of something else.

Every failure must be an error on every rank that says what differs, never a hang, never a
partial checkpoint picked up, and never an engine half overwritten."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import checkpoint_tasks as ct
import pytest
import torch

from zerodp.checkpoint import CheckpointError, get_fp32_state_dict_from_zero_checkpoint, list_tags
from zerodp.checkpoint.load import open_source

HERE = Path(__file__).parent


def saved(pool, tmp_path, world=2, stage=2, steps=1) -> Path:
    pool.run(ct.save_task, world, stage, "fp32", steps, str(tmp_path))
    return tmp_path / f"global_step{steps}"


def errors(results) -> list[str]:
    assert all(r["error"] for r in results), [r["error"] for r in results]
    assert all(r["unchanged"] for r in results), "a failed load changed the engine"
    return [r["error"] for r in results]


def test_model_of_another_shape_is_named(pool, tmp_path):
    saved(pool, tmp_path)
    for msg in errors(pool.run(ct.load_error_task, 2, 1, str(tmp_path), model="wide")):
        assert "shapes differ for 3" in msg
        assert "l1.weight: checkpoint (7, 6), model (8, 6)" in msg


def test_unexpected_and_missing_names_unless_not_strict(pool, tmp_path):
    saved(pool, tmp_path)
    index = tmp_path / "global_step1" / "index.json"
    text = index.read_text().replace('"l1.bias"', '"l1.offset"')
    index.write_text(text)
    for msg in errors(pool.run(ct.load_error_task, 2, 2, str(tmp_path))):
        assert "model parameters are not in the checkpoint: l1.bias" in msg
        assert "checkpoint parameters are not in the model: l1.offset" in msg
    out = pool.run(ct.load_error_task, 2, 2, str(tmp_path), load_module_strict=False)
    assert all(r["error"] is None for r in out)


def test_corrupted_byte_fails_every_rank_naming_the_file(pool, tmp_path):
    """Rank 1's file is damaged; at world 2 and stage 2 only loading rank 1 reads it, and
    both ranks fail with the file named (a rank that fails tells the others)."""
    d = saved(pool, tmp_path)
    f = d / "rank00001.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0xFF
    f.write_bytes(bytes(raw))
    for msg in errors(pool.run(ct.load_error_task, 2, 2, str(tmp_path))):
        assert "rank 1" in msg and "rank00001.safetensors: checksum mismatch" in msg


def test_truncated_file(pool, tmp_path):
    d = saved(pool, tmp_path)
    f = d / "rank00000.safetensors"
    size = f.stat().st_size
    os.truncate(f, size - 100)
    for msg in errors(pool.run(ct.load_error_task, 2, 0, str(tmp_path))):
        assert f"rank00000.safetensors: {size - 100} bytes on disk, {size} when written" in msg


def test_missing_rank_file(pool, tmp_path):
    d = saved(pool, tmp_path, world=3)
    (d / "rank00002.safetensors").unlink()
    for msg in errors(pool.run(ct.load_error_task, 2, 2, str(tmp_path))):
        assert "rank00002.safetensors is missing: the checkpoint was written by 3 ranks" in msg


def test_tag_that_does_not_exist_lists_the_tags(pool, tmp_path):
    saved(pool, tmp_path, steps=1)
    pool.run(ct.save_task, 2, 2, "fp32", 2, str(tmp_path))
    for msg in errors(pool.run(ct.load_error_task, 2, 2, str(tmp_path), tag="global_step9")):
        assert "no checkpoint tag 'global_step9'" in msg and "tags there: global_step1, global_step2" in msg


def test_optimizer_of_another_type(pool, tmp_path):
    saved(pool, tmp_path)
    for msg in errors(pool.run(ct.load_error_task, 2, 2, str(tmp_path), optimizer="SGD")):
        assert "holds the state of a AdamW optimizer" in msg and "this run's optimizer is SGD" in msg
    out = pool.run(ct.load_error_task, 2, 2, str(tmp_path), optimizer="SGD", load_optimizer_states=False)
    assert all(r["error"] is None for r in out)


def test_no_latest_returns_none(pool, tmp_path):
    out = pool.run(ct.load_error_task, 2, 2, str(tmp_path / "empty"))
    assert [r["result"] for r in out] == [(None, None), (None, None)]


def test_client_state_that_is_not_json_fails_on_every_rank(pool, tmp_path):
    out = pool.run(ct.save_error_task, 2, str(tmp_path), {"ok": 1, "bad": object()})
    for r in out:
        assert "client_state['bad']: a builtins.object cannot be stored" in r["error"]
    assert not any(tmp_path.glob(".*.partial")) and not (tmp_path / "latest").exists()


def test_legacy_torch_pickle_is_named_and_refused(tmp_path):
    """A DeepSpeed-named file in torch.save's legacy (non-zip) format: refused, unpickled, with
    the format named (not called truncated); a damaged zip file is still called truncated."""
    tag = tmp_path / "global_step1"
    tag.mkdir()
    path = tag / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(2)}, "dp_world_size": 1}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError) as err:
        open_source(tag)
    msg = str(err.value)
    assert str(path) in msg and "legacy format" in msg and "_use_new_zipfile_serialization=False" in msg
    assert "not loaded" in msg and "truncated" not in msg
    torch.save({"module": {"w": torch.zeros(2)}}, path)
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="truncated or is not a torch.save file"):
        open_source(tag)


@pytest.mark.parametrize("phase", ["write", "index", "rename", "latest", "overwrite"])
def test_save_killed_at_any_point_leaves_the_previous_checkpoint(pool, tmp_path, phase):
    """A real rank process is SIGKILLed inside the second save: ``latest`` and the checkpoint
    it names still load, with the first save's parameters; the next save cleans up."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "ckpt_kill_script.py"), str(tmp_path), phase]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "second save finished" not in proc.stdout, proc.stdout + proc.stderr
    assert "SIGKILL" in proc.stderr or "Signal 9" in proc.stderr, proc.stderr[-2000:]
    expect1 = torch.load(tmp_path / "expect_step1.pt", weights_only=True)
    got = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    for n, v in expect1.items():
        assert torch.equal(got[n], v), n
    assert (tmp_path / "latest").read_text() == "global_step1"
    tags = list_tags(tmp_path)
    if phase in ("rename", "latest"):  # the second save was complete, only `latest` was not moved yet
        assert tags == ["global_step1", "global_step2"]
        expect2 = torch.load(tmp_path / "expect_step2.pt", weights_only=True)
        got2 = get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="global_step2")
        assert all(torch.equal(got2[n], v) for n, v in expect2.items())
    elif phase == "overwrite":  # the old version moved aside is what loads
        assert tags == [] and (tmp_path / ".global_step1.old" / "index.json").is_file()
    else:
        assert tags == ["global_step1"]
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    # an engine resumes from it at another world size, then saves: leftovers are removed
    out = pool.run(ct.resume_task, 3, 1, "fp32", str(tmp_path), 1, 2)
    for n, v in expect1.items():
        assert torch.equal(out[0]["loaded"]["params"][n], v), n
    if phase == "index":  # rank 0 died with the directory unfinished
        assert leftovers == [".global_step2.partial"]
    elif phase == "write":  # rank 0 saw its peer go, and removed it, unless killed first
        assert leftovers in ([], [".global_step2.partial"])
    pool.run(ct.save_task, 2, 2, "fp32", 3, str(tmp_path))
    assert not any(tmp_path.glob(".*.partial"))
    assert (tmp_path / "latest").read_text() == "global_step3"

"""Checkpoints: exact resume, resharding to any world size and stage, and the round trip of
everything besides parameters (tasks in ``checkpoint_tasks.py``)."""
from __future__ import annotations

import json

import checkpoint_tasks as ct
import pytest
import torch

K = 2  # steps before the save, and after the resume


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), f"{what}: {n} differs by {(a[n].float() - b[n].float()).abs().max():.3g}"


def assert_close(got: dict, want: dict, atol: float, what: str) -> None:
    for n, w in want.items():
        err = (got[n].float() - w.float()).abs().max().item()
        assert err <= atol, f"{what}: {n} max |diff| {err:.3g} > {atol}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_bitwise_at_the_same_world_size(pool, tmp_path, stage):
    """Save after K steps, resume in a fresh engine (other initial weights), train K more: the
    parameters, masters and norms equal an uninterrupted run's bit for bit."""
    whole = pool.run(ct.run_task, 2, stage, "fp32", 2 * K)
    pool.run(ct.save_task, 2, stage, "fp32", K, str(tmp_path))
    resumed = pool.run(ct.resume_task, 2, stage, "fp32", str(tmp_path), K, 2 * K)
    for w, r in zip(whole, resumed):
        assert_same(r["params"], w["params"], "params")
        assert r["norms"] == w["norms"][K:]
        assert r["lr"] == w["lr"]
    assert resumed[0]["client"] == {"steps": K, "note": "resume me"}
    assert resumed[0]["path"].endswith(f"global_step{K}")


def test_resume_needs_no_bitsandbytes(pool, tmp_path):
    """bitsandbytes is optional: a checkpoint of a model without 4-bit weights loads where it
    is not installed (a GPU image without it once failed every load here)."""
    pool.run(ct.save_task, 2, 3, "fp32", K, str(tmp_path))
    whole = pool.run(ct.run_task, 2, 3, "fp32", 2 * K)
    resumed = pool.run(ct.resume_without_task, 2, "bitsandbytes", 3, "fp32", str(tmp_path), K, 2 * K)
    for w, r in zip(whole, resumed):
        assert_same(r["params"], w["params"], "params")


def test_client_state_keeps_namespaces_paths_and_numpy_without_pickling(pool, tmp_path):
    """``client_state={"args": args}`` (an argparse.Namespace, as Megatron-style scripts pass it),
    paths and NumPy values come back as they went in; a dict whose keys look like the file's own
    markers stays a dict."""
    import argparse
    import pathlib

    import numpy as np
    args = argparse.Namespace(lr=0.1, out=pathlib.Path("runs/a"), layers=[1, 2], seed=np.int64(3))
    state = {"args": args, "best": np.float64(0.25), "hist": np.arange(6, dtype=np.float32).reshape(2, 3),
             "odd": {"__path__": "not a path", "__tensor__": 1}}
    assert pool.run(ct.save_error_task, 2, str(tmp_path), state)[0]["error"] is None
    client = pool.run(ct.resume_task, 2, 2, "fp32", str(tmp_path), 1, 1)[0]["client"]
    got = client["args"]
    assert isinstance(got, argparse.Namespace)
    assert (got.lr, got.out, got.layers, got.seed) == (0.1, pathlib.Path("runs/a"), [1, 2], 3)
    assert isinstance(got.out, pathlib.Path) and type(got.seed) is int
    assert client["best"] == 0.25 and type(client["best"]) is float
    assert isinstance(client["hist"], np.ndarray) and np.array_equal(client["hist"], state["hist"])
    assert client["hist"].dtype == np.float32
    assert client["odd"] == {"__path__": "not a path", "__tensor__": 1}


@pytest.mark.parametrize("stage,dtype", [(1, "fp32"), (2, "fp16"), (3, "bf16")])
def test_resume_restores_data_order_rng_and_loss_scale(pool, tmp_path, stage, dtype):
    """Dropout, a training_data loader whose epochs end mid-step, and (fp16) a loss scale that
    skips steps: resuming mid-epoch reproduces the uninterrupted run exactly."""
    steps, save_at = 7, 3
    whole = pool.run(ct.loader_run, 2, stage, dtype, steps, None, None, None)
    pool.run(ct.loader_run, 2, stage, dtype, save_at, save_at, None, str(tmp_path))
    resumed = pool.run(ct.loader_run, 2, stage, dtype, steps, None, str(tmp_path), None)
    for w, r in zip(whole, resumed):
        assert_same(r["params"], w["params"], "params")
        assert r["losses"] == w["losses"][-len(r["losses"]):]
        assert (r["skipped"], r["scale"]) == (w["skipped"], w["scale"])
    if dtype == "fp16":
        assert whole[0]["skipped"] > 0  # the scaler state mattered


SAVES = [(2, 1), (4, 2), (3, 3)]
LOADS = [(1, 0), (2, 3), (4, 1), (3, 2)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("save_world,save_stage", SAVES)
def test_reshard_to_any_world_size_and_stage(pool, tmp_path, save_world, save_stage, dtype):
    """Saved at (world, stage) and loaded at each of (1, 0), (2, 3), (4, 1), (3, 2): the loaded
    masters equal the saved ones exactly, and K more steps match a single-process run of all
    2K steps (global batch kept: gradient accumulation = 12 micro-batches / world size)."""
    saved = pool.run(ct.save_task, save_world, save_stage, dtype, K, str(tmp_path))[0]
    ref = {w: ct.reference(dtype, [(save_world, K), (w, K)]) for w in {w for w, _ in LOADS}}
    atol = 2e-6 if dtype == "fp32" else 1e-5
    assert_close(saved["masters"], ct.reference(dtype, [(save_world, K)])["masters"], atol, "before save")
    for world, stage in LOADS:
        out = pool.run(ct.resume_task, world, stage, dtype, str(tmp_path), K, 2 * K)
        for r in out:
            assert_same(r["loaded"]["masters"], saved["masters"], f"loaded at ({world}, {stage})")
            assert_close(r["masters"], ref[world]["masters"], atol, f"continued at ({world}, {stage})")
            assert r["norms"] == pytest.approx(ref[world]["norms"][K:], rel=1e-5)
            if dtype == "bf16":  # 16-bit parameters are the rounded masters
                for n, p in r["params"].items():
                    assert p.dtype == torch.bfloat16
                    if n in r["masters"]:
                        assert torch.equal(p, r["masters"][n].to(torch.bfloat16)), n


def test_reference_sees_what_it_should():
    """Guard: a change of world size with the global batch kept changes nothing in fp32, while
    the steps really move the parameters."""
    a = ct.reference("fp32", [(2, K), (3, K)])
    b = ct.reference("fp32", [(4, 2 * K)])
    start = ct.reference("fp32", [(1, 0)])
    assert_close(a["masters"], b["masters"], 2e-6, "world change")
    moved = max((a["masters"][n] - start["masters"][n]).abs().max().item() for n in start["masters"])
    assert moved > 1e-2


def test_index_describes_every_piece(pool, tmp_path):
    """The index maps each parameter to pieces that tile it exactly, and each rank wrote one file."""
    pool.run(ct.save_task, 3, 2, "bf16", 1, str(tmp_path))
    tag_dir = tmp_path / "global_step1"
    index = json.loads((tag_dir / "index.json").read_text())
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert sorted(p.name for p in tag_dir.iterdir()) == sorted(
        ["index.json"] + [f"rank{r:05d}.{ext}" for r in range(3) for ext in ("safetensors", "json")])
    assert index["world_size"] == 3 and index["zero_stage"] == 2 and index["compute_dtype"] == "bf16"
    assert index["aliases"] == {"head.weight": "emb.weight"}
    model = ct.build_model()
    for name, p in model.named_parameters():
        entry = index["params"][name]
        assert entry["shape"] == list(p.shape)
        covered = sorted((pc["start"], pc["stop"]) for pc in entry["pieces"])
        assert covered[0][0] == 0 and covered[-1][1] == p.numel()
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        if "frozen" in name:
            assert entry["param_group"] is None and entry["state_keys"] == []
        elif "branch" in name:  # unused in step 0: no optimizer state yet
            assert entry["param_group"] is not None and entry["state_keys"] == [] and entry["scalars"] is None
        else:
            assert entry["dtype"] == "float32" and set(entry["state_keys"]) == {"exp_avg", "exp_avg_sq"}
            assert entry["scalars"] == {"step": 1.0}


def test_each_rank_reads_its_share(pool, tmp_path):
    """Loading reads by byte range: 4 ranks at stage 3 each read about a quarter of what one
    rank at stage 0 reads (the whole checkpoint), not the whole."""
    pool.run(ct.bytes_read_task, 4, str(tmp_path), 2, True)
    files = sum(f.stat().st_size for f in (tmp_path / "global_step1").glob("*.safetensors"))
    whole = pool.run(ct.bytes_read_task, 1, str(tmp_path), 0, False)[0]["read"]
    shares = [r["read"] for r in pool.run(ct.bytes_read_task, 4, str(tmp_path), 3, False)]
    assert files * 0.95 < whole <= files * 1.05
    for share in shares:
        assert share < whole / 4 * 1.25, (share, whole)

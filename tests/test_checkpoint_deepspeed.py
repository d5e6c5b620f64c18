"""DeepSpeedSource against real DeepSpeed checkpoints.

``ds_checkpoint_writer.py`` trains the parity model with DeepSpeed (2 ranks, gloo, CPU) at
ZeRO stages 1-3 in fp32, bf16 and fp16, saves checkpoints and dumps DeepSpeed's own view of
them (full fp32 values and Adam moments gathered with ``safe_get_full_*``, counters, lr,
scheduler state). Every test here compares the reader with that dump, or checks that a
damaged or tampered checkpoint is refused with a message naming the problem.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ds_checkpoint_writer import CONFIGS

from zerodp.checkpoint import deepspeed as dsck
from zerodp.checkpoint import pickles
from zerodp.checkpoint.deepspeed import DeepSpeedSource, is_deepspeed_checkpoint
from zerodp.checkpoint.source import VALUE, CheckpointError, Read

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed: the checkpoints under test are written by it")

WRITER = Path(__file__).with_name("ds_checkpoint_writer.py")
NAMES = list(CONFIGS)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Path:
    """All of the writer's checkpoints, written once by one torchrun launch of 2 ranks."""
    out = tmp_path_factory.mktemp("deepspeed_ckpts")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WRITER), str(out)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the DeepSpeed checkpoint writer did not finish in {exc.timeout} s")
    if proc.returncode != 0:
        pytest.fail(f"the DeepSpeed checkpoint writer failed (rc {proc.returncode}):\n"
                    f"{(proc.stdout + proc.stderr)[-6000:]}")
    return out


def expected(ckpts: Path, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    meta = json.loads((ckpts / f"{name}.expect.json").read_text())
    return meta, load_file(str(ckpts / f"{name}.expect.safetensors"))


def tag_dir(ckpts: Path, name: str) -> Path:
    meta, _ = expected(ckpts, name)
    return ckpts / name / meta["tag"]


def read(src: DeepSpeedSource, name: str, kind: str, lo: int, hi: int, dtype=None) -> torch.Tensor:
    out = torch.full((hi - lo,), float("nan"), dtype=dtype or src.params[src.aliases.get(name, name)].dtype)
    src.read([Read(name, kind, lo, hi, out)])
    return out


# ----------------------------------------------------------------------------- values and state

@pytest.mark.parametrize("name", NAMES)
def test_full_values_and_moments_equal_deepspeeds(ckpts, name):
    meta, exp = expected(ckpts, name)
    with DeepSpeedSource(tag_dir(ckpts, name)) as src:
        assert list(src.params) == meta["names"]
        for pname in meta["trainable"]:
            info = src.params[pname]
            assert info.dtype == torch.float32 and info.param_group is not None
            assert info.state_keys == ("exp_avg", "exp_avg_sq")
            for kind in (VALUE, "exp_avg", "exp_avg_sq"):
                want = exp[f"{pname}/{kind}"].reshape(-1)
                got = read(src, pname, kind, 0, info.numel)
                assert want.dtype == torch.float32 and torch.equal(got, want), (pname, kind)
        assert any(exp[f"{p}/exp_avg"].abs().sum() > 0 for p in meta["trainable"])


@pytest.mark.parametrize("name", NAMES)
def test_sub_ranges_equal_slices_of_the_full_tensor(ckpts, name):
    """Ranges [3, 17), every single element, and every prefix/suffix split: between them they
    start and end on every element, so they cross every rank and sub-group boundary."""
    meta, exp = expected(ckpts, name)
    with DeepSpeedSource(tag_dir(ckpts, name)) as src:
        for pname, info in src.params.items():
            n = info.numel
            ranges = [(k, k + 1) for k in range(n)] + [(0, k) for k in range(n + 1)] + [(k, n) for k in range(n)]
            if n >= 17:
                ranges.append((3, 17))
            for kind in (VALUE,) + info.state_keys:
                full = exp[f"{pname}/{kind}"].reshape(-1).to(info.dtype)
                reads = [Read(pname, kind, lo, hi, torch.full((hi - lo,), float("nan"), dtype=info.dtype))
                         for lo, hi in ranges]
                src.read(reads)
                for rd in reads:
                    assert torch.equal(rd.out, full[rd.lo:rd.hi]), (pname, kind, rd.lo, rd.hi)
            if n >= 17:  # into another dtype: the stored numbers, cast
                got = read(src, pname, VALUE, 3, 17, dtype=torch.float64)
                assert torch.equal(got, exp[f"{pname}/value"].reshape(-1)[3:17].double())


@pytest.mark.parametrize("name, pname, inside, crossing", [
    # stage 1: param group 0 is emb.weight (66), l1.weight (42), l2.weight (42), branch.weight (36):
    # 186 elements, padded to 188, 94 per rank; l1.weight's elements 28.. live on rank 1
    ("z1_fp32", "l1.weight", (0, 20), (20, 40)),
    # stage 3: every parameter is split on its own, emb.weight (66) into 33 + 33
    ("z3_fp32", "emb.weight", (3, 17), (30, 40)),
])
def test_reads_open_only_the_ranks_they_need(ckpts, monkeypatch, name, pname, inside, crossing):
    _, exp = expected(ckpts, name)
    opened: list[str] = []
    real = dsck.load_pickle
    monkeypatch.setattr(dsck, "load_pickle", lambda path: (opened.append(path.name), real(path))[1])
    rank1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with DeepSpeedSource(tag_dir(ckpts, name)) as src:
        assert rank1 not in opened
        got = read(src, pname, "exp_avg", *inside)
        assert torch.equal(got, exp[f"{pname}/exp_avg"].reshape(-1)[slice(*inside)])
        assert rank1 not in opened
        got = read(src, pname, VALUE, *crossing)
        assert torch.equal(got, exp[f"{pname}/value"].reshape(-1)[slice(*crossing)])
        assert opened.count(rank1) == 1
        read(src, pname, "exp_avg_sq", *crossing)
        assert opened.count(rank1) == 1


@pytest.mark.parametrize("name", NAMES)
def test_metadata_equals_deepspeeds(ckpts, name):
    meta, exp = expected(ckpts, name)
    stage, dtype, gas, _, extra = CONFIGS[name]
    with DeepSpeedSource(tag_dir(ckpts, name)) as src:
        assert (src.kind, src.tag, src.world_size, src.zero_stage, src.compute_dtype) == \
            ("deepspeed", meta["tag"], 2, stage, dtype)
        assert src.path == tag_dir(ckpts, name)
        es = src.engine_state
        assert (es.global_steps, es.micro_steps, es.skipped_steps, es.global_samples) == \
            (meta["global_steps"], meta["global_steps"] * gas, meta["skipped_steps"], meta["global_samples"])
        assert src.lr_scheduler == meta["lr_scheduler"] and src.lr_scheduler["last_batch_iteration"] >= 1
        for pname in meta["trainable"]:
            assert src.scalar_state(pname) == {"step": meta["step"][0]}
        opt = src.optimizer
        assert opt.type == "AdamW"
        assert (opt.elementwise_keys, opt.scalar_keys) == (("exp_avg", "exp_avg_sq"), ("step",))
        assert len(opt.param_groups) == 2
        if "elastic_checkpoint" in json.dumps(extra):
            assert opt.param_groups == [{}, {}]  # DeepSpeed stores no hyperparameters then
        else:
            assert [g["lr"] for g in opt.param_groups] == meta["lr"]
            assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
            assert all(g["betas"] == [0.9, 0.99] and "params" not in g for g in opt.param_groups)
            json.dumps(opt.param_groups)
        cs = src.client_state
        assert set(cs) == {"note", "data_pos", "vec"}
        assert (cs["note"], cs["data_pos"]) == ("hello", 7) and torch.equal(cs["vec"], torch.arange(3.))
        assert src.rng_states is None
        assert src.buffer_names == tuple(meta["buffers"]) == ("norm.running",)
        buffers = src.read_buffers()
        assert set(buffers) == {"norm.running"}
        want = exp["buffer/norm.running"]
        assert buffers["norm.running"].dtype == want.dtype and torch.equal(buffers["norm.running"], want)
        if dtype == "fp16":
            assert src.loss_scaler is not None
        else:
            assert src.loss_scaler is None


@pytest.mark.parametrize("name", NAMES)
def test_tied_and_frozen_parameters(ckpts, name):
    meta, exp = expected(ckpts, name)
    stage, dtype, *_ = CONFIGS[name]
    stored = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    with DeepSpeedSource(tag_dir(ckpts, name)) as src:
        assert src.aliases == meta["tied"] == {"head.weight": "emb.weight"}
        assert "head.weight" not in src.params
        assert torch.equal(read(src, "head.weight", VALUE, 0, 66), read(src, "emb.weight", VALUE, 0, 66))
        assert meta["frozen"] == ["frozen.weight", "frozen.bias"]
        for pname in meta["frozen"]:
            info = src.params[pname]
            assert (info.param_group, info.state_keys, info.dtype) == (None, (), stored)
            want = exp[f"{pname}/value"].reshape(-1)
            assert want.dtype == stored
            assert torch.equal(read(src, pname, VALUE, 0, info.numel), want)
            assert torch.equal(read(src, pname, VALUE, 1, info.numel - 1, torch.float32), want[1:-1].float())
            assert src.scalar_state(pname) is None
            with pytest.raises(CheckpointError, match="exp_avg"):
                read(src, pname, "exp_avg", 0, 1, torch.float32)


def test_fp16_loss_scale_in_zerodps_format(ckpts):
    meta, _ = expected(ckpts, "z2_fp16")
    ds = meta["loss_scaler"]
    assert meta["skipped_steps"] >= 1 and ds["dynamic"]
    with DeepSpeedSource(tag_dir(ckpts, "z2_fp16")) as src:
        assert src.loss_scaler == {
            "scale": ds["cur_scale"], "hysteresis_left": ds["cur_hysteresis"],
            "good_steps": ds["cur_iter"] - ds["last_overflow_iter"] - 1, "overflows": meta["skipped_steps"]}
        assert src.loss_scaler["scale"] < 2.0 ** 16  # the overflows lowered it


def test_recognises_tag_directories(ckpts, tmp_path):
    for name in NAMES:
        assert is_deepspeed_checkpoint(tag_dir(ckpts, name))
        assert not is_deepspeed_checkpoint(ckpts / name)  # the save_dir holding `latest`
    assert not is_deepspeed_checkpoint(tmp_path)
    assert not is_deepspeed_checkpoint(tmp_path / "absent")
    with DeepSpeedSource(ckpts / "z2_fp32") as src:  # through `latest`
        assert src.path == tag_dir(ckpts, "z2_fp32")
    with pytest.raises(CheckpointError, match="not a DeepSpeed checkpoint"):
        DeepSpeedSource(tmp_path)


# ----------------------------------------------------------------------------- refusals

def copy_tag(ckpts: Path, name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name / "tag"
    shutil.copytree(tag_dir(ckpts, name), dst)
    return dst


@pytest.mark.parametrize("name, missing", [
    ("z1_fp32", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("z2_bf16", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("z3_fp32", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
    ("z3_bf16", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("z2_fp32", "mp_rank_00_model_states.pt"),
    ("z3_bf16", "zero_pp_rank_0_mp_rank_00_model_states.pt"),
])
def test_missing_rank_file(ckpts, tmp_path, name, missing):
    tag = copy_tag(ckpts, name, tmp_path)
    (tag / missing).unlink()
    with pytest.raises(CheckpointError, match="written by 2 ranks") as err:
        DeepSpeedSource(tag)
    assert str(tag / missing) in str(err.value) and "missing" in str(err.value)


def test_missing_all_optimizer_files(ckpts, tmp_path):
    tag = copy_tag(ckpts, "z1_fp32", tmp_path)
    for f in tag.glob("*optim_states.pt"):
        f.unlink()
    with pytest.raises(CheckpointError, match="ZeRO stage 1 and 2 ranks: the optimizer files are missing"):
        DeepSpeedSource(tag)


def test_truncated_files(ckpts, tmp_path):
    tag = copy_tag(ckpts, "z2_fp32", tmp_path)
    rank1 = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank1.write_bytes(rank1.read_bytes()[: rank1.stat().st_size // 2])
    with DeepSpeedSource(tag) as src:
        read(src, "emb.weight", VALUE, 0, 10)  # rank 0 only
        with pytest.raises(CheckpointError, match="truncated") as err:
            read(src, "branch.weight", VALUE, 0, 36)
        assert str(rank1) in str(err.value)
    model = tag / "mp_rank_00_model_states.pt"
    model.write_bytes(model.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated") as err:
        DeepSpeedSource(tag)
    assert str(model) in str(err.value)


def test_unsupported_layouts_are_named(ckpts, tmp_path):
    tag = copy_tag(ckpts, "z1_fp32", tmp_path)
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointError, match="model-parallel checkpoints .* are not supported"):
        DeepSpeedSource(tag)
    tag = copy_tag(ckpts, "z3_fp32", tmp_path / "stale")
    shutil.copy(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=r"ranks \[2\], but the checkpoint was written by 2 ranks"):
        DeepSpeedSource(tag)


SIDE_EFFECTS: list[str] = []


class Tampered:
    """An object whose unpickling runs code (``__setstate__``)."""

    def __init__(self) -> None:
        self.payload = 1

    def __setstate__(self, state: dict) -> None:
        SIDE_EFFECTS.append("setstate")
        self.__dict__.update(state)


def record(what: str) -> str:
    SIDE_EFFECTS.append(what)
    return what


class Reducer:
    """An object whose unpickling calls a function (``__reduce__``)."""

    def __reduce__(self):
        return (record, ("reduce",))


def test_disallowed_global_in_model_states_is_refused_unpickled(ckpts, tmp_path):
    tag = copy_tag(ckpts, "z1_fp32", tmp_path)
    path = tag / "mp_rank_00_model_states.pt"
    sd = dsck.load_pickle(path)
    sd["extra"] = Tampered()
    torch.save(sd, tmp_path / "tampered.pt")  # not over the file its tensors are mapped from
    os.replace(tmp_path / "tampered.pt", path)
    SIDE_EFFECTS.clear()
    with pytest.raises(CheckpointError) as err:
        DeepSpeedSource(tag)
    msg = str(err.value)
    assert str(path) in msg and f"{Tampered.__module__}.Tampered" in msg and "never unpickles" in msg
    assert SIDE_EFFECTS == []
    # the file does run code when unpickled in general (so the check above can fail)
    torch.load(path, weights_only=False)
    assert SIDE_EFFECTS == ["setstate"]
    SIDE_EFFECTS.clear()


def test_disallowed_global_in_a_rank_file_is_refused_when_read(ckpts, tmp_path):
    tag = copy_tag(ckpts, "z3_bf16", tmp_path)
    path = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"fp32_flat_groups": [torch.zeros(3)]}, "x": Reducer()}, path)
    SIDE_EFFECTS.clear()
    with DeepSpeedSource(tag) as src:
        _, exp = expected(ckpts, "z3_bf16")
        assert torch.equal(read(src, "emb.weight", VALUE, 0, 33), exp["emb.weight/value"].reshape(-1)[:33])
        with pytest.raises(CheckpointError) as err:
            read(src, "emb.weight", VALUE, 30, 40)
    msg = str(err.value)
    assert str(path) in msg and f"{record.__module__}.record" in msg and "never unpickles" in msg
    assert SIDE_EFFECTS == []
    torch.load(path, weights_only=False)
    assert SIDE_EFFECTS == ["reduce"]
    SIDE_EFFECTS.clear()


def test_allow_list_is_deepspeeds_types_only(ckpts):
    """Every global in the written files is torch's or on the allow-list, and the allow-list
    holds exactly the DeepSpeed types those files use."""
    used: set[str] = set()
    for name in NAMES:
        for f in tag_dir(ckpts, name).glob("*.pt"):
            used |= set(torch.serialization.get_unsafe_globals_in_checkpoint(str(f)))
    assert used <= set(pickles.ALLOWED_GLOBALS)
    assert used >= {"deepspeed.utils.tensor_fragment.fragment_address",
                    "deepspeed.runtime.zero.config.ZeroStageEnum",
                    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"}
    assert all(not c.__module__.startswith("deepspeed") for c in pickles.ALLOWED_GLOBALS.values())


# -- zerodp resumes DeepSpeed's training ---------------------------------------------------------

import ds_import_tasks as dit  # noqa: E402

MORE = 2
#: checkpoint -> (zerodp world size, zerodp stage): always another world size and stage
RESUME_AT = {"z1_fp32": (1, 3), "z1_bf16": (4, 2), "z2_fp32": (4, 3), "z2_bf16": (1, 1),
             "z3_fp32": (1, 2), "z3_bf16": (4, 0), "z1_bf16_fp32acc": (1, 3), "z2_fp32_elastic": (1, 0),
             "z2_fp16": (1, 2)}


@pytest.mark.parametrize("name", list(RESUME_AT))
def test_zerodp_resumes_deepspeed_training(pool, ckpts, name):
    """engine.load_checkpoint on DeepSpeed's checkpoint directory, at another world size and
    stage: parameters and Adam moments equal DeepSpeed's own (gathered by DeepSpeed), the step
    count, learning rate and client state carry over, and training goes on with parity to a
    single-process run over the same global batches (fp32: from the first step; 16-bit: from
    DeepSpeed's saved state, doing zerodp's 16-bit arithmetic)."""
    meta, want = expected(ckpts, name)
    stage, dtype, gas_ds, steps, _ = CONFIGS[name]
    world, zstage = RESUME_AT[name]
    assert (world, zstage) != (2, stage)
    out = pool.run(dit.resume_from_deepspeed, world, str(ckpts / name), zstage, dtype, gas_ds, MORE)
    r = out[0]
    assert r["path"].endswith(meta["tag"]) and r["client"]["note"] == "hello" and r["client"]["data_pos"] == 7
    assert torch.equal(r["client"]["vec"], torch.arange(3.0))
    loaded = r["loaded"]
    assert loaded["global_steps"] == meta["global_steps"]
    assert loaded["lr"] == pytest.approx(meta["lr"], rel=1e-12)
    for n in meta["trainable"]:
        assert torch.equal(loaded["masters"][n], want[f"{n}/value"]), n
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["states"][n][key], want[f"{n}/{key}"]), (n, key)
    for n in meta["frozen"]:
        assert torch.equal(loaded["params"][n], want[f"{n}/value"].to(loaded["params"][n].dtype)), n
    for b in meta["buffers"]:
        assert torch.equal(loaded["buffers"][b], want[f"buffer/{b}"].to(loaded["buffers"][b].dtype)), b
    if dtype == "fp16":
        assert loaded["loss_scale"] == meta["loss_scaler"]["cur_scale"]
        assert loaded["skipped"] == meta["skipped_steps"] > 0
        return
    if dtype == "fp32":
        ref = dit.reference("fp32", gas_ds, [(2, steps), (world, MORE)])
        assert_close_params(want, dit.reference("fp32", gas_ds, [(2, steps)]), meta["trainable"], 2e-6,
                            "DeepSpeed against the reference")
        atol = 2e-6
    else:
        start = {"values": {n: want[f"{n}/value"] for n in meta["names"]},
                 "exp_avg": {n: want[f"{n}/exp_avg"] for n in meta["trainable"]},
                 "exp_avg_sq": {n: want[f"{n}/exp_avg_sq"] for n in meta["trainable"]},
                 "step": meta["step"][0], "steps_done": meta["global_steps"]}
        ref = dit.reference(dtype, gas_ds, [(world, MORE)], start=start)
        atol = 1e-5
    for res in out:
        assert_close_params(res["masters"], ref, meta["trainable"], atol, f"continued at ({world}, {zstage})")
        assert res["norms"] == pytest.approx(ref["norms"][-MORE:], rel=1e-5)


def assert_close_params(got, ref, names, atol, what):
    for n in names:
        g = got[f"{n}/value"] if f"{n}/value" in got else got[n]
        err = (g.float() - ref["masters"][n]).abs().max().item()
        assert err <= atol, f"{what}: {n} max |diff| {err:.3g} > {atol}"

"""Optimizer offload to host memory and to disk (``zerodp/offload/``): the same numbers as
without offload and as one process, checkpoints that move between offload and none at another
world size, the host-memory check, and the config keys."""
from __future__ import annotations

import checkpoint_tasks as ct
import offload_tasks as ot
import pytest
import torch

import zerodp
from zerodp.config import ConfigError, load_config
from zerodp.offload import HostMemoryError, check_host_budget

K = 2


def assert_close(got: dict, want: dict, atol: float, what: str) -> None:
    assert got.keys() == want.keys()
    for n, w in want.items():
        err = (got[n].float() - w.float()).abs().max().item()
        assert err <= atol, f"{what}: {n} max |diff| {err:.3g} > {atol}"


ATOL = {"fp32": 2e-6, "bf16": 1e-5}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_gives_the_numbers_of_no_offload(pool, tmp_path, stage, dtype):
    """Two ranks, 2K steps with clipping and a warm-up schedule: CPU offload and disk offload
    (tiles of 40 elements, so the step walks many tiles through their files) give the masters,
    parameters and gradient norms of the same run without offload and of one process."""
    ref = ct.reference(dtype, [(2, 2 * K)])
    plain = pool.run(ot.train_task, 2, stage, dtype, 2 * K, {})
    runs = {"cpu": ot.zero_block("cpu"), "nvme": ot.zero_block("nvme", str(tmp_path), sub_group_size=40)}
    if stage == 3:
        runs["cpu+params"] = ot.zero_block("cpu", params=True)
        # the zero_optimization values of a config written elsewhere (axolotl's
        # zero3_bf16_cpuoffload_all.json): sub_group_size 0 (every parameter a tile), no prefetch
        runs["cpu+params, sub_group_size 0"] = dict(ot.zero_block("cpu", params=True), sub_group_size=0,
                                                   stage3_max_live_parameters=0, stage3_max_reuse_distance=0)
        runs["nvme+params"] = ot.zero_block("nvme", str(tmp_path), params=True, sub_group_size=40)
    for name, zero in runs.items():
        out = pool.run(ot.train_task, 2, stage, dtype, 2 * K, zero)
        for r, p in zip(out, plain):
            assert_close(r["masters"], p["masters"], ATOL[dtype], f"{name} vs no offload")
            assert_close(r["masters"], ref["masters"], ATOL[dtype], f"{name} vs one process")
            assert r["norms"] == pytest.approx(p["norms"], rel=1e-5)
            for n, v in r["params"].items():
                assert v.dtype == p["params"][n].dtype
                if n in r["masters"]:  # the parameters are the rounded masters
                    assert torch.equal(v, r["masters"][n].to(v.dtype)), n
        if name.startswith("nvme"):
            files = out[0]["swap_files"]
            assert files and all(f.endswith(".swp") for f in files)
            assert any(f.startswith("p") for f in files) == (name == "nvme+params")  # parameter shards
            assert not any(r["swap_left"] for r in out), "the swap directory outlived the engine"


MOVES = [  # (save world, stage, offload) -> (load world, stage, offload)
    ((2, 3, "nvme"), (3, 2, None)),
    ((3, 1, None), (2, 3, "cpu")),
    ((2, 2, "cpu"), (4, 1, "nvme")),
    ((3, 2, None), (2, 3, "nvme+params")),
]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("save,load", MOVES)
def test_checkpoints_move_between_offload_and_none_at_another_world_size(pool, tmp_path, save, load, dtype):
    """Saved with (or without) offload, loaded without (or with) it at another world size and
    stage: the loaded masters are the saved ones exactly, and K more steps match one process."""
    (sw, ss, so), (lw, ls, lo) = save, load
    ckpt = tmp_path / "ckpt"
    def block(off, where):
        kind = off.split("+")[0] if off else None
        return ot.zero_block(kind, str(tmp_path / where), params=bool(off and off.endswith("+params")))
    saved = pool.run(ot.train_task, sw, ss, dtype, K, block(so, "swap_a"), str(ckpt))[0]
    out = pool.run(ot.resume_task, lw, ls, dtype, block(lo, "swap_b"), str(ckpt), K, 2 * K)
    ref = ct.reference(dtype, [(sw, K), (lw, K)])
    for r in out:
        assert_close(r["loaded"]["masters"], saved["masters"], 0.0, "loaded")
        assert_close(r["masters"], ref["masters"], ATOL[dtype], "continued")
        assert r["norms"] == pytest.approx(ref["norms"][K:], rel=1e-5)


def test_async_save_with_states_on_disk(pool, tmp_path):
    """An asynchronous save reads the states from their files into the staging copy; loading it
    without offload gives the saved masters exactly."""
    zero = ot.zero_block("nvme", str(tmp_path / "swap"), sub_group_size=40)
    saved = pool.run(ot.train_task, 2, 2, "bf16", K, zero, str(tmp_path / "ckpt"), True)[0]
    out = pool.run(ot.resume_task, 2, 1, "bf16", {}, str(tmp_path / "ckpt"), K, K)
    assert_close(out[0]["loaded"]["masters"], saved["masters"], 0.0, "loaded")


# -- host memory ------------------------------------------------------------------------------

def test_host_budget_names_what_does_not_fit():
    check_host_budget({"fp32 master": 40 << 20}, pinned=True, available=1 << 30, ranks=2)
    with pytest.raises(HostMemoryError) as e:
        check_host_budget({"fp32 master": 400 << 20, "optimizer states (est.)": 800 << 20}, pinned=True,
                          available=1 << 30, ranks=2)
    text = str(e.value)
    assert "2.34 GiB" in text and "2 rank(s)" in text and "page-locked" in text and "1.00 GiB" in text


def test_engine_checks_host_memory_before_allocating(monkeypatch):
    """With too little host memory available, initialize fails with the check's message before
    it allocates the offloaded states."""
    monkeypatch.setattr("zerodp.offload.host.available_host_bytes", lambda: 1 << 20)
    model = torch.nn.Linear(256, 256)
    cfg = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(HostMemoryError, match="offload needs .* of host memory"):
        zerodp.initialize(model=model, config=cfg)


# -- config -----------------------------------------------------------------------------------

@pytest.mark.parametrize("zero,key", [
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "zero_optimization"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, "zero_optimization.offload_optimizer"),
    ({"stage": 2, "offload_optimizer": {"device": "gpu"}}, "zero_optimization.offload_optimizer.device"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "zero_optimization.offload_optimizer"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}},
     "zero_optimization.offload_param"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, "zero_optimization"),
    ({"stage": 3, "offload_param": {"device": "cpu"}}, "zero_optimization"),
])
def test_offload_keys_zerodp_does_not_honour_fail_by_name(zero, key):
    with pytest.raises(ConfigError) as e:
        load_config({"zero_optimization": zero})
    assert key in str(e.value)


def test_offload_block_of_a_config_written_elsewhere():
    """The zero_optimization block of axolotl's zero3_bf16_cpuoffload_all.json, less the "auto"
    values a Hugging Face trainer fills in before DeepSpeed reads them."""
    cfg = load_config({"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 0, "stage3_max_live_parameters": 0,
        "stage3_max_reuse_distance": 0, "stage3_gather_16bit_weights_on_model_save": True}})
    z = cfg.zero_optimization
    got = (z.optimizer_offload, z.param_offload, z.sub_group_size, z.stage3_max_live_parameters)
    assert got == ("cpu", "cpu", 0, 0)


def test_offload_config_keys():
    cfg = load_config({"zero_optimization": {"stage": 3, "cpu_offload": True}})
    assert cfg.zero_optimization.optimizer_offload == "cpu"
    cfg = load_config({"zero_optimization": {"stage": 3, "sub_group_size": 1e6,
                                             "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x",
                                                                   "buffer_count": 5, "pipeline_read": True},
                                             "offload_param": {"device": "cpu", "pin_memory": True}},
                       "aio": {"block_size": 262144, "queue_depth": 4}})
    z = cfg.zero_optimization
    assert (z.optimizer_offload, z.param_offload, z.sub_group_size) == ("nvme", "cpu", 1_000_000)
    assert (cfg.aio.block_size, cfg.aio.queue_depth) == (262144, 4)
    with pytest.raises(ConfigError, match="aio.use_gds"):
        load_config({"aio": {"use_gds": True}})


# -- memory under a cap ---------------------------------------------------------------------------

@pytest.mark.parametrize("setting,times,layers", [("disk", 5, 160), ("disk+params", 8, 256)])
def test_disk_offload_trains_a_model_several_times_the_cap(tmp_path, setting, times, layers):
    """160 bias-free 512 x 512 layers (41.9M parameters; model states 16 bytes each, 640 MiB)
    train at stage 3 in bf16 on two ranks with the optimizer on disk, under a per-rank cap of a
    fifth of that; 256 layers (1 GiB) under an eighth with the parameter shards on disk too
    (measured: 110 of 128 and 99-101 of 128 MiB; with 128 and 192 layers the fixed overhead
    left too thin a margin: 93 of 102 and 80-97 of 96 MiB): the peak resident memory
    over the process's start (glibc returning freed memory: MALLOC_MMAP_THRESHOLD_) and the
    ledger's resident bytes both stay under the cap, while stage 3 alone would hold several
    times the cap per rank."""
    import json
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.join(here, "offload_memory_worker.py"), str(tmp_path / "swap"), str(layers),
                           setting],
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    r = json.loads(lines[-1][len("RESULT "):])
    mem, cap = r["memory"], r["model_states"] // times
    rss = r["rss_peak"] - r["rss_before"]
    ledger = (mem["model_states_on_compute"] + mem["model_states_on_host"] + mem["offload_buffers"]
              + mem["offload_tiles_peak"] + mem["gathered_parameters_peak"] + mem["gradient_buckets_peak"])
    assert mem["model_states"] > 2 * cap  # this rank's share at stage 3 without offload
    on_disk = mem["master_weights"] + mem["optimizer_states"] + (mem["parameters"] if "params" in setting else 0)
    assert mem["model_states_on_disk"] == on_disk > cap
    assert ledger <= cap, f"ledger {ledger / 2**20:.1f} MiB > cap {cap / 2**20:.1f} MiB"
    assert rss <= cap, f"peak RSS {rss / 2**20:.1f} MiB over start > cap {cap / 2**20:.1f} MiB"
    assert mem["offload_tiles_peak"] <= 3 * 12 * 512 * 512 // 2  # three tiles of master + Adam


@pytest.mark.parametrize("flags,where", [(["--preset", "zero3_offload"], "model_states_on_host"),
                                         (["--preset", "zero2", "--nvme-path", None], "model_states_on_disk")])
def test_train_with_offload(tmp_path, capsys, flags, where):
    """``zerodp train --preset zero3_offload`` and ``--nvme-path DIR`` train, and the summary's
    memory table puts the optimizer's bytes on the host or the disk."""
    import json

    from zerodp import cli
    flags = [str(tmp_path / "swap") if f is None else f for f in flags]
    code = cli.main(["train", "--nproc", "1", "--model", "tiny", "--steps", "2", "--micro-batch", "2",
                     "--eval-every", "0", "--max-bytes", "20000", "--out", str(tmp_path), *flags])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "summary.json").read_text())
    m = summary["memory_bytes"][0]
    optimizer = m["master_weights"] + m["optimizer_states"]
    if where == "model_states_on_host":  # stage 3: the parameter shards are on the host too
        assert m[where] == m["parameters"] + optimizer and m["model_states_on_compute"] == m["gradients"]
    else:
        assert m[where] == optimizer and m["model_states_on_compute"] == m["parameters"] + m["gradients"]
    assert optimizer > 0
    assert len(summary["losses"]) == 2


@pytest.mark.parametrize("stage,params", [(2, False), (3, True)])
def test_estimate_offload_rows_agree_with_the_ledger(tmp_path, stage, params):
    """``zerodp.estimate``'s offload row for this model (bf16, one rank) holds on the CPU what the
    engine's ledger puts on the host (master + Adam states, and at stage 3 with parameter
    offload the 16-bit parameter shard), and on the device what the ledger puts there, within
    the padding of the flat groups."""
    from zerodp.examples.gpt import build_gpt
    torch.manual_seed(0)
    model = build_gpt("tiny")
    est = zerodp.estimate(build_gpt("tiny"), precision="bf16")
    row = est.row(stage, "optimizer+params" if params else "optimizer")
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if params:
        zero["offload_param"] = {"device": "cpu"}
    engine, *_ = zerodp.initialize(model=model, config={
        "train_batch_size": 2, "bf16": {"enabled": True}, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    x = torch.randint(0, 256, (2, 16))
    _, loss = engine(x, torch.roll(x, -1, 1))
    engine.backward(loss)
    engine.step()
    mem = engine.memory_breakdown()
    engine.destroy()
    slack = 64 * len(engine.flat_groups)  # padding: under 16 bytes per shard per group and array
    assert abs(mem["model_states_on_host"] - row.cpu) <= slack, (mem["model_states_on_host"], row.cpu)
    on_device = row.parameters + row.gradients + row.master_weights + row.optimizer_states
    assert abs(mem["model_states_on_compute"] - on_device) <= slack, (mem["model_states_on_compute"], on_device)

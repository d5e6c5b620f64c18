"""DeepSpeed's CIFAR example with its mixture-of-experts flags (``--moe --ep-world-size
--num-experts --top-k --min-capacity --mlp-type residual --moe-param-group``) runs ported to zerodp
and gives DeepSpeed's own losses: the unported script runs under DeepSpeed (on CPU, 4 ranks) and the
ported one under zerodp, on the same seed. DeepSpeed refuses its MoE layer at ZeRO stage 3; zerodp
runs it there too, and the numbers do not depend on the stage or the expert-parallel size (the gates
decide on each rank's own tokens), so zerodp's stage-3 and ep-4 runs are held to DeepSpeed's.

The runs held to DeepSpeed's use gates whose result does not depend on random draws (top-1 with
room for every token: Random Token Selection then chooses among no surplus). Gates that sample (the
top-2 second expert, noise, token selection under a tight capacity) draw from torch's global RNG,
and the scripts' RNG streams part at the data loader: DeepSpeed's draws a seed from the global RNG
each epoch, zerodp's from a generator of its own (so that a resumed run draws what an uninterrupted
one does). Those gates are held to DeepSpeed's layer in ``test_moe_layer.py``, draw for draw, and
here the sampled top-2 runs are held to each other across stages and expert-parallel sizes."""
from __future__ import annotations

import json
import math

import pytest
from test_deepspeed_scripts import SCRIPTS, launch, ported

WORLD, MICRO = 4, 8
TOP2 = ["--moe", "--num-experts", "4", "--top-k", "2"]
TOP1 = ["--moe", "--num-experts", "4", "4", "--top-k", "1", "--min-capacity", str(MICRO), "--mlp-type", "residual",
        "--moe-param-group"]
RSAMPLE = ["--moe", "--num-experts", "2", "--top-k", "1", "--noisy-gate-policy", "RSample", "--moe-param-group",
           "--ep-world-size", "2"]
#: name -> (ZeRO stage, script flags, the run it must equal: DeepSpeed's for top-1, zerodp's for top-2)
RUNS = {
    "z0-ep2-top1": (0, TOP1 + ["--ep-world-size", "2"], "z0-ep2-top1"),
    "z2-ep2-top1": (2, TOP1 + ["--ep-world-size", "2"], "z2-ep2-top1"),
    "z3-ep4-top1": (3, TOP1 + ["--ep-world-size", "4"], "z2-ep2-top1"),
    "z1-ep4-top1": (1, TOP1 + ["--ep-world-size", "4"], "z0-ep2-top1"),
    "z0-ep2-top2": (0, TOP2 + ["--ep-world-size", "2"], "z3-ep4-top2"),
    "z3-ep4-top2": (3, TOP2 + ["--ep-world-size", "4"], "z0-ep2-top2"),
    "plain-z1": (1, ["--top-k", "1"], "plain-z1"),  # the CNN alone, its config without gradient_clipping
    # the example's run_ds_moe.sh flags (noise on the gate), in fp16, the example's default dtype, and in fp32:
    # zerodp's runs, held to each other to fp16's precision
    "fp16-z2-ep2-rsample": (2, RSAMPLE, "fp32-z2-ep2-rsample"),
    "fp32-z2-ep2-rsample": (2, RSAMPLE, "fp16-z2-ep2-rsample"),
}
DEEPSPEED_RUNS = ("z0-ep2-top1", "z2-ep2-top1", "plain-z1")


def _config(stage: int, name: str) -> dict:
    if name.startswith("fp"):
        return {"train_batch_size": MICRO * WORLD, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
                "gradient_clipping": 1.0, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
                "fp16": {"enabled": name.startswith("fp16"), "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 2,
                         "loss_scale_window": 500, "min_loss_scale": 1},
                "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}}
    if name.startswith("plain"):  # no MoE, no gradient_clipping: both clip at the default, 1.0
        return {"train_batch_size": MICRO * WORLD, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
                "zero_optimization": {"stage": stage}}
    # with MoE layers, clipping off: DeepSpeed's norm then averages the ranks' expert-gradient norms
    # instead of adding their squares (zerodp's is the global norm of one process)
    return {"train_batch_size": MICRO * WORLD, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage}}


def _run(script, folder, names, **env) -> dict:
    runs = []
    for name in names:
        stage, flags, _ = RUNS[name]
        cfg = folder / f"{name}.json"
        cfg.write_text(json.dumps(_config(stage, name)))
        runs.append(["--deepspeed_config", str(cfg), "--epochs", "1", *flags, "--out", str(folder / f"{name}.out")])
    launch(script, runs, folder, world=WORLD, **env)
    return {n: json.loads((folder / f"{n}.out").read_text()) for n in names}


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    ours = tmp_path_factory.mktemp("cifar-moe-zerodp")
    theirs = tmp_path_factory.mktemp("cifar-moe-deepspeed")
    got = _run(ported("cifar_cnn.py", ours), ours, list(RUNS))
    want = _run(SCRIPTS / "cifar_cnn.py", theirs, DEEPSPEED_RUNS, DS_ACCELERATOR="cpu")
    return got, want


def test_cifar_moe_flags_give_deepspeeds_losses(moe_runs):
    got, want = moe_runs
    for name, (_, flags, reference) in RUNS.items():
        a = got[name]["losses"]
        if name.startswith("fp"):  # fp16 against fp32, zerodp's both
            b = got[reference]["losses"]
            assert got[name]["fp16"] == name.startswith("fp16") and all(math.isfinite(x) for x in a), name
            assert all(math.isclose(x, y, rel_tol=0.02) for x, y in zip(a, b)), (name, a, b)
            continue
        b = (want if "1" in flags[flags.index("--top-k") + 1] else got)[reference]["losses"]
        assert len(a) == len(b) == 256 // (MICRO * WORLD), name
        assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a, b)), (name, reference, a, b)
        assert got[name]["accuracy"] > 0.2, name  # 10 classes: chance is 0.1
    assert not math.isclose(got["z0-ep2-top1"]["losses"][-1], got["z0-ep2-top2"]["losses"][-1], rel_tol=1e-3)
    # the plain CNN's gradient norm passes 1.0 in its last steps: both clipped it, by default
    assert got["plain-z1"]["losses"] == pytest.approx(want["plain-z1"]["losses"], rel=1e-5)

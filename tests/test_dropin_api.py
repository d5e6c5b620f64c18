"""DeepSpeed's everyday names, as a ported script (``import zerodp as deepspeed``) reaches them:
module-level functions, ``zerodp.accelerator``, ``zerodp.comm``, ``zerodp.zero``,
``zerodp.utils``, ``zerodp.checkpointing``, ``zerodp.ops.adam``, the engine's queries, and the
names zerodp refuses."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import dropin_tasks as dt
import pytest
import torch
from torch import nn

import zerodp

SRC = str(Path(__file__).resolve().parent.parent / "src")


# -- module-level names ------------------------------------------------------------------------

def test_add_config_arguments_and_initialize_args(tmp_path):
    """The getting-started command line: --deepspeed --deepspeed_config PATH (and zerodp's own
    spelling); initialize(args=...) reads the config from it."""
    parser = zerodp.add_config_arguments(argparse.ArgumentParser())
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}))
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(cfg)])
    assert args.deepspeed and args.deepspeed_config == str(cfg)
    assert parser.parse_args(["--zerodp_config", "x.json"]).zerodp_config == "x.json"
    assert parser.parse_args(["--deepscale_config", "y.json"]).deepscale_config == "y.json"
    model = nn.Linear(3, 2)
    engine, opt, loader, _ = zerodp.initialize(args=args, model=model, model_parameters=model.parameters())
    try:
        assert engine.train_batch_size() == 4 and opt.param_groups[0]["lr"] == 0.5 and loader is None
        assert isinstance(engine, zerodp.DeepSpeedEngine)
    finally:
        engine.destroy()


def test_accelerator_on_cpu():
    acc = zerodp.accelerator.get_accelerator()
    assert acc is zerodp.accelerator.get_accelerator()
    assert acc.device_name() == "cpu" and acc.device_name(0) == "cpu" and acc.current_device_name() == "cpu"
    assert acc.current_device() == 0 and acc.device_count() >= 1
    assert acc.is_available() and acc.communication_backend_name() == "gloo"
    assert acc.is_bf16_supported() and acc.is_fp16_supported() in (True, False)
    acc.set_device(0)
    acc.synchronize()
    acc.empty_cache()
    acc.manual_seed(123)
    a = torch.rand(3)
    acc.manual_seed(123)
    assert torch.equal(a, torch.rand(3))
    assert torch.device(acc.device_name()) == torch.device("cpu")


def test_comm_collectives_on_two_ranks(pool):
    out = pool.run(dt.comm_calls, 2)
    for rank, r in enumerate(out):
        assert (r["rank"], r["world"], r["initialized"], r["backend"]) == (rank, 2, True, "gloo")
        assert r["all_reduce"] == 3.0 and r["broadcast"] == 10.0 and r["all_gather"] == [0.0, 1.0]


@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (1, "bf16"), (2, "fp16"), (3, "bf16")])
def test_engine_queries(pool, stage, precision):
    out = pool.run(dt.engine_queries, 2, stage, precision)
    for rank, r in enumerate(out):
        assert (r["fp16"], r["bf16"]) == (precision == "fp16", precision == "bf16")
        assert (r["stage"], r["world_size"], r["global_rank"], r["device"]) == (stage, 2, rank, "cpu")
        assert r["module_is_model"] and r["optimizer_is"] and r["scheduler_is"]
        assert (r["gas"], r["micro"], r["train_batch_size"]) == (3, 2, 12)
        assert r["norm_before"] is None and r["norm"] > 0
        assert r["eval_mode"] == (True, True) and r["train_mode"] == (True, True)
        # 6 micro-steps at accumulation 3: updates at the 3rd and 6th
        assert r["applied"] == [False, False, True, False, False, True] or precision == "fp16"
        assert r["global_steps"] == 2 and r["global_samples"] == 24
        assert 0 < r["lr"][0] < 0.01  # WarmupLR moved it


def test_comm_init_distributed_alone_and_log_summary():
    """A script run without a launcher: init_distributed makes a group of one; log_summary
    prints the engine's traffic."""
    code = ("import zerodp as deepspeed, torch\n"
            "deepspeed.init_distributed()\n"
            "import zerodp.comm as dist\n"
            "assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0\n"
            "m = torch.nn.Linear(4, 2)\n"
            "e, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config={'train_batch_size': 2,"
            " 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}, 'zero_optimization': {'stage': 1}})\n"
            "e.backward(e(torch.ones(2, 4)).sum()); e.step()\n"
            "dist.log_summary()\n"
            "import sys; print('deepspeed' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert "ZeRO stage 1" in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "False"  # zerodp never imports or provides `deepspeed`


def test_no_deepspeed_module_is_shadowed():
    """zerodp installs no module named ``deepspeed``: none in its source tree, and where ``import
    deepspeed`` finds one (the test extra installs the real DeepSpeed), it is the file of the
    ``deepspeed`` distribution, outside zerodp's tree, whatever the paths are named (a clone in a
    directory named ``zerodp`` with its virtual environment inside it, say)."""
    import importlib.metadata
    import importlib.util
    root = Path(SRC)
    assert not (root / "deepspeed").exists() and not (root / "deepspeed.py").exists()
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        return
    origin = Path(spec.origin).resolve()
    assert not origin.is_relative_to(root.resolve()), origin
    assert not origin.is_relative_to(Path(zerodp.__file__).resolve().parent), origin
    dist = importlib.metadata.distribution("deepspeed")
    assert dist.metadata["Name"].lower() == "deepspeed"
    assert origin in {Path(dist.locate_file(f)).resolve() for f in dist.files or []}, origin


# -- names zerodp refuses ----------------------------------------------------------------------

def test_unsupported_names_say_so():
    # real scripts import these whether or not they use them: the import works, any use raises
    # naming the feature
    scope: dict = {}
    exec("from zerodp.compression.compress import init_compression\n"
         "import zerodp.compression.helper", scope)
    with pytest.raises(NotImplementedError, match="model compression"):
        scope["init_compression"](None, "ds_config.json")
    with pytest.raises(NotImplementedError, match=r"zerodp\.compression\.helper\.convert_conv1d_to_linear: "
                       ".*model compression"):
        scope["zerodp"].compression.helper.convert_conv1d_to_linear(None, None)
    with pytest.raises(NotImplementedError, match="inference engine"):
        _ = zerodp.init_inference
    with pytest.raises(AttributeError):
        _ = zerodp.init_inference
    assert not hasattr(zerodp, "InferenceEngine")
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = zerodp.no_such_name
    m = nn.Linear(2, 2)  # an mpu is taken now (tensor parallelism), but it must keep DeepSpeed's contract
    with pytest.raises(ValueError, match=r"mpu: the object passed has no get_data_parallel_group\(\)"):
        zerodp.initialize(model=m, config={"train_batch_size": 1}, mpu=object())


# -- zero.Init, GatheredParameters, leaf modules -----------------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(4))


def _is_slice(p) -> bool:
    """A parameter as DeepSpeed's ``zero.Init`` leaves it: empty data on the real device, the shape
    in ``ds_shape``."""
    return p.device.type == "cpu" and p.shape == (0,) and p.numel() == 0 and hasattr(p, "ds_shape")


def test_zero_init_builds_without_storage():
    with zerodp.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}, remote_device="cpu"):
        m = nn.Sequential(Block(), Block())
    assert all(_is_slice(p) for p in m.parameters())
    assert [tuple(p.ds_shape) for p in m.parameters()] == [(4, 4), (4,)] * 2
    assert all(not b.is_meta and b.sum().item() == 4 for b in m.buffers())  # buffers keep values
    with zerodp.zero.Init(enabled=False):
        real = Block()
    assert not any(_is_slice(p) or p.is_meta for p in real.parameters())
    # outside the context, construction is normal again
    assert not any(_is_slice(p) or p.is_meta for p in Block().parameters())
    # a value put in place of a parameter without data (one built on the meta device) is kept
    with zerodp.zero.Init():
        with torch.device("meta"):
            b = Block()
        b.fc.weight = nn.Parameter(torch.full((4, 4), 2.0))
    assert not b.fc.weight.is_meta and b.fc.weight.sum().item() == 32 and b.fc.bias.is_meta


def test_zero_init_keeps_values_readable_and_writable_whole():
    """Each parameter built in Init keeps (here, a group of one) its values, which
    GatheredParameters shows whole and, with modifier_rank, takes back."""
    torch.manual_seed(0)
    want = Block()
    torch.manual_seed(0)
    with zerodp.zero.Init():
        b = Block()
    assert _is_slice(b.fc.weight) and b.fc.weight.ds_shape == (4, 4) and b.fc.weight.ds_numel == 16
    with zerodp.zero.GatheredParameters([b.fc.weight, None, b.fc.bias]):
        assert torch.equal(b.fc.weight, want.fc.weight) and torch.equal(b.fc.bias, want.fc.bias)
        with torch.no_grad():
            b.fc.weight.fill_(5.0)  # dropped: no modifier_rank
    with zerodp.zero.GatheredParameters(p for p in b.parameters()):
        assert torch.equal(b.fc.weight, want.fc.weight)
    with zerodp.zero.GatheredParameters(b.fc.weight, modifier_rank=0):
        with torch.no_grad():
            b.fc.weight.fill_(3.0)
    assert _is_slice(b.fc.weight)
    with zerodp.zero.GatheredParameters(b.fc.weight):
        assert b.fc.weight.sum().item() == 48
    # meta=True: parameters keep no values at all (no slice), buffers stay real
    from zerodp.core.init_shards import init_shard
    with zerodp.zero.Init(meta=True):
        bare = Block()
    assert bare.fc.weight.is_meta and init_shard(bare.fc.weight) is None and bare.mask.sum().item() == 4
    with zerodp.zero.Init():
        kept = Block()
    assert _is_slice(kept.fc.weight) and init_shard(kept.fc.weight).data.numel() == 16
    with pytest.raises(ValueError, match=r"on the meta device hold no values \(shapes \(4, 4\)\)"):
        with zerodp.zero.GatheredParameters(bare.fc.weight, modifier_rank=0):
            pass
    assert zerodp.zero.GatheredParameters is zerodp.GatheredParameters
    assert callable(zerodp.zero.register_external_parameter)


def test_set_z3_leaf_modules():
    from zerodp.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
    m = nn.Sequential(Block(), nn.Linear(4, 4), Block())
    marked = set_z3_leaf_modules(m, [Block])
    assert len(marked) == 2 and all(z3_leaf_module(b) for b in marked)
    assert get_z3_leaf_modules(m) == marked
    unset_z3_leaf_modules(m, ["Block"])
    assert get_z3_leaf_modules(m) == []
    with pytest.raises(ValueError, match="no module"):
        set_z3_leaf_modules(m, [nn.Conv2d])


# -- checkpointing, ops.adam -------------------------------------------------------------------

def test_activation_checkpointing_gives_the_same_gradients():
    from zerodp import checkpointing
    checkpointing.configure(None, partition_activations=False)
    assert checkpointing.is_configured()
    torch.manual_seed(0)
    f = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    x = torch.randn(3, 6)
    f(x).sum().backward()
    want = [p.grad.clone() for p in f.parameters()]
    f.zero_grad()
    checkpointing.checkpoint(f, x).sum().backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(f.parameters(), want))


@pytest.mark.parametrize("name", ["FusedAdam", "DeepSpeedCPUAdam"])
def test_ops_adam_equals_torch_adamw(name):
    from zerodp.ops import adam
    torch.manual_seed(0)
    p1 = nn.Parameter(torch.randn(50))
    p2 = nn.Parameter(p1.detach().clone())
    opt = getattr(adam, name)([p1], lr=0.01, weight_decay=0.1, betas=(0.8, 0.99))
    ref = torch.optim.AdamW([p2], lr=0.01, weight_decay=0.1, betas=(0.8, 0.99))
    for step in range(5):
        g = torch.randn(50, generator=torch.Generator().manual_seed(step))
        p1.grad, p2.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert torch.allclose(p1, p2, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="bias_correction"):
        getattr(adam, name)([p1], bias_correction=False)


def test_ops_adam_as_client_optimizer():
    """FusedAdam built on the model, handed to initialize (the way DeepSpeed scripts do)."""
    from zerodp.ops.adam import FusedAdam
    m = nn.Linear(3, 2)
    opt = FusedAdam(m.parameters(), lr=0.1)
    engine, got, _, _ = zerodp.initialize(model=m, optimizer=opt, config={"train_batch_size": 1,
                                                                      "zero_optimization": {"stage": 2}})
    try:
        before = m.weight.detach().clone()
        engine.backward(engine(torch.ones(1, 3)).sum())
        engine.step()
        assert got is opt and not torch.equal(before, m.weight)
    finally:
        engine.destroy()


# -- small things a new user meets -------------------------------------------------------------

def test_bad_optimizer_value_names_the_config_key():
    """Through initialize (the table of cases is test_config.py's malformed-config test)."""
    m = nn.Linear(3, 2)
    for params, key in (({"lr": -1}, "lr"), ({"lr": "fast"}, "lr"), ({"betas": [0.9]}, "betas")):
        with pytest.raises(zerodp.ConfigError, match=rf"^optimizer\.params\.{key}: got "):
            zerodp.initialize(model=m, config={"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": params}})


def test_batch_size_from_a_dataloader_passed_as_training_data():
    """No batch size in the config is refused (as DeepSpeed refuses it), unless training_data is
    a DataLoader: its batch_size is then the micro-batch, and it is returned as it is."""
    data = torch.utils.data.TensorDataset(torch.randn(12, 3), torch.randn(12, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    engine, _, got, _ = zerodp.initialize(model=nn.Linear(3, 2), config={"optimizer": sgd}, training_data=loader)
    try:
        assert got is loader and engine.training_dataloader is loader
        assert (engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()) == (4, 4)
        x, y = next(iter(got))
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        assert engine.global_steps == 1
    finally:
        engine.destroy()
    with pytest.raises(zerodp.ConfigError, match=r"train_micro_batch_size_per_gpu: the config gives 2.*batches of 4"):
        zerodp.initialize(model=nn.Linear(3, 2), training_data=loader,
                          config={"train_micro_batch_size_per_gpu": 2, "optimizer": sgd})
    with pytest.raises(zerodp.ConfigError, match="train_batch_size, train_micro_batch_size_per_gpu"):
        zerodp.initialize(model=nn.Linear(3, 2), config={"optimizer": sgd}, training_data=data)
    with pytest.raises(zerodp.ConfigError, match="train_batch_size, train_micro_batch_size_per_gpu"):
        zerodp.initialize(model=nn.Linear(3, 2), preset="zero1")


def test_numpy_is_a_dependency():
    import tomllib
    deps = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps)
    r = subprocess.run([sys.executable, "-c", "import zerodp, torch; torch.zeros(2).numpy()"],
                       capture_output=True, text=True, timeout=120, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "Failed to initialize NumPy" not in r.stderr, r.stderr


def test_ops_adagrad_and_lion():
    """DeepSpeedCPUAdagrad is torch's Adagrad; Lion follows its published update, worked by hand:
    p = 1, lr 0.1, betas (0.9, 0.99): g = 0.5 -> sign(0.05) = 1, p = 0.9, m = 0.005; g = -1 ->
    sign(0.9 * 0.005 - 0.1) = -1, p = 1.0, m = 0.99 * 0.005 - 0.01 = -0.00505. Both run under an
    engine from a config ("type": "Lion") and equal the optimizer alone."""
    from zerodp.ops.adagrad import DeepSpeedCPUAdagrad
    from zerodp.ops.lion import DeepSpeedCPULion, FusedLion
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(6))
    b = nn.Parameter(a.detach().clone())
    ours, theirs = DeepSpeedCPUAdagrad([a], lr=0.1), torch.optim.Adagrad([b], lr=0.1)
    for _ in range(3):
        for p, opt in ((a, ours), (b, theirs)):
            p.grad = torch.arange(6.0) - 2
            opt.step()
    assert torch.equal(a, b)
    p = nn.Parameter(torch.tensor([1.0]))
    lion = DeepSpeedCPULion([p], lr=0.1, betas=(0.9, 0.99))
    p.grad = torch.tensor([0.5])
    lion.step()
    assert torch.allclose(p, torch.tensor([0.9])) and torch.allclose(lion.state[p]["exp_avg"], torch.tensor([0.005]))
    p.grad = torch.tensor([-1.0])
    lion.step()
    assert torch.allclose(p, torch.tensor([1.0])) and torch.allclose(lion.state[p]["exp_avg"], torch.tensor([-0.00505]))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ref = nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    engine, *_ = zerodp.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Lion", "params": {"lr": 0.01, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 2}})
    ref_opt = FusedLion(ref.parameters(), lr=0.01, weight_decay=0.1, betas=(0.9, 0.99))
    for step in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(torch.allclose(p, r) for p, r in zip(engine.module.parameters(), ref.parameters()))


def test_engine_compile_as_deepspeed_and_accelerate_call_it():
    """engine.compile(backend=, compile_kwargs=) runs the model compiled, with the same numbers; a
    backend inside compile_kwargs gives way to the argument, and DeepCompile's schedule is warned
    about, as DeepSpeed does. (torch.compile reads ``__file__`` of every module
    imported, the refused ones such as ``zerodp.compression`` included.)"""
    import zerodp.compression  # noqa: F401
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
    x = torch.randn(3, 4)
    want = model(x).detach()
    engine, *_ = zerodp.initialize(model=model, config={"train_micro_batch_size_per_gpu": 3, "optimizer": {
        "type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2}})
    assert not engine.is_compiled
    graphs = []

    def counting_backend(gm, example_inputs):  # a torch.compile backend that runs the graph as traced
        graphs.append(gm)
        return gm.forward

    with pytest.warns(UserWarning) as caught:
        engine.compile(backend=counting_backend, compile_kwargs={"dynamic": False, "backend": "inductor"},
                       schedule=[(0, ["prefetch"])])
    said = " ".join(str(w.message) for w in caught)
    assert "gives way to the backend argument" in said and "schedule" in said
    assert engine.is_compiled and engine.module._orig_mod is model
    assert torch.allclose(engine(x), want)
    assert graphs  # the forward ran through torch.compile
    engine.backward(engine(x).sum())
    engine.step()


def test_optimizer_overflow_says_whether_the_fp16_step_was_skipped():
    """``optimizer.overflow`` (DeepSpeed's; Accelerate reads it as "step skipped") is True after an
    fp16 step skipped for overflow and False after one applied."""
    torch.manual_seed(0)
    engine, optimizer, *_ = zerodp.initialize(model=nn.Linear(4, 1), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "fp16": {"enabled": True, "initial_scale_power": 40, "hysteresis": 1}})
    assert optimizer.overflow is False
    seen = []
    for step in range(40):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step)).half()
        engine.backward(engine(x).float().pow(2).mean() * 1e3)
        engine.step()
        seen.append((optimizer.overflow, engine.was_step_applied()))
        if engine.was_step_applied():
            break
    assert seen[0] == (True, False) and seen[-1] == (False, True)
    assert all(o != a for o, a in seen)

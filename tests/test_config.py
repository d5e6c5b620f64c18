import json
import warnings

import pytest

from zerodp.config import (
    PRESETS,
    Config,
    ConfigError,
    ZeroConfig,
    describe_fields,
    get_preset,
    load_config,
    resolve_batch_sizes,
)
from zerodp.optim.build import optimizer_from_config


def load_quietly(config=None, preset=None):
    """load_config that fails the test if any warning is emitted."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_config(config, preset=preset)


# ---------------------------------------------------------------- presets and loading

@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3"])
def test_every_preset_loads(name):
    cfg = load_quietly(preset=name)
    assert cfg.zero_optimization.stage == int(name[-1])
    assert cfg.zero_optimization.overlap_comm is True
    assert cfg.zero_optimization.reduce_bucket_size == 50_000_000
    assert cfg.zero_optimization.allgather_bucket_size == 50_000_000
    assert cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params["lr"] == 3e-4
    assert cfg.gradient_clipping == 1.0
    assert cfg.train_micro_batch_size_per_gpu == "auto"


def test_presets_are_deep_copies():
    preset = get_preset("zero2")
    preset["zero_optimization"]["stage"] = 0
    preset["optimizer"]["params"]["betas"].append(1.0)
    assert PRESETS["zero2"]["zero_optimization"]["stage"] == 2
    assert PRESETS["zero2"]["optimizer"]["params"]["betas"] == [0.9, 0.95]
    override = {"zero_optimization": {"stage": 1}}
    load_config(override, preset="zero3")
    assert PRESETS["zero3"]["zero_optimization"]["stage"] == 3
    assert override == {"zero_optimization": {"stage": 1}}


def test_unknown_preset_lists_names():
    with pytest.raises(ConfigError) as info:
        load_config(preset="zero9")
    for name in ("zero9", "zero0", "zero1", "zero2", "zero3"):
        assert name in str(info.value)


def test_defaults():
    cfg = load_quietly()
    assert isinstance(cfg, Config)
    assert cfg.zero_optimization.stage == 0
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.gradient_clipping == 1.0  # DeepSpeed 0.19's (constants.GRADIENT_CLIPPING_DEFAULT)
    assert cfg.steps_per_print == 10
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.train_batch_size is None


def test_json_file_path(tmp_path):
    data = {"train_batch_size": 16, "zero_optimization": {"stage": 2},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(data))
    for arg in (path, str(path)):
        cfg = load_quietly(arg)
        assert cfg.train_batch_size == 16
        assert cfg.zero_optimization.stage == 2
        assert cfg.scheduler.params == {"warmup_num_steps": 10}


def test_missing_and_invalid_json_file_named(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json"):
        load_config(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        load_config(str(bad))


def test_dict_deep_merged_over_preset():
    cfg = load_quietly({"zero_optimization": {"reduce_bucket_size": 1000},
                        "optimizer": {"params": {"lr": 1e-3}}}, preset="zero2")
    assert cfg.zero_optimization.stage == 2  # kept from the preset
    assert cfg.zero_optimization.reduce_bucket_size == 1000
    assert cfg.zero_optimization.allgather_bucket_size == 50_000_000
    assert cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params["lr"] == 1e-3
    assert cfg.optimizer.params["weight_decay"] == 0.1


def test_config_instance_passthrough_and_preset():
    cfg = load_quietly({"zero_optimization": {"stage": 1}})
    assert load_config(cfg) is cfg
    merged = load_quietly(cfg, preset="zero3")
    assert merged.zero_optimization.stage == 1
    assert merged.optimizer.type == "AdamW"


# ---------------------------------------------------------------- batch arithmetic

def batch(world_size, **kw):
    return resolve_batch_sizes(load_quietly(kw), world_size)


def test_batch_all_three_consistent_and_inconsistent():
    assert batch(3, train_batch_size=24, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2) == (24, 4, 2)
    with pytest.raises(ConfigError) as info:
        batch(3, train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    msg = str(info.value)
    for part in ("train_batch_size 32", "train_micro_batch_size_per_gpu 4", "gradient_accumulation_steps 2",
                 "world_size 3", "24"):
        assert part in msg


def test_batch_two_given_derives_third():
    assert batch(2, train_batch_size=32, train_micro_batch_size_per_gpu=4) == (32, 4, 4)
    assert batch(2, train_batch_size=32, gradient_accumulation_steps=4) == (32, 4, 4)
    assert batch(2, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=5) == (30, 3, 5)
    with pytest.raises(ConfigError) as info:
        batch(2, train_batch_size=10, train_micro_batch_size_per_gpu=4)
    msg = str(info.value)
    assert "train_batch_size 10" in msg and "4" in msg and "world_size 2" in msg and "8" in msg
    with pytest.raises(ConfigError) as info:
        batch(2, train_batch_size=10, gradient_accumulation_steps=3)
    msg = str(info.value)
    assert "train_batch_size 10" in msg and "gradient_accumulation_steps 3" in msg and "6" in msg


def test_batch_counted_over_every_rank_as_deepspeed_does_under_autotp():
    """TP from the config or tp_model_init: DeepSpeed counts all 8 ranks in train_batch_size (what the
    Hugging Face Trainer's "auto" writes), the 4 data-parallel ranks take the samples. All three given:
    either count is accepted and the samples a step takes come back; a missing one is derived with
    the data-parallel size; a value neither count explains is refused naming both."""
    cfg = load_quietly(dict(train_batch_size=16, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1))
    assert resolve_batch_sizes(cfg, 4, deepspeed_ranks=8) == (8, 2, 1)
    with pytest.raises(ConfigError):
        resolve_batch_sizes(cfg, 4)
    cfg = load_quietly(dict(train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1))
    assert resolve_batch_sizes(cfg, 4, deepspeed_ranks=8) == (8, 2, 1)
    assert resolve_batch_sizes(load_quietly(dict(train_batch_size=16, train_micro_batch_size_per_gpu=2)),
                               4, deepspeed_ranks=8) == (16, 2, 2)
    cfg = load_quietly(dict(train_batch_size=12, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1))
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(cfg, 4, deepspeed_ranks=8)
    assert "world_size 4 (= 8)" in str(info.value) and "all 8 ranks" in str(info.value) and "16" in str(info.value)


def test_batch_only_train_batch_size():
    assert batch(4, train_batch_size=32) == (32, 8, 1)
    with pytest.raises(ConfigError) as info:
        batch(4, train_batch_size=10)
    msg = str(info.value)
    assert "10" in msg and "world_size 4" in msg


def test_batch_one_given():
    assert batch(2, train_micro_batch_size_per_gpu=8) == (16, 8, 1)
    assert batch(2, train_micro_batch_size_per_gpu=8, train_batch_size="auto", gradient_accumulation_steps="auto") \
        == (16, 8, 1)
    assert batch(2, train_batch_size=8, train_micro_batch_size_per_gpu="auto") == (8, 4, 1)
    # none given: refused (test_malformed_config_names_key_and_value has the cases)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_leave_the_batch_size_to_fill_in(name):
    """A preset's micro-batch is "auto": the engine refuses it until someone fills it in (zerodp
    train does), and takes the preset once it is."""
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        resolve_batch_sizes(load_quietly(preset=name), 4)
    cfg = load_quietly({"train_micro_batch_size_per_gpu": 3}, preset=name)
    assert resolve_batch_sizes(cfg, 4) == (12, 3, 1)
    optimizer_from_config(cfg.optimizer.type, cfg.optimizer.params)


def test_batch_bad_world_size():
    with pytest.raises(ConfigError, match="world_size"):
        batch(0)


def test_batch_value_must_be_positive():
    with pytest.raises(ConfigError) as info:
        load_config({"train_micro_batch_size_per_gpu": 0})
    assert "train_micro_batch_size_per_gpu" in str(info.value) and "0" in str(info.value)


# ---------------------------------------------------------------- malformed configs

def check_before_training(config, world_size=2):
    """What zerodp does to a config before it trains: validate it, resolve the batch sizes,
    build the optimizer block (on a stand-in parameter)."""
    cfg = load_config(config)
    resolve_batch_sizes(cfg, world_size)
    if cfg.optimizer is not None:
        optimizer_from_config(cfg.optimizer.type, cfg.optimizer.params)


_MICRO = {"train_micro_batch_size_per_gpu": 2}
_BATCH_KEYS = "train_batch_size, train_micro_batch_size_per_gpu"


def _opt(params, kind="AdamW"):
    return {**_MICRO, "optimizer": {"type": kind, "params": params}}


@pytest.mark.parametrize("config, path, value, why", [
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage", "5", "allowed"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size", "0", "allowed"),
    ({"zero_optimization": {"allgather_bucket_size": 2.5}}, "zero_optimization.allgather_bucket_size", "2.5",
     "allowed"),
    ({"gradient_clipping": -1.0}, "gradient_clipping", "-1.0", "allowed"),
    ({"steps_per_print": 0}, "steps_per_print", "0", "allowed"),
    ({"scheduler": {"type": "OneCycle"}}, "scheduler.type", "OneCycle", "allowed"),
    # no batch size: refused as DeepSpeed refuses it, not trained with micro-batch 1
    ({"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
     _BATCH_KEYS, 'train_micro_batch_size_per_gpu "auto"', "needs to be provided"),
    ({}, _BATCH_KEYS, "none of", "needs to be provided"),
    ({"train_batch_size": None, "train_micro_batch_size_per_gpu": None}, _BATCH_KEYS, "none of",
     "needs to be provided"),
    ({"gradient_accumulation_steps": 4}, _BATCH_KEYS, "gradient_accumulation_steps 4", "needs to be provided"),
    ({"train_batch_size": "auto", "gradient_accumulation_steps": "auto"}, _BATCH_KEYS, '"auto"',
     "needs to be provided"),
    # optimizer.params: the value's type and shape, checked against the optimizer's constructor
    (_opt({"lr": "fast"}), "optimizer.params.lr", '"fast"', "allowed: a number"),
    (_opt({"lr": True}), "optimizer.params.lr", "true", "allowed: a number"),
    (_opt({"betas": [0.9]}), "optimizer.params.betas", "[0.9]", "allowed: a list of 2 numbers"),
    (_opt({"betas": "0.9"}), "optimizer.params.betas", '"0.9"', "allowed: a list of 2 numbers"),
    (_opt({"betas": [0.9, "x"]}, "Adam"), "optimizer.params.betas", '[0.9, "x"]', "allowed: a list of 2 numbers"),
    (_opt({"eps": [1e-8]}), "optimizer.params.eps", "[1e-08]", "allowed: a number"),
    (_opt({"amsgrad": "yes"}), "optimizer.params.amsgrad", '"yes"', "allowed: true or false"),
    (_opt({"lr": 0.1, "momentum": "high"}, "SGD"), "optimizer.params.momentum", '"high"', "allowed: a number"),
    (_opt({"lr": 0.1, "nesterov_foo": 1}, "SGD"), "optimizer.params.nesterov_foo", "1", "allowed: only SGD's"),
    # optimizer.params: what the constructor itself refuses, traced back to the key at fault
    (_opt({"lr": -1}), "optimizer.params.lr", "-1", "rejects it"),
    (_opt({"betas": [0.9, 1.5]}), "optimizer.params.betas", "[0.9, 1.5]", "rejects it"),
    (_opt({"eps": -1e-8, "lr": 1e-3}), "optimizer.params.eps", "-1e-08", "rejects it"),
    (_opt({"lr": 0.1, "nesterov": True}, "SGD"), "optimizer.params.nesterov", "true", "rejects it"),
    (_opt({"momentum_decay": -1}, "NAdam"), "optimizer.params.momentum_decay", "-1", "rejects it"),
    (_opt({"lr": 0.1, "alpha": -0.5}, "RMSprop"), "optimizer.params.alpha", "-0.5", "rejects it"),
    (_opt({"rho": 2.0}, "Adadelta"), "optimizer.params.rho", "2.0", "rejects it"),
    # DeepSpeed keys torch cannot honour, and the type
    (_opt({"bias_correction": False}, "Adam"), "optimizer.params.bias_correction", "false", "allowed: true"),
    (_opt({"max_grad_norm": 1.0}), "optimizer.params.max_grad_norm", "1.0", "gradient_clipping"),
    (_opt({}, "Foo"), "optimizer.type", '"Foo"', "supported types"),
])
def test_malformed_config_names_key_and_value(config, path, value, why):
    with pytest.raises(ConfigError) as info:
        check_before_training(config)
    msg = str(info.value)
    assert msg.startswith(path) and value in msg and why in msg, msg


def test_bad_stage_lists_allowed_values():
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage: got 5; allowed: 0, 1, 2, 3"):
        load_config({"zero_optimization": {"stage": 5}})


def test_unknown_scheduler_lists_allowed_types():
    with pytest.raises(ConfigError) as info:
        load_config({"scheduler": {"type": "OneCycle"}})
    for name in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        assert name in str(info.value)


def test_multiple_errors_reported_together():
    with pytest.raises(ConfigError) as info:
        load_config({"zero_optimization": {"stage": 7}, "gradient_clipping": -2.0})
    assert "zero_optimization.stage" in str(info.value) and "gradient_clipping" in str(info.value)


# ---------------------------------------------------------------- unknown and unsupported keys

def test_unknown_keys_warn_once_each_with_full_path():
    with pytest.warns(UserWarning) as record:
        cfg = load_config({"foo_bar": 1, "zero_optimization": {"round_robin_gradients": True}})
    messages = [str(w.message) for w in record]
    assert sum("'foo_bar'" in m for m in messages) == 1
    assert sum("'zero_optimization.round_robin_gradients'" in m for m in messages) == 1
    assert cfg.zero_optimization.stage == 0


def test_apex_amp_rejected_with_the_alternative():
    with pytest.raises(ConfigError) as info:
        load_config({"amp": {"enabled": True}})
    assert "amp.enabled" in str(info.value) and "bf16" in str(info.value)


@pytest.mark.parametrize("config, dtype", [
    ({}, "fp32"),
    ({"bf16": {"enabled": True}}, "bf16"),
    ({"bfloat16": {"enabled": True}}, "bf16"),
    ({"fp16": {"enabled": True, "loss_scale": 0}}, "fp16"),
])
def test_compute_dtype_from_precision_blocks(config, dtype):
    assert load_config(config).compute_dtype == dtype


@pytest.mark.parametrize("config, path", [
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "config"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale"),
    ({"communication_data_type": "fp8"}, "communication_data_type"),
    ({"data_types": {"grad_accum_dtype": "int8"}}, "data_types.grad_accum_dtype"),
])
def test_bad_precision_values_name_the_key(config, path):
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value).startswith(path)


def test_disabled_precision_blocks_accepted():
    cfg = load_quietly({"bf16": {"enabled": False},
                        "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 2}})
    assert cfg.fp16.initial_scale_power == 12 and cfg.compute_dtype == "fp32"


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_offload_device_none_is_no_offload(key):
    cfg = load_quietly({"zero_optimization": {key: {"device": "none", "pin_memory": True}}})
    assert getattr(cfg.zero_optimization, key).device == "none"
    assert cfg.zero_optimization.optimizer_offload == cfg.zero_optimization.param_offload == "none"


@pytest.mark.parametrize("config, path", [
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
    ({"prescale_gradients": True}, "prescale_gradients"),
    ({"sparse_gradients": True}, "sparse_gradients"),
    ({"zero_optimization": {"stage": 0, "cpu_offload": True}}, "zero_optimization"),
])
def test_result_changing_keys_rejected(config, path):
    with pytest.raises(ConfigError, match=path):
        load_config(config)


def test_result_changing_keys_at_default_accepted_silently():
    load_quietly({"gradient_predivide_factor": 1.0, "prescale_gradients": False, "sparse_gradients": False,
                  "amp": {"enabled": False, "opt_level": "O1"}})


# ---------------------------------------------------------------- zero block details

def test_float_bucket_sizes_become_ints():
    zero = load_quietly({"zero_optimization": {"reduce_bucket_size": 2e8, "allgather_bucket_size": 5e7,
                                               "stage3_prefetch_bucket_size": 1e6}}).zero_optimization
    assert zero.reduce_bucket_size == 200000000 and type(zero.reduce_bucket_size) is int
    assert zero.allgather_bucket_size == 50_000_000 and type(zero.allgather_bucket_size) is int
    assert zero.stage3_prefetch_bucket_size == 1_000_000


def test_overlap_comm_effective_defaults():
    for stage in (0, 1, 2):
        assert ZeroConfig(stage=stage).overlap_comm_effective is False
    assert ZeroConfig(stage=3).overlap_comm_effective is True
    assert ZeroConfig(stage=3, overlap_comm=False).overlap_comm_effective is False
    assert ZeroConfig(stage=1, overlap_comm=True).overlap_comm_effective is True


def test_stage3_keys_stored():
    zero = load_quietly({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9,
                                               "stage3_gather_16bit_weights_on_model_save": True}}).zero_optimization
    assert zero.stage == 3 and zero.stage3_max_live_parameters == 10**9
    assert zero.stage3_gather_16bit_weights_on_model_save is True


def test_defaults_that_change_numbers_are_deepspeeds():
    """Where the installed DeepSpeed states a default that changes the numbers, zerodp's is the same."""
    constants = pytest.importorskip("deepspeed.runtime.constants")
    assert load_quietly().gradient_clipping == constants.GRADIENT_CLIPPING_DEFAULT


def test_describe_fields():
    rows = describe_fields()
    keys = {key: (default, doc) for key, default, doc in rows}
    assert keys["zero_optimization.stage"][0] == "0"
    assert keys["zero_optimization.reduce_bucket_size"][0] == "500000000"
    assert keys["gradient_clipping"][0] == "1.0"
    assert "scheduler.type" in keys and "train_batch_size" in keys
    assert all(doc for _, _, doc in rows)


# -- what Accelerate and TRL write into configs ---------------------------------------------------

def test_what_accelerate_and_trl_write_is_accepted_without_a_warning(recwarn):
    """Accelerate always writes ``steps_per_print: inf`` (never print); TRL writes dotted top-level
    keys for its reference models, which DeepSpeed ignores, and so does zerodp; both silently."""
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "steps_per_print": float("inf"),
                       "zero_optimization": {"stage": 3},
                       "zero_optimization.reduce_bucket_size": 1024,
                       "zero_optimization.stage3_prefetch_bucket_size": 921.6})
    assert cfg.steps_per_print is None and cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert not [w for w in recwarn if "zerodp" in str(w.message)]
    with pytest.raises(ConfigError, match="steps_per_print"):
        load_config({"steps_per_print": 0.5})


def test_the_config_reads_as_deepspeeds_config_dict():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})
    assert cfg.get("zero_optimization", {}).get("stage") == 3 and cfg["train_micro_batch_size_per_gpu"] == 2
    assert "bf16" in cfg and cfg.get("no_such_key", 7) == 7


def test_compile_block_takes_deepspeeds_keys_and_says_deepcompile_is_not_there(recwarn):
    """DeepSpeed's ``compile`` block: its keys, with DeepSpeed's defaults (read from its own
    ``CompileConfig`` where DeepSpeed is installed); DeepCompile's switches warn once, saying what runs
    instead; ``debug_log`` is taken without a warning; an unknown key is named."""
    cfg = load_config({"train_batch_size": 2, "compile": {"debug_log": True}})
    assert cfg.compile.debug_log and not cfg.compile.deepcompile and not recwarn.list
    deepspeed_compile = pytest.importorskip("deepspeed.compile.config")
    theirs, ours = deepspeed_compile.CompileConfig(), load_config({"train_batch_size": 2}).compile
    for key in type(ours).model_fields:
        assert getattr(ours, key) == getattr(theirs, key), key
    assert set(type(theirs).model_fields) <= set(type(cfg.compile).model_fields)
    with pytest.warns(UserWarning) as record:
        load_config({"train_batch_size": 2, "compile": {"deepcompile": True, "passes": ["z3"],
                                                        "offload_parameters": True, "no_such_pass": 1}})
    messages = [str(w.message) for w in record]
    said = [m for m in messages if "DeepCompile" in m]
    assert len(said) == 1 and "deepcompile" in said[0] and "offload_parameters" in said[0] and "z3" in said[0]
    assert "engine.compile() runs torch.compile" in said[0]
    assert sum("'compile.no_such_pass'" in m for m in messages) == 1

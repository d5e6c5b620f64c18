"""The ``zerodp`` command line: help, option handling, errors, and one real ``zerodp train`` run."""
import argparse
import json
import math
import os
import subprocess
import sys

import pytest

from zerodp.config import ConfigError
from zerodp.tools import cli, train

TRAIN_OPTIONS = ["--nproc", "--preset", "--config", "--model", "--steps", "--micro-batch",
                 "--grad-accum", "--lr", "--precision", "--seed", "--eval-every", "--max-bytes", "--out", "--tp",
                 "--loss-parallel", "--sequence-parallel"]


def parse_train(*argv):
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser.parse_args(list(argv))


def write_json(path, data):
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


# ---------------------------------------------------------------- help

def test_top_level_help_lists_train(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out


def test_train_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in TRAIN_OPTIONS:
        assert option in out, option
    for preset in ("zero0", "zero1", "zero2", "zero3"):
        assert preset in out
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices["train"]._actions:
        assert action.help, f"undocumented option {action.option_strings}"


def test_no_command_prints_usage_and_fails(capsys):
    assert cli.main([]) == 2
    assert "train" in capsys.readouterr().err


# ---------------------------------------------------------------- arguments and config

def test_worker_argv_round_trips():
    args = parse_train("--nproc", "3", "--preset", "zero1", "--model", "tiny", "--steps", "7",
                       "--micro-batch", "2", "--grad-accum", "3", "--lr", "0.0007", "--seed", "5",
                       "--eval-every", "0", "--max-bytes", "12345", "--out", "some dir")
    argv = train.to_argv(args)
    assert "--nproc" not in argv  # torchrun would read it as its own --nproc-per-node
    again = parse_train(*argv)
    assert {**vars(again), "nproc": 3} == vars(args)


def test_defaults_and_overrides():
    cfg = train.build_config(parse_train())
    assert cfg.zero_optimization.stage == 2
    assert cfg.train_micro_batch_size_per_gpu == train.DEFAULT_MICRO_BATCH
    assert cfg.gradient_accumulation_steps == train.DEFAULT_GRAD_ACCUM
    assert cfg.optimizer.params["lr"] == train.DEFAULT_LR
    assert train.check_config(cfg, 2) == (2 * train.DEFAULT_MICRO_BATCH * train.DEFAULT_GRAD_ACCUM,
                                          train.DEFAULT_MICRO_BATCH, train.DEFAULT_GRAD_ACCUM)
    cfg = train.build_config(parse_train("--preset", "zero1", "--micro-batch", "3",
                                         "--grad-accum", "2", "--lr", "0.01"))
    assert cfg.zero_optimization.stage == 1
    assert train.check_config(cfg, 4) == (24, 3, 2)
    assert cfg.optimizer.params["lr"] == 0.01
    assert cfg.optimizer.params["betas"] == [0.9, 0.95]  # the rest of the preset is kept


@pytest.mark.parametrize("flag, dtype", [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32")])
def test_precision_option_overrides_the_config(tmp_path, flag, dtype):
    path = write_json(tmp_path / "c.json", {"bf16": {"enabled": True}, "fp16": {"initial_scale_power": 8}})
    cfg = train.build_config(parse_train("--config", path, "--preset", "zero2", "--precision", flag))
    assert cfg.compute_dtype == dtype
    assert cfg.fp16.initial_scale_power == 8  # the rest of the block is kept
    assert train.build_config(parse_train("--config", path, "--preset", "zero2")).compute_dtype == "bf16"


def test_config_file_merged_over_preset(tmp_path):
    path = write_json(tmp_path / "ds.json", {
        "train_batch_size": 24, "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.002}},
        "zero_optimization": {"stage": 1}})
    cfg = train.build_config(parse_train("--config", path, "--preset", "zero0"))
    assert cfg.zero_optimization.stage == 1
    assert cfg.zero_optimization.overlap_comm is True  # from the preset
    assert cfg.optimizer.params["lr"] == 0.002  # the file's lr wins over the default
    assert train.check_config(cfg, 2) == (24, 4, 3)  # accumulation derived from the file's batch
    cfg = train.build_config(parse_train("--config", path, "--lr", "0.1"))
    assert cfg.optimizer.params["lr"] == 0.1


def test_config_file_without_optimizer_needs_a_preset(tmp_path):
    path = write_json(tmp_path / "ds.json", {"zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError, match="optimizer"):
        train.check_config(train.build_config(parse_train("--config", path)), 2)
    cfg = train.build_config(parse_train("--config", path, "--preset", "zero2"))
    assert cfg.zero_optimization.stage == 1
    assert cfg.optimizer.params["lr"] == train.DEFAULT_LR


# ---------------------------------------------------------------- errors: exit code 2, no traceback

def test_bad_preset_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--preset", "zero9"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--preset" in err and "zero9" in err


@pytest.mark.parametrize("data, key", [
    ({"zero_optimization": {"stage": 7}}, "zero_optimization.stage"),
    ({"gradient_clipping": -1}, "gradient_clipping"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled"),
    ("{not json", "not valid JSON"),
])
def test_invalid_config_file_exits_2(tmp_path, capsys, data, key):
    path = write_json(tmp_path / "bad.json", data)
    assert cli.main(["train", "--config", path, "--preset", "zero1", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert key in err
    assert "Traceback" not in err


@pytest.mark.parametrize("block, key", [
    ({"optimizer": {"type": "Foo", "params": {}}}, "Foo"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "nesterov_foo": 1}}}, "nesterov_foo"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "total_num_steps"),
])
def test_optimizer_and_scheduler_checked_before_launch(tmp_path, capsys, block, key):
    path = write_json(tmp_path / "ds.json", block)
    assert cli.main(["train", "--config", path, "--preset", "zero2", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


def test_batch_arithmetic_error_exits_2(tmp_path, capsys):
    path = write_json(tmp_path / "ds.json", {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})
    assert cli.main(["train", "--config", path, "--preset", "zero1", "--nproc", "2"]) == 2
    assert "train_batch_size" in capsys.readouterr().err


def test_corpus_too_small_exits_2(capsys):
    assert cli.main(["train", "--model", "tiny", "--max-bytes", "500"]) == 2
    assert "--max-bytes" in capsys.readouterr().err


def test_bad_config_from_the_console_entry_point(tmp_path):
    path = write_json(tmp_path / "bad.json", {"zero_optimization": {"stage": "two"}})
    proc = subprocess.run([sys.executable, "-m", "zerodp.tools.cli", "train", "--config", path,
                           "--preset", "zero2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "zero_optimization.stage" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- formatting

def test_format_table():
    text = train.format_table("T", ("a", "total"), [{"a": 1024 * 1024, "total": 3 * 1024 * 1024},
                                                    {"a": 0, "total": 512 * 1024}])
    lines = text.splitlines()
    assert lines[0] == "T"
    assert lines[1].split() == ["rank", "a", "total"]
    assert lines[2].split() == ["0", "1.000", "3.000"]
    assert lines[3].split() == ["1", "0.000", "0.500"]


# ---------------------------------------------------------------- a real run

def test_train_two_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != train.WORKER_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "zerodp.tools.cli", "train", "--nproc", "2", "--model", "tiny",
         "--steps", "6", "--micro-batch", "2", "--eval-every", "0", "--max-bytes", "200000",
         "--preset", "zero1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "ZeRO stage 1, world size 2" in out
    assert "2 micro x 1 accum x 2 ranks = 4 sequences" in out
    assert "Model-state memory per rank (MiB)" in out
    assert "Communication per optimizer step" in out
    for column in ("parameters", "gradients", "optimizer_states", "model_states",
                   "all_reduce", "reduce_scatter", "all_gather", "control", "total"):
        assert column in out
    assert "train loss:" in out

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["zero_stage"] == 1
    assert len(summary["losses"]) == 6
    assert all(math.isfinite(x) for x in summary["losses"])
    assert abs(summary["losses"][0] - math.log(256)) < 0.5
    assert summary["final_val_loss"] is None
    memory, comm = summary["memory_bytes"], summary["comm_bytes_per_step"]
    assert len(memory) == len(comm) == 2
    # stage 1: full parameters and gradients on every rank, Adam states sharded in two
    assert memory[0]["parameters"] == memory[1]["parameters"] > 0
    assert memory[0]["optimizer_states"] <= memory[0]["parameters"]
    assert comm[0]["reduce_scatter"] > 0 and comm[0]["all_gather"] > 0
    assert comm[0]["all_reduce"] == 0
    assert comm[0]["total"] == sum(comm[0][k] for k in ("all_reduce", "reduce_scatter",
                                                         "all_gather", "control"))


@pytest.mark.parametrize("options", [[], ["--loss-parallel", "--sequence-parallel"]])
def test_train_with_tensor_parallelism(tmp_path, options):
    """``--tp 2`` on 2 processes: one tensor-parallel group, one data-parallel rank; the weights it
    writes are the whole model (consolidated from the split checkpoint) and load into the GPT.
    With sequence parallelism the split layers reduce-scatter their outputs."""
    import torch

    from zerodp.checkpoint.tensorfile import load_file
    from zerodp.examples.gpt import build_gpt
    env = {k: v for k, v in os.environ.items() if k != train.WORKER_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "zerodp.tools.cli", "train", "--nproc", "2", "--tp", "2", "--model", "tiny",
         "--steps", "4", "--micro-batch", "2", "--eval-every", "0", "--max-bytes", "200000",
         "--preset", "zero3", "--out", str(tmp_path), *options],
        capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world size 2 (data 1 x tensor 2)" in proc.stdout
    assert "2 micro x 1 accum x 1 data-parallel rank = 2 sequences" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["comm_bytes_per_step"][0]["all_reduce"] > 0  # the split layers' activations
    if options:  # reduce-scatters: the tensor group's (one data-parallel rank runs no ZeRO collectives)
        assert summary["comm_bytes_per_step"][0]["reduce_scatter"] > 0
    model = build_gpt("tiny")
    model.load_state_dict({k: v.to(torch.float32) for k, v in load_file(tmp_path / "model.safetensors").items()},
                          strict=True)
    assert all(math.isfinite(x) for x in summary["losses"])


def test_tp_must_divide_the_processes(capsys):
    assert cli.main(["train", "--nproc", "3", "--tp", "2", "--model", "tiny"]) == 2
    assert "tensor_parallel.autotp_size: 2 does not divide the 3 processes" in capsys.readouterr().err

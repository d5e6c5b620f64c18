"""Training metrics: the csv_monitor / tensorboard config blocks, the rows the monitor writes
(compared with what the engine reported during the same run), rank 0 writing alone,
``zerodp train --metrics-dir`` and ``zerodp plot``.

Only the plot test needs matplotlib (skipped without it); the TensorBoard writer is replaced
by a recorder, so tensorboard is not needed either.
"""
import csv
import json
import sys
import warnings

import pytest
from monitor_tasks import build_model, make_config, train_and_record

import zerodp
from zerodp import monitor
from zerodp.config import ConfigError, load_config
from zerodp.tools import cli, plot, train

MEM_KEYS = ("parameters", "gradients", "optimizer_states", "master_weights", "model_states")


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def parse_train(*argv):
    import argparse
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser.parse_args(list(argv))


# ---------------------------------------------------------------- config blocks

def test_config_blocks_defaults_and_values():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config({})
        assert not cfg.csv_monitor.enabled and not cfg.tensorboard.enabled
        # DeepSpeed's defaults: output under the current directory, in DeepSpeedJobName/
        assert cfg.csv_monitor.output_path == "" and cfg.csv_monitor.job_name == "DeepSpeedJobName"
        assert cfg.tensorboard.output_path == "" and cfg.tensorboard.job_name == "DeepSpeedJobName"
        cfg = load_config({"csv_monitor": {"enabled": True, "output_path": "runs", "job_name": "a"},
                           "tensorboard": {"enabled": False, "output_path": "tb"}})
    assert (cfg.csv_monitor.enabled, cfg.csv_monitor.output_path, cfg.csv_monitor.job_name) == \
        (True, "runs", "a")
    assert cfg.tensorboard.output_path == "tb"
    assert monitor.monitor_from_config(load_config({}), engine=None) is None


@pytest.mark.parametrize("data, key", [
    ({"csv_monitor": {"enabled": "maybe"}}, "csv_monitor.enabled"),
    ({"csv_monitor": {"output_path": 3}}, "csv_monitor.output_path"),
    ({"csv_monitor": {"job_name": None}}, "csv_monitor.job_name"),
    ({"tensorboard": {"enabled": [1]}}, "tensorboard.enabled"),
    ({"tensorboard": "on"}, "tensorboard"),
])
def test_config_blocks_reject_bad_values(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(data)


def test_unknown_monitor_key_warns():
    with pytest.warns(UserWarning, match="csv_monitor.interval"):
        load_config({"csv_monitor": {"enabled": False, "interval": 5}})


# ---------------------------------------------------------------- the rows

def test_rows_equal_what_the_engine_reported(tmp_path):
    """World 1 in this process, 2 micro-batches per step, two param groups, a warm-up schedule."""
    def two_groups(model):
        return [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.005}]

    steps, gas = 4, 2
    rec = train_and_record(None, str(tmp_path), "job", stage=2, gas=gas, steps=steps,
                           tokens_per_sample=16, model_parameters=two_groups)
    path = tmp_path / "job" / monitor.CSV_NAME
    assert rec["writes"] and rec["csv_path"] == str(path)
    header, rows = read_csv(path)
    assert header[:6] == ["step", "samples", "elapsed_s", "loss", "lr", "lr_1"]
    for column in ("grad_norm", "loss_scale", "skipped_steps", "step_time_s", "samples_per_s",
                   "tokens_per_s", "comm_total", *(f"mem_{k}" for k in MEM_KEYS)):
        assert column in header
    assert len(rows) == steps
    batch = rec["train_batch_size"]
    assert batch == 3 * gas
    elapsed = 0.0
    for i, row in enumerate(rows):
        assert int(row["step"]) == i + 1 and int(row["samples"]) == (i + 1) * batch
        assert float(row["loss"]) == pytest.approx(sum(rec["losses"][i]) / gas, rel=1e-6)
        assert [float(row["lr"]), float(row["lr_1"])] == rec["lrs"][i]
        assert float(row["grad_norm"]) == rec["grad_norms"][i]
        assert float(row["loss_scale"]) == 1.0 and int(row["skipped_steps"]) == 0
        for key, value in rec["memory"][i].items():
            assert int(row[f"mem_{key}"]) == value, key
        for key, value in rec["comm"][i].items():
            assert int(row[f"comm_{key}"]) == value, key
        dt = float(row["step_time_s"])
        elapsed += dt
        assert dt > 0 and float(row["elapsed_s"]) == pytest.approx(elapsed, rel=1e-6)
        assert float(row["samples_per_s"]) == pytest.approx(batch / dt, rel=1e-9)
        assert float(row["tokens_per_s"]) == pytest.approx(16 * batch / dt, rel=1e-9)
    assert rec["lrs"][0] != rec["lrs"][-1]  # the schedule moved: the column follows it
    info = json.loads((tmp_path / "job" / monitor.INFO_NAME).read_text())
    assert info["zero_stage"] == 2 and info["world_size"] == 1
    assert info["train_batch_size"] == batch and info["tokens_per_sample"] == 16
    assert info["csv"] == monitor.CSV_NAME and info["memory_rank"] == 0


def test_rows_are_flushed_and_runs_do_not_overwrite(tmp_path):
    cfg = make_config(str(tmp_path), "job", stage=0, gas=1)
    engines = []
    for _ in range(2):
        engine, _, _, _ = zerodp.initialize(model=build_model(), config=cfg)
        engines.append(engine)
    first, second = (e.monitor for e in engines)
    assert first.csv_path.name == "metrics.csv" and second.csv_path.name == "metrics-2.csv"
    assert second.info_path.name == "run_info-2.json"
    import torch
    engine = engines[1]
    for step in range(2):
        engine.backward(engine(torch.ones(3, 6)).sum())
        engine.step()
        assert len(read_csv(second.csv_path)[1]) == step + 1  # on disk before close()
    assert second.tokens_per_sample is None
    assert read_csv(second.csv_path)[1][0]["tokens_per_s"] == ""  # unknown: left empty
    for bad in (0, -3, float("nan"), "64", True):
        with pytest.raises(ValueError, match="tokens_per_sample"):
            second.tokens_per_sample = bad
    second.close()
    second.close()  # idempotent
    engine.backward(engine(torch.ones(3, 6)).sum())
    engine.step()  # after close() nothing more is written
    assert len(read_csv(second.csv_path)[1]) == 2
    assert len(read_csv(first.csv_path)[1]) == 0
    assert plot.load_run(tmp_path / "job").csv_path == second.csv_path  # the latest run
    for e in engines:
        e.monitor.close()
        e.destroy()


def test_only_rank_zero_writes(pool, tmp_path):
    """Two ranks share one output_path: rank 0 writes its own loss; rank 1 writes nothing."""
    results = pool.run(train_and_record, 2, str(tmp_path), "shared", 1, 1, 3, timeout=120)
    assert [r["writes"] for r in results] == [True, False]
    assert results[1]["csv_path"] is None
    files = sorted(p.name for p in (tmp_path / "shared").iterdir())
    assert files == ["metrics.csv", "run_info.json"]
    _, rows = read_csv(tmp_path / "shared" / "metrics.csv")
    assert len(rows) == 3
    rank0, rank1 = results
    assert [float(r["loss"]) for r in rows] == pytest.approx([loss[0] for loss in rank0["losses"]], rel=1e-6)
    assert rank0["losses"] != rank1["losses"]  # each rank saw its own data
    assert [float(r["grad_norm"]) for r in rows] == rank0["grad_norms"]
    assert [int(r["comm_total"]) for r in rows] == [c["total"] for c in rank0["comm"]]
    assert all(int(r["comm_reduce_scatter"]) > 0 for r in rows)  # stage 1 on 2 ranks communicates
    info = json.loads((tmp_path / "shared" / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["zero_stage"] == 1


# ---------------------------------------------------------------- tensorboard

def _hide_tensorboard(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


def test_missing_tensorboard_fails_at_initialize(tmp_path, monkeypatch, capsys):
    _hide_tensorboard(monkeypatch)
    cfg = {**make_config(str(tmp_path), "job", 0, 1),
           "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}}
    with pytest.raises(ImportError, match="pip install tensorboard"):
        zerodp.initialize(model=build_model(), config=cfg)
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        train.check_config(load_config(cfg), 1)
    code = cli.main(["train", "--nproc", "1", "--model", "tiny", "--metrics-dir", str(tmp_path / "m"),
                     "--tensorboard"])
    assert code == 2
    err = capsys.readouterr().err
    assert "pip install tensorboard" in err and "Traceback" not in err


class RecordingWriter:
    instances = []

    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.flushes, self.closed = log_dir, [], 0, False
        RecordingWriter.instances.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


def test_tensorboard_scalars(tmp_path, monkeypatch):
    monkeypatch.setattr(monitor, "require_tensorboard", lambda: RecordingWriter)
    RecordingWriter.instances.clear()
    cfg = {**make_config(str(tmp_path), "job", 0, 1),
           "csv_monitor": {"enabled": False},
           "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}}
    engine, _, _, _ = zerodp.initialize(model=build_model(), config=cfg)
    import torch
    norms = []
    for _ in range(2):
        engine.backward(engine(torch.ones(3, 6)).pow(2).mean())
        engine.step()
        norms.append(engine.get_global_grad_norm())
    assert engine.monitor.csv_path is None and not (tmp_path / "job").exists()
    writer, = RecordingWriter.instances
    assert writer.log_dir == str(tmp_path / "tb") and writer.flushes == 2
    tags = {(tag, step): value for tag, value, step in writer.scalars}
    assert [tags[("train/grad_norm", s)] for s in (1, 2)] == norms
    for tag in ("train/loss", "train/lr", "train/step_time_s", "memory/parameters", "comm/total"):
        assert (tag, 2) in tags
    assert ("train/tokens_per_s", 1) not in tags  # unknown tokens per sample: not written
    engine.monitor.close()
    assert writer.closed
    engine.destroy()


# ---------------------------------------------------------------- zerodp train --metrics-dir

def test_train_metrics_options(tmp_path):
    cfg = train.build_config(parse_train("--metrics-dir", str(tmp_path / "runs" / "zero1")))
    assert cfg.csv_monitor.enabled and not cfg.tensorboard.enabled
    assert cfg.csv_monitor.output_path == str(tmp_path / "runs") and cfg.csv_monitor.job_name == "zero1"
    args = parse_train("--metrics-dir", "runs/a", "--tensorboard", "--nproc", "3")
    cfg = train.build_config(args)
    assert cfg.tensorboard.enabled and cfg.tensorboard.job_name == "a"
    assert cfg.tensorboard.output_path == "runs"
    argv = train.to_argv(args)
    assert "--tensorboard" in argv and "True" not in argv
    assert {**vars(parse_train(*argv)), "nproc": 3} == vars(args)
    with pytest.raises(train.UsageError, match="--metrics-dir"):
        train.check_args(parse_train("--tensorboard"))


def test_train_writes_metrics_with_tokens(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "tiny"
    code = cli.main(["train", "--nproc", "1", "--model", "tiny", "--steps", "2", "--micro-batch", "2",
                     "--eval-every", "0", "--max-bytes", "20000", "--preset", "zero1",
                     "--metrics-dir", str(run_dir)])
    assert code == 0, capsys.readouterr().err
    assert f"zerodp plot {run_dir}" in capsys.readouterr().out
    _, rows = read_csv(run_dir / "metrics.csv")
    assert len(rows) == 2
    info = json.loads((run_dir / "run_info.json").read_text())
    block = info["tokens_per_sample"]
    assert block > 0 and info["zero_stage"] == 1
    for row in rows:
        assert float(row["tokens_per_s"]) == pytest.approx(float(row["samples_per_s"]) * block)


# ---------------------------------------------------------------- zerodp plot

def _two_runs(tmp_path):
    for stage in (0, 2):
        train_and_record(None, str(tmp_path / "runs"), f"zero{stage}", stage=stage, gas=1, steps=2)
    return [str(tmp_path / "runs" / f"zero{s}") for s in (0, 2)]


def test_plot_writes_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    runs = _two_runs(tmp_path)
    out = tmp_path / "charts"
    assert cli.main(["plot", *runs, "--out", str(out)]) == 0
    names = ("loss.png", "memory_steps.png", "memory_stages.png")
    printed = capsys.readouterr().out
    for name in names:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"wrote {out / name}" in printed
    assert cli.main(["plot", runs[0]]) == 0  # one run: charts next to its CSV
    for name in names:
        assert (tmp_path / "runs" / "zero0" / name).is_file()
    loaded = [plot.load_run(r) for r in runs]
    assert [r.label for r in loaded] == ["ZeRO-0, 1 rank", "ZeRO-2, 1 rank"]
    estimated = [None, {"parameters": 1000, "gradients": 500, "optimizer_states": 2000}]
    path = plot.plot_stage_memory(loaded, tmp_path / "estimated.png", estimated)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_plot_errors_exit_2(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert cli.main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "csv_monitor" in capsys.readouterr().err
    (tmp_path / "metrics.csv").write_text("step,loss\n")
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "no optimizer step recorded" in capsys.readouterr().err


def test_plot_estimates_follow_the_zero_accounting(tmp_path):
    """zerodp plot draws the ZeRO accounting beside the measured bars: bf16 AdamW, 1000
    parameters on 4 ranks at stage 2 is 2 + 2/4 + 4/4 + 8/4 bytes per parameter."""
    from zerodp.tools.plot import Run, estimates_for
    info = {"zero_stage": 2, "world_size": 4, "compute_dtype": "bf16", "optimizer": "AdamW",
            "trainable_parameters": 1000}
    runs = [Run(tmp_path, tmp_path / "m.csv", info, []), Run(tmp_path, tmp_path / "m.csv", {}, [])]
    est, missing = estimates_for(runs)
    assert est == {"parameters": 2000, "gradients": 500, "master_weights": 1000, "optimizer_states": 2000}
    assert missing is None

"""Training metrics written while training runs (opt-in through the config).

The engine calls ``monitor_from_config(config, engine)`` once; when it returns a monitor,
the engine calls ``monitor.on_backward(loss)`` for every ``engine.backward`` and
``monitor.on_step(engine)`` after every optimizer step (skipped steps included).

Two DeepSpeed-style config blocks turn it on (see ``docs/metrics.md``)::

    "csv_monitor": {"enabled": true, "output_path": "runs", "job_name": "zero2"},
    "tensorboard": {"enabled": true, "output_path": "runs", "job_name": "zero2"}

As in DeepSpeed, the run's directory is ``output_path/job_name`` (``output_path`` empty: the
current directory) and only global rank 0 writes. Per optimizer step it records the mean
loss of the step's micro-batches, the learning rate of every param group, the global
gradient norm, the loss scale, the skipped-step count, the step time and throughput,
rank 0's model-state memory by category (:meth:`ZeroEngine.memory_breakdown`) and the bytes
rank 0 communicated in the step (:meth:`ZeroEngine.comm_stats`).

The CSV monitor writes ``metrics.csv`` (one row per step, flushed after every row) and
``run_info.json`` (ZeRO stage, world size, batch sizes, ...) in the run's directory; a
second run into the same directory writes ``metrics-2.csv`` and ``run_info-2.json``, and so
on, so no run overwrites another. ``zerodp plot`` draws charts from them.

Tokens per second are recorded once the number of tokens per sample is known::

    if engine.monitor is not None:
        engine.monitor.tokens_per_sample = seq_len
"""
from __future__ import annotations

import csv
import json
import math
import os
import time
import weakref
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch

from .config import ConfigError
from .core.device import synchronize

__all__ = ["monitor_from_config", "TrainingMonitor", "require_tensorboard", "CSV_NAME", "INFO_NAME",
           "TENSORBOARD_MISSING"]

#: File names in the run's directory (the n-th run into one directory adds ``-n``).
CSV_NAME = "metrics.csv"
INFO_NAME = "run_info.json"

TENSORBOARD_MISSING = ("tensorboard.enabled is true in the config, but the tensorboard package is not "
                       "installed: pip install tensorboard (or pip install 'zerodp[tensorboard]')")

#: The columns every CSV starts with; ``lr_1``, ``lr_2``, ... follow ``lr`` for further param
#: groups, and ``mem_<category>`` / ``comm_<kind>`` columns follow ``tokens_per_s``.
BASE_COLUMNS = ("step", "samples", "elapsed_s", "loss", "lr", "grad_norm", "loss_scale",
                "skipped_steps", "step_time_s", "samples_per_s", "tokens_per_s")
#: Columns of a pipeline engine's rows, after ``tokens_per_s``.
PIPELINE_COLUMNS = ("bubble_fraction",)


def require_tensorboard() -> type:
    """``torch.utils.tensorboard.SummaryWriter``; raises ImportError naming the package to
    install when tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError(TENSORBOARD_MISSING) from e
    return SummaryWriter


def _run_dir(block: Any) -> Path:
    """``output_path/job_name`` as DeepSpeed joins them (empty output_path: the current directory)."""
    return Path(os.path.join(block.output_path, block.job_name))


def monitor_from_config(config: Any, engine: Any) -> Optional["TrainingMonitor"]:
    """The monitor the config asks for, or None when neither block is enabled.

    Every rank gets a monitor (so ``engine.monitor.tokens_per_sample = n`` works anywhere and
    a missing tensorboard package fails on every rank alike); only global rank 0 writes.
    """
    csv_cfg, tb_cfg = getattr(config, "csv_monitor", None), getattr(config, "tensorboard", None)
    csv_on = bool(csv_cfg is not None and csv_cfg.enabled)
    tb_on = bool(tb_cfg is not None and tb_cfg.enabled)
    if not (csv_on or tb_on):
        return None
    writer_cls = require_tensorboard() if tb_on else None
    return TrainingMonitor(engine, csv_dir=_run_dir(csv_cfg) if csv_on else None,
                           tensorboard_dir=_run_dir(tb_cfg) if tb_on else None,
                           summary_writer_cls=writer_cls)


def _lr_recorder(ref: "weakref.ref[TrainingMonitor]"):
    """An optimizer step pre-hook that records the param groups' learning rates."""
    def hook(optimizer, args, kwargs) -> None:
        monitor = ref()
        if monitor is not None:
            monitor._step_lrs = [float(g["lr"]) for g in optimizer.param_groups]
    return hook


def _close_all(handles: list) -> None:
    for h in handles:
        try:
            h.close()
        except Exception:  # noqa: BLE001 - closing at exit must not raise
            pass


def _free_names(directory: Path) -> tuple[Path, Path]:
    """``metrics.csv`` / ``run_info.json``, or the first ``-n`` pair not used by an earlier run."""
    n = 1
    while True:
        suffix = "" if n == 1 else f"-{n}"
        csv_path = directory / CSV_NAME.replace(".csv", f"{suffix}.csv")
        info_path = directory / INFO_NAME.replace(".json", f"{suffix}.json")
        if not csv_path.exists() and not info_path.exists():
            return csv_path, info_path
        n += 1


def _make_dir(directory: Path, key: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{key}: cannot create the run directory {str(directory)!r}: "
                          f"{e.strerror or e}") from None


class TrainingMonitor:
    """Per-step training metrics, written by global rank 0 to CSV and/or TensorBoard.

    Built by :func:`monitor_from_config`; ``on_backward`` and ``on_step`` are called by the
    engine. Attributes: ``writes`` (whether this rank writes), ``csv_path`` and
    ``info_path`` (None where no CSV is written), ``tensorboard_dir``, ``columns`` (the CSV
    header) and :attr:`tokens_per_sample`.
    """

    def __init__(self, engine: Any, csv_dir: Optional[Path] = None,
                 tensorboard_dir: Optional[Path] = None, summary_writer_cls: Optional[type] = None) -> None:
        self.writes = int(getattr(engine, "global_rank", 0)) == 0
        self.csv_path: Optional[Path] = None
        self.info_path: Optional[Path] = None
        self.tensorboard_dir = Path(tensorboard_dir) if tensorboard_dir is not None else None
        self._tokens_per_sample: Optional[float] = None
        self._losses: list[torch.Tensor] = []
        self._file = None
        self._csv = None
        self._tb = None
        self._handles: list = []
        self._closed = False
        self._start = self._last = time.perf_counter()
        self.columns: list[str] = []
        if not self.writes:
            return
        self._finalizer = weakref.finalize(self, _close_all, self._handles)

        n_lrs = len(engine.get_lr())
        self._step_lrs: Optional[list[float]] = None
        register = getattr(getattr(engine, "optimizer", None), "register_step_pre_hook", None)
        if register is not None:  # the learning rates the update really uses
            self._lr_hook = register(_lr_recorder(weakref.ref(self)))
        self._memory_keys = list(engine.memory_breakdown())
        self._comm_keys = list(engine.comm_stats())
        # a pipeline engine's schedule: the share of a step its stages idle (fill and drain)
        self._pipeline = [k for k in PIPELINE_COLUMNS if hasattr(engine, k)]
        self.columns = [*BASE_COLUMNS[:5], *(f"lr_{i}" for i in range(1, n_lrs)), *BASE_COLUMNS[5:],
                        *self._pipeline, *(f"mem_{k}" for k in self._memory_keys),
                        *(f"comm_{k}" for k in self._comm_keys)]
        self._info = self._run_info(engine)
        if csv_dir is not None:
            _make_dir(Path(csv_dir), "csv_monitor.output_path")
            self.csv_path, self.info_path = _free_names(Path(csv_dir))
            self._info["csv"] = self.csv_path.name
            self._write_info()
            self._file = open(self.csv_path, "x", newline="", encoding="utf-8")
            self._handles.append(self._file)
            self._csv = csv.DictWriter(self._file, fieldnames=self.columns, restval="",
                                       extrasaction="ignore")
            self._csv.writeheader()
            self._file.flush()
        if self.tensorboard_dir is not None:
            _make_dir(self.tensorboard_dir, "tensorboard.output_path")
            writer_cls = summary_writer_cls or require_tensorboard()
            self._tb = writer_cls(log_dir=str(self.tensorboard_dir))
            self._handles.append(self._tb)

    # -- what the user (or the training script) tells the monitor ---------------------------

    @property
    def tokens_per_sample(self) -> Optional[float]:
        """Tokens in one sample (e.g. the sequence length); None until set. Once set, each row
        gets ``tokens_per_s = train_batch_size * tokens_per_sample / step_time_s``."""
        return self._tokens_per_sample

    @tokens_per_sample.setter
    def tokens_per_sample(self, value: Optional[float]) -> None:
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or not math.isfinite(value):
                raise ValueError(f"tokens_per_sample: got {value!r}; allowed: a number > 0 or None")
        self._tokens_per_sample = value
        if self.writes and self.info_path is not None and not self._closed:
            self._info["tokens_per_sample"] = value
            self._write_info()

    # -- engine hooks ---------------------------------------------------------------------

    def on_backward(self, loss: Any) -> None:
        """Remember the micro-batch's loss (no device sync here: one ``.item()`` per step)."""
        if not self.writes or self._closed:
            return
        t = loss.detach() if torch.is_tensor(loss) else torch.tensor(float(loss))
        self._losses.append(t.float().mean())

    def on_step(self, engine: Any) -> None:
        """Write the row of the optimizer step that just finished (``engine.global_steps``)."""
        if not self.writes or self._closed:
            self._losses = []
            return
        synchronize(engine.device)
        now = time.perf_counter()
        step_time, self._last = now - self._last, now
        loss = torch.stack(self._losses).mean().item() if self._losses else None
        self._losses = []
        batch = engine.train_batch_size()
        row: dict[str, Any] = {
            "step": engine.global_steps, "samples": engine.global_steps * batch,
            "elapsed_s": now - self._start, "loss": loss,
            "grad_norm": engine.get_global_grad_norm(), "loss_scale": float(engine.loss_scale),
            "skipped_steps": int(engine.skipped_steps), "step_time_s": step_time,
            "samples_per_s": batch / step_time if step_time > 0 else None,
            "tokens_per_s": (batch * self._tokens_per_sample / step_time
                             if self._tokens_per_sample is not None and step_time > 0 else None),
        }
        lrs = self._step_lrs if self._step_lrs is not None else engine.get_lr()  # skipped step: no update
        self._step_lrs = None
        for i, lr in enumerate(lrs):
            row["lr" if i == 0 else f"lr_{i}"] = float(lr)
        for key in self._pipeline:
            row[key] = float(getattr(engine, key))
        for key, value in engine.memory_breakdown().items():
            row[f"mem_{key}"] = int(value)
        for key, value in engine.comm_stats().items():
            row[f"comm_{key}"] = int(value)
        if self._csv is not None:
            self._csv.writerow({k: "" if v is None else v for k, v in row.items()})
            self._file.flush()
        if self._tb is not None:
            self._write_tensorboard(row)

    def _write_tensorboard(self, row: dict[str, Any]) -> None:
        step = row["step"]
        for key, value in row.items():
            if key == "step" or value is None or key not in self.columns:
                continue
            if key.startswith("mem_"):
                tag = "memory/" + key[4:]
            elif key.startswith("comm_"):
                tag = "comm/" + key[5:]
            else:
                tag = "train/" + key
            self._tb.add_scalar(tag, value, step)
        self._tb.flush()

    def close(self) -> None:
        """Flush and close the files (idempotent); later steps are not recorded."""
        if self._closed:
            return
        self._closed = True
        if self.writes:
            hook = getattr(self, "_lr_hook", None)
            if hook is not None:
                hook.remove()
            self._finalizer()

    # -- run_info.json --------------------------------------------------------------------

    def _run_info(self, engine: Any) -> dict[str, Any]:
        from ._version import __version__
        groups = getattr(engine, "flat_groups", [])
        cfg = getattr(engine, "config", None)
        return {
            "zero_stage": engine.zero_stage,
            "world_size": engine.world_size,
            "train_batch_size": engine.train_batch_size(),
            "micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "parameters": int(sum(getattr(g, "numel", 0) for g in groups)),
            "trainable_parameters": int(sum(g.numel for g in groups if getattr(g, "trainable", False))),
            "optimizer": type(engine.optimizer).__name__ if getattr(engine, "optimizer", None) else None,
            "compute_dtype": getattr(cfg, "compute_dtype", None),
            "device": str(engine.device),
            "memory_rank": 0,
            "tokens_per_sample": self._tokens_per_sample,
            "zerodp_version": __version__,
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "csv": None,
        }

    def _write_info(self) -> None:
        tmp = self.info_path.with_name(self.info_path.name + ".tmp")
        tmp.write_text(json.dumps(self._info, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.info_path)

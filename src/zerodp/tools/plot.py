"""``zerodp plot``: charts from the metrics the CSV monitor wrote.

``zerodp plot RUN_DIR [RUN_DIR ...]`` reads each run's ``metrics.csv`` and ``run_info.json``
(written by the ``csv_monitor`` config block, see :mod:`zerodp.monitor` and
``docs/metrics.md``; a directory holding several runs is read at its latest, or pass the
CSV file itself) and writes three PNG files:

* ``loss.png``: the loss per optimizer step and, below it, the learning rate (one line per run);
* ``memory_steps.png``: model-state memory by category over the steps, one panel per run;
* ``memory_stages.png``: the picture of the ZeRO paper: one stacked bar per run of the
  parameters, gradients, optimizer states and fp32 master weights held per rank, labelled
  by ZeRO stage and world size (``zerodp plot runs/zero0 runs/zero1 runs/zero2 runs/zero3``).

Memory is rank 0's, measured at the last recorded step. :func:`plot_stage_memory` also
takes estimated bytes per category and draws them as hatched bars beside the measured ones.

matplotlib is optional (``pip install matplotlib``); without it the command exits with code 2.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ..monitor import CSV_NAME, INFO_NAME

__all__ = ["Run", "PlotError", "load_run", "plot_runs", "plot_loss_lr", "plot_memory_over_steps",
           "plot_stage_memory", "draw_memory_bars", "estimates_for", "add_arguments", "run", "BAR_CATEGORIES"]

#: The model-state categories of the per-stage bars, bottom to top.
BAR_CATEGORIES = ("parameters", "gradients", "optimizer_states", "master_weights")
_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer_states": "optimizer states",
           "master_weights": "fp32 master weights"}
_COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer_states": "#55A868",
           "master_weights": "#C44E52"}
MATPLOTLIB_MISSING = ("zerodp plot needs matplotlib to draw charts: pip install matplotlib "
                      "(or pip install 'zerodp[plot]')")


class PlotError(ValueError):
    """A run directory or metrics file that cannot be plotted (reported without a traceback)."""


# -- reading runs ---------------------------------------------------------------------------

@dataclass
class Run:
    """One run's metrics: the CSV rows (numbers; None where a cell is empty) and run_info."""

    path: Path
    csv_path: Path
    info: dict[str, Any]
    columns: list[str]
    rows: list[dict[str, Optional[float]]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)

    @property
    def stage(self) -> Optional[int]:
        return self.info.get("zero_stage")

    @property
    def world_size(self) -> Optional[int]:
        return self.info.get("world_size")

    def series(self, column: str) -> tuple[list[float], list[float]]:
        """``(steps, values)`` of ``column``, leaving out steps where it is empty."""
        pairs = [(r["step"], r.get(column)) for r in self.rows]
        pairs = [(s, v) for s, v in pairs if s is not None and v is not None]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def memory(self, row: int = -1) -> dict[str, float]:
        """The ``mem_*`` columns of a row (the last by default), by category."""
        if not self.rows:
            return {}
        return {c[4:]: self.rows[row][c] or 0.0 for c in self.columns if c.startswith("mem_")}

    @property
    def label(self) -> str:
        if self.stage is None or self.world_size is None:
            return self.name
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        return f"ZeRO-{self.stage}, {ranks}"


def _number(text: str) -> Optional[float]:
    if text is None or text.strip() == "":
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _find_files(path: Path) -> tuple[Path, Path]:
    """The CSV and run_info.json of ``path``: a CSV file, or a directory (its latest run)."""
    if path.is_file():
        info = path.with_name(path.name.replace("metrics", "run_info", 1).replace(".csv", ".json"))
        return path, info
    if not path.is_dir():
        raise PlotError(f"{path}: no such directory or file")
    pattern = re.compile(r"^metrics(?:-(\d+))?\.csv$")
    found = sorted(((int(m.group(1) or 1), p) for p in path.iterdir()
                    if (m := pattern.match(p.name))), key=lambda t: t[0])
    if not found:
        raise PlotError(f"{path}: no {CSV_NAME} here; it is written by the csv_monitor config block "
                        f"(or zerodp train --metrics-dir), see docs/metrics.md")
    n, csv_path = found[-1]
    return csv_path, path / (INFO_NAME if n == 1 else INFO_NAME.replace(".json", f"-{n}.json"))


def load_run(path: str | Path) -> Run:
    """Read a run (a directory written by the CSV monitor, or one of its metrics CSV files)."""
    path = Path(path)
    csv_path, info_path = _find_files(path)
    try:
        with open(csv_path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            columns = list(reader.fieldnames or [])
            rows = [{k: _number(v) for k, v in row.items() if k is not None} for row in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise PlotError(f"{csv_path}: cannot read: {e}") from None
    if "step" not in columns:
        raise PlotError(f"{csv_path}: not a zerodp metrics file (no 'step' column)")
    info: dict[str, Any] = {}
    if info_path.is_file():
        try:
            info = json.loads(info_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise PlotError(f"{info_path}: cannot read: {e}") from None
    return Run(path=path if path.is_dir() else path.parent, csv_path=csv_path, info=info,
               columns=columns, rows=rows)


def _labels(runs: Sequence[Run]) -> list[str]:
    """Run labels, with the directory name added where two runs would look alike."""
    labels = [r.label for r in runs]
    return [f"{lab} ({r.name})" if labels.count(lab) > 1 else lab for lab, r in zip(labels, runs)]


# -- charts ---------------------------------------------------------------------------------

def _unit(max_bytes: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= scale:
            return float(scale), name
    return 1.0, "bytes"


def _figure(width: float, height: float):
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height), layout="constrained")


def plot_loss_lr(runs: Sequence[Run], out_path: str | Path) -> Path:
    """Loss per optimizer step (top) and learning rate (bottom), one line per run."""
    fig = _figure(8, 6)
    ax_loss, ax_lr = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    for run, label in zip(runs, _labels(runs)):
        steps, loss = run.series("loss")
        line, = ax_loss.plot(steps, loss, label=label, linewidth=1.2)
        lr_columns = [c for c in run.columns if c == "lr" or re.fullmatch(r"lr_\d+", c)]
        for i, column in enumerate(lr_columns):
            steps, lr = run.series(column)
            group = f" (param group {column[3:]})" if i else ""
            ax_lr.plot(steps, lr, color=line.get_color(), linestyle="-" if i == 0 else "--",
                       label=f"{label}{group}" if len(lr_columns) > 1 else None, linewidth=1.2)
    ax_loss.set_ylabel("loss (rank 0, mean over micro-batches)")
    ax_loss.set_title("Training loss" if len(runs) > 1 else f"Training loss: {_labels(runs)[0]}")
    ax_loss.grid(alpha=0.3)
    if len(runs) > 1:
        ax_loss.legend()
    if any(ln.get_label() and not ln.get_label().startswith("_") for ln in ax_lr.get_lines()):
        ax_lr.legend(fontsize="small")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    ax_lr.grid(alpha=0.3)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return _save(fig, out_path)


def plot_memory_over_steps(runs: Sequence[Run], out_path: str | Path) -> Path:
    """Memory on rank 0 per step, one panel per run: the model states (parameters, gradients,
    optimizer states, master weights) as stacked areas, whose top is ``model_states``, and
    every other non-zero category (temporary buffers and their peaks, optimizer scalars) as
    a line from zero."""
    top = max((v or 0.0) for run in runs for row in run.rows for c, v in row.items()
              if c.startswith("mem_")) if any(r.rows for r in runs) else 0.0
    scale, unit = _unit(top)
    fig = _figure(8, 1.0 + 2.8 * len(runs))
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, run, label in zip(axes, runs, _labels(runs)):
        stacked = [c for c in BAR_CATEGORIES if f"mem_{c}" in run.columns]
        steps = [r["step"] for r in run.rows]
        if stacked:
            ax.stackplot(steps, *[[(r.get(f"mem_{c}") or 0.0) / scale for r in run.rows] for c in stacked],
                         labels=[_LABELS[c] for c in stacked], colors=[_COLORS[c] for c in stacked],
                         alpha=0.7)
        styles = iter([("black", "--"), ("#8172B3", ":"), ("#937860", "-."), ("#DA8BC3", "--"),
                       ("#8C8C8C", ":"), ("#CCB974", "-."), ("#64B5CD", "--")])
        for column in run.columns:
            category = column[4:]
            if not column.startswith("mem_") or category in BAR_CATEGORIES or category == "model_states":
                continue
            xs, values = run.series(column)
            if not any(values):
                continue
            color, dash = next(styles, ("black", ":"))
            ax.plot(xs, [v / scale for v in values], color=color, linestyle=dash, linewidth=1.8,
                    label=category.replace("_", " "))
        ax.set_title(f"Memory on rank 0: {label}")
        ax.set_ylabel(unit)
        ax.set_xlabel("optimizer step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        handles, names = ax.get_legend_handles_labels()
        if handles:
            ax.legend(handles, names, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, out_path)


def draw_memory_bars(ax: Any, labels: Sequence[str], measured: Sequence[Mapping[str, float]],
                     estimated: Optional[Sequence[Optional[Mapping[str, float]]]] = None) -> None:
    """Stacked bars of bytes per category (:data:`BAR_CATEGORIES`), one per label, on ``ax``.

    ``estimated``, when given, holds one dict of estimated bytes per category (or None) per
    label, drawn as a hatched bar beside the measured one; keys other than
    :data:`BAR_CATEGORIES` are ignored.
    """
    from matplotlib.patches import Patch

    estimated = list(estimated) if estimated is not None else [None] * len(labels)
    if len(estimated) != len(labels):
        raise ValueError(f"estimated: got {len(estimated)} entries for {len(labels)} runs")
    paired = any(e is not None for e in estimated)
    totals = [sum(float(m.get(c, 0.0) or 0.0) for c in BAR_CATEGORIES) for m in measured]
    totals += [sum(float(e.get(c, 0.0) or 0.0) for c in BAR_CATEGORIES) for e in estimated if e]
    scale, unit = _unit(max(totals, default=0.0))
    width = 0.38 if paired else 0.6

    def bar(x: float, values: Mapping[str, float], hatch: Optional[str]) -> None:
        bottom = 0.0
        for c in BAR_CATEGORIES:
            v = float(values.get(c, 0.0) or 0.0) / scale
            ax.bar(x, v, width, bottom=bottom, color=_COLORS[c], hatch=hatch,
                   edgecolor="white" if hatch is None else "black", linewidth=0.5)
            bottom += v
        ax.annotate(f"{bottom:.3g}", (x, bottom), xytext=(0, 2), textcoords="offset points",
                    ha="center", va="bottom", fontsize="small")

    for i, values in enumerate(measured):
        if paired and estimated[i] is not None:
            bar(i - width / 2, values, None)
            bar(i + width / 2, estimated[i], "//")
        else:
            bar(i, values, None)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(f"{unit} per rank")
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set_ylim(0, 1.12 * max(totals, default=0.0) / scale or 1.0)
    ax.grid(axis="y", alpha=0.3)
    handles = [Patch(facecolor=_COLORS[c], label=_LABELS[c]) for c in reversed(BAR_CATEGORIES)]
    if paired:
        handles += [Patch(facecolor="white", edgecolor="black", label="measured"),
                    Patch(facecolor="white", edgecolor="black", hatch="//", label="estimated")]
    ax.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_stage_memory(runs: Sequence[Run], out_path: str | Path,
                      estimates: Optional[Sequence[Optional[Mapping[str, float]]]] = None) -> Path:
    """One stacked bar per run: parameters, gradients, optimizer states and fp32 master
    weights per rank (rank 0, last recorded step), labelled by ZeRO stage and world size.

    ``estimates``: optional, one dict of estimated bytes per category (or None) per run, with
    the keys of :data:`BAR_CATEGORIES`; drawn as hatched bars beside the measured ones.
    """
    fig = _figure(max(5.0, 1.6 * len(runs) + 2.5), 5)
    ax = fig.subplots()
    draw_memory_bars(ax, [lab.replace(", ", "\n") for lab in _labels(runs)],
                     [r.memory() for r in runs], estimates)
    ax.set_title("Model-state memory per rank" + (" (measured vs estimated)" if estimates and any(
        e is not None for e in estimates) else " (measured on rank 0)"))
    return _save(fig, out_path)


def _save(fig: Any, out_path: str | Path) -> Path:
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=120)
    return out_path


def plot_runs(paths: Sequence[str | Path], out_dir: str | Path,
              estimates: Optional[Sequence[Optional[Mapping[str, float]]]] = None,
              with_accounting: bool = False) -> list[Path]:
    """Read the runs at ``paths`` and write the three charts into ``out_dir``; returns the
    files written. Runs without any recorded step are left out (PlotError if none has one).
    With ``with_accounting`` and no ``estimates``, the bars' estimates are the ZeRO
    accounting of each run (``estimates_for``)."""
    runs = [load_run(p) for p in paths]
    if estimates is None and with_accounting:
        estimates = estimates_for(runs)
    keep = [i for i, r in enumerate(runs) if r.rows]
    if not keep:
        raise PlotError("no optimizer step recorded in " + ", ".join(str(r.csv_path) for r in runs))
    for r in runs:
        if not r.rows:
            print(f"zerodp plot: {r.csv_path} has no steps yet; left out", file=sys.stderr)
    runs = [runs[i] for i in keep]
    if estimates is not None:
        estimates = [list(estimates)[i] for i in keep]
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlotError(f"--out: cannot create directory {str(out_dir)!r}: {e.strerror or e}") from None
    return [plot_loss_lr(runs, out_dir / "loss.png"),
            plot_memory_over_steps(runs, out_dir / "memory_steps.png"),
            plot_stage_memory(runs, out_dir / "memory_stages.png", estimates)]


# -- command line ---------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``zerodp plot``."""
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="a run directory written by the csv_monitor config block or "
                             "zerodp train --metrics-dir (its latest metrics CSV is read), or a "
                             "metrics CSV file; several runs are drawn side by side")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="directory for loss.png, memory_steps.png and memory_stages.png "
                             "(default: the run directory for one run, the current directory "
                             "for several); created if missing")


def estimates_for(runs: Sequence[Run]) -> list[Optional[dict[str, float]]]:
    """The ZeRO accounting of each run's stage, world size, dtype, optimizer and trainable
    parameter count (``zerodp.estimate``), for drawing beside the measured bars; None for a
    run whose run_info lacks one of them or names an optimizer the estimator does not know."""
    from ..estimator import EstimateError, estimate
    out: list[Optional[dict[str, float]]] = []
    for r in runs:
        info = r.info
        needed = (info.get("trainable_parameters"), r.stage, r.world_size, info.get("compute_dtype"),
                  info.get("optimizer"))
        if any(v is None for v in needed) or not needed[0]:
            out.append(None)
            continue
        try:
            row = estimate(int(needed[0]), ranks_per_node=int(needed[2]), precision=needed[3],
                           optimizer=str(needed[4]).lower()).row(int(needed[1]), "none")
        except EstimateError:
            out.append(None)
            continue
        out.append({k: float(getattr(row, k)) for k in BAR_CATEGORIES})
    return out


def run(args: argparse.Namespace) -> int:
    """Run ``zerodp plot``; returns the exit code (2 for a usage problem or missing matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"zerodp plot: error: {MATPLOTLIB_MISSING}", file=sys.stderr)
        return 2
    if args.out is not None:
        out_dir = Path(args.out)
    elif len(args.runs) == 1:
        first = Path(args.runs[0])
        out_dir = first if first.is_dir() else first.parent
    else:
        out_dir = Path(".")
    try:
        written = plot_runs(args.runs, out_dir, with_accounting=True)
    except PlotError as e:
        print(f"zerodp plot: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0

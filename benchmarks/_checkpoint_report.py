"""The tables and verdicts of ``checkpoint.py``: one row per system, size and world size for
save and load, the asynchronous save's stall, and consolidation; from the runs' raw numbers."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import _common

if TYPE_CHECKING:
    from checkpoint import Run

#: What the verdicts ask of zerodp: save and load at this fraction of the disk's bandwidth or more
#: (the two first), an asynchronous save's stall under this fraction of a synchronous save, and
#: consolidation's peak within this many MiB over the largest tensor.
SAVE_TARGET, LOAD_TARGET, STALL_TARGET, CONSOLIDATE_SLACK_MIB = 0.70, 0.70, 0.10, 100.0

@dataclasses.dataclass
class IoRow:
    """One row of the save/load table: a system at a size and world size, over repetitions."""

    size: str
    world: int
    system: str
    params: Optional[int] = None
    written_mb: Optional[float] = None     # per rank, mean over ranks
    save_s: Optional[float] = None         # slowest rank's save call
    flush_s: Optional[float] = None        # fsync of what the save left unsynced
    save_gbps: Optional[float] = None      # all ranks' bytes / (save_s + flush_s)
    save_frac: Optional[float] = None      # save_gbps / disk write bandwidth
    save_cpu_s: Optional[float] = None     # CPU time of the busiest rank's process during its save
    read_mb: Optional[float] = None
    load_s: Optional[float] = None
    load_gbps: Optional[float] = None
    load_frac: Optional[float] = None
    load_cpu_s: Optional[float] = None
    reps: int = 0
    note: str = ""


@dataclasses.dataclass
class StallRow:
    size: str
    world: int
    system: str
    save: Optional[int] = None             # 1: the process's first asynchronous save, 2: the next
    sync_s: Optional[float] = None
    call_s: Optional[float] = None
    slowdown_s: Optional[float] = None
    wait_s: Optional[float] = None
    stall_s: Optional[float] = None
    stall_frac: Optional[float] = None
    base_step_s: Optional[float] = None
    extra_cpu_s: Optional[float] = None    # process CPU of the save window over as many plain steps
    sync_cpu_s: Optional[float] = None     # process CPU of the synchronous save
    steps_during: Optional[float] = None
    staging_mib: Optional[float] = None
    file_mib: Optional[float] = None
    reps: int = 0
    note: str = ""


@dataclasses.dataclass
class ConsolidateRow:
    size: str
    system: str
    world: int
    params: Optional[int] = None
    largest_mib: Optional[float] = None
    out_mb: Optional[float] = None
    seconds: Optional[float] = None
    rss_before_mib: Optional[float] = None
    peak_over_mib: Optional[float] = None
    within: Optional[bool] = None
    reps: int = 0
    note: str = ""


def disk_summary(measurements: list[dict]) -> dict:
    """Median and range of the run's disk measurements."""
    out = {"count": len(measurements)}
    for key in ("write_gbps", "read_gbps"):
        vals = [m[key] for m in measurements]
        out[key] = _common.median(vals)
        out[key + "_range"] = (min(vals), max(vals)) if vals else None
    return out


def _failed_note(good: list, bad: list) -> str:
    if not good:
        return f"failed: {bad[0].error}" if bad else "not run"
    return f"{len(bad)} of {len(bad) + len(good)} runs failed: {bad[0].error}" if bad else ""


def _sum_or_none(values) -> Optional[float]:
    vals = list(values)
    return None if any(v is None for v in vals) else float(sum(vals))


def summarize_io(runs: list[Run], disk: dict, skipped: dict[str, str]) -> list[IoRow]:
    """Save/load rows: per run, the slowest rank's time and all ranks' bytes; medians over
    repetitions; throughput against the disk's median bandwidth."""
    keys = list(dict.fromkeys((r.size, r.world, r.system) for r in runs if r.kind == "io"))
    out = []
    for size, world, system in keys:
        s = IoRow(size, world, system)
        out.append(s)
        mine = [r for r in runs if r.kind == "io" and (r.size, r.world, r.system) == (size, world, system)]
        good, bad = [r for r in mine if r.rows], [r for r in mine if not r.rows]
        s.reps, s.note = len(good), skipped.get(system) or _failed_note(good, bad)
        if not good:
            continue
        s.params = good[0].rows[0]["params"]
        save_wall = [max(x["save_s"] for x in r.rows) + r.rows[0]["flush_s"] for r in good]
        load_wall = [max(x["load_s"] for x in r.rows) for r in good]
        written = [_sum_or_none(x["save_write_bytes"] for x in r.rows) for r in good]
        read = [_sum_or_none(x["load_read_bytes"] for x in r.rows) for r in good]
        s.save_s = _common.median(max(x["save_s"] for x in r.rows) for r in good)
        s.flush_s = _common.median(r.rows[0]["flush_s"] for r in good)
        s.load_s = _common.median(load_wall)
        s.save_cpu_s = _common.median(max(x.get("save_cpu_s", 0.0) for x in r.rows) for r in good)
        s.load_cpu_s = _common.median(max(x.get("load_cpu_s", 0.0) for x in r.rows) for r in good)
        if None not in written:
            s.written_mb = _common.median(w / world / 1e6 for w in written)
            s.save_gbps = _common.median(w / t / 1e9 for w, t in zip(written, save_wall))
            s.save_frac = _common.ratio(s.save_gbps, disk.get("write_gbps"))
        if None not in read:
            s.read_mb = _common.median(b / world / 1e6 for b in read)
            s.load_gbps = _common.median(b / t / 1e9 for b, t in zip(read, load_wall))
            s.load_frac = _common.ratio(s.load_gbps, disk.get("read_gbps"))
    return out


def summarize_stall(runs: list[Run]) -> list[StallRow]:
    """Asynchronous-save rows, one per system and save (first, second ...) of the runs that
    measured a stall: per run the worst rank's figures; medians over repetitions."""
    out = []
    measured = [r for r in runs if r.kind == "io" and r.rows and "stall" in r.rows[0]]
    keys = list(dict.fromkeys((r.size, r.world, r.system) for r in measured))
    for size, world, system in keys:
        good = [r for r in measured if (r.size, r.world, r.system) == (size, world, system)]
        errors = [r.rows[0]["stall"][0]["error"] for r in good if "error" in r.rows[0]["stall"][0]]
        good = [r for r in good if "error" not in r.rows[0]["stall"][0]]
        if not good:
            out.append(StallRow(size, world, system, note=f"n/a: {errors[0]}" if errors else "not run"))
            continue
        for n in range(min(len(r.rows[0]["stall"]) for r in good)):
            s = StallRow(size, world, system, save=n + 1, reps=len(good))
            out.append(s)

            def worst(r, key, n=n):
                return max(x["stall"][n][key] for x in r.rows)

            def per_run(fn, good=good):
                return _common.median(fn(r) for r in good)

            def sync(r):
                return max(x["save_s"] for x in r.rows) + r.rows[0]["flush_s"]
            s.sync_s = per_run(sync)
            s.call_s = per_run(lambda r: worst(r, "call_s"))
            s.slowdown_s = per_run(lambda r: worst(r, "slowdown_s"))
            s.wait_s = per_run(lambda r: worst(r, "wait_s"))
            s.stall_s = per_run(lambda r: worst(r, "stall_s"))
            s.stall_frac = per_run(lambda r: worst(r, "stall_s") / sync(r))
            s.base_step_s = per_run(lambda r: worst(r, "base_step_s"))
            s.extra_cpu_s = per_run(lambda r: worst(r, "extra_cpu_s"))
            s.sync_cpu_s = per_run(lambda r: max(x.get("save_cpu_s", 0.0) for x in r.rows))
            s.steps_during = per_run(lambda r, n=n: len(r.rows[0]["stall"][n]["steps_during_s"]))
            s.staging_mib = per_run(lambda r: worst(r, "staging_rss_mib"))
            if all(x["save_write_bytes"] is not None for r in good for x in r.rows):
                s.file_mib = per_run(lambda r: max(x["save_write_bytes"] for x in r.rows) / 2**20)
    return out


def summarize_consolidate(runs: list[Run]) -> list[ConsolidateRow]:
    out = []
    keys = list(dict.fromkeys((r.size, r.system) for r in runs if r.kind == "consolidate"))
    params = {r.size: r.rows[0]["params"] for r in runs if r.kind == "io" and r.rows}
    largest = {r.size: r.rows[0]["largest_tensor_bytes"] for r in runs if r.kind == "io" and r.rows}
    for size, system in keys:
        mine = [r for r in runs if r.kind == "consolidate" and (r.size, r.system) == (size, system)]
        good, bad = [r for r in mine if r.rows], [r for r in mine if not r.rows]
        s = ConsolidateRow(size, system, mine[0].world, params=params.get(size))
        out.append(s)
        s.reps, s.note = len(good), _failed_note(good, bad)
        if not good:
            continue
        s.largest_mib = largest[size] / 2**20 if size in largest else None
        s.out_mb = good[0].rows["bytes_out"] / 1e6
        s.seconds = _common.median(r.rows["seconds"] for r in good)
        s.rss_before_mib = _common.median(r.rows["rss_before_mib"] for r in good)
        s.peak_over_mib = max(r.rows["peak_over_start_mib"] for r in good)
        if s.largest_mib is not None:
            s.within = s.peak_over_mib <= s.largest_mib + CONSOLIDATE_SLACK_MIB
        if not all(r.rows["peak_exact"] for r in good):
            s.note = "peak since process start (VmHWM could not be reset)"
    return out


# ---------------------------------------------------------------------------- tables

def fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _params(n: Optional[int], size: str) -> str:
    return size if n is None else f"{n / 1e6:.1f}M"


def format_disk(disk: dict) -> str:
    lines = ["| disk (same filesystem) | median GB/s | range GB/s | measurements |", "|---|---|---|---|"]
    for key, label in (("write_gbps", "sequential write + fsync"),
                       ("read_gbps", "sequential read, page cache evicted")):
        rng = disk.get(key + "_range")
        span = "-" if not rng else f"{rng[0]:.2f}-{rng[1]:.2f}"
        lines.append(f"| {label} | {fmt(disk.get(key), '.2f')} | {span} | {disk.get('count', 0)} |")
    return "\n".join(lines)


def format_io(rows: list[IoRow]) -> str:
    lines = ["| params | world | system | written / rank (MB) | save (s) | + fsync (s) | save GB/s | of disk write "
             "| save CPU / rank (s) | read / rank (MB) | load (s) | load GB/s | of disk read | load CPU / rank (s) "
             "| runs | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        lines.append(
            f"| {_params(s.params, s.size)} | {s.world} | {s.system} | {fmt(s.written_mb, '.0f')} | {fmt(s.save_s, '.2f')} "
            f"| {fmt(s.flush_s, '.2f')} | {fmt(s.save_gbps, '.2f')} | {_pct(s.save_frac)} | {fmt(s.save_cpu_s, '.2f')} "
            f"| {fmt(s.read_mb, '.0f')} | {fmt(s.load_s, '.2f')} | {fmt(s.load_gbps, '.2f')} | {_pct(s.load_frac)} "
            f"| {fmt(s.load_cpu_s, '.2f')} | {s.reps} | {s.note.replace('|', '/')} |")
    return "\n".join(lines)


def format_stall(rows: list[StallRow], params: dict[str, int]) -> str:
    lines = ["| params | world | system | async save | sync save (s) | async call (s) | step slowdown (s) "
             "| final wait (s) | stall (s) | stall / sync save | step (s) | steps during write "
             "| sync save CPU / rank (s) | async extra CPU / rank (s) | RSS growth / rank (MiB) | file / rank (MiB) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        which = "-" if s.save is None else {1: "1st", 2: "2nd", 3: "3rd"}.get(s.save, f"{s.save}th")
        lines.append(
            f"| {_params(params.get(s.size), s.size)} | {s.world} | {s.system} | {which} | {fmt(s.sync_s, '.2f')} "
            f"| {fmt(s.call_s, '.2f')} | {fmt(s.slowdown_s, '.2f')} | {fmt(s.wait_s, '.2f')} | {fmt(s.stall_s, '.2f')} "
            f"| {_pct(s.stall_frac)} | {fmt(s.base_step_s, '.2f')} | {fmt(s.steps_during, '.0f')} "
            f"| {fmt(s.sync_cpu_s, '.2f')} | {fmt(s.extra_cpu_s, '.2f')} "
            f"| {fmt(s.staging_mib, '.0f')} | {fmt(s.file_mib, '.0f')} | {s.note.replace('|', '/')} |")
    return "\n".join(lines)


def format_consolidate(rows: list[ConsolidateRow]) -> str:
    lines = ["| params | system | checkpoint from world | largest tensor (MiB) | written (MB) | time (s) "
             "| RSS before (MiB) | peak RSS over start (MiB) | limit: largest + 100 (MiB) | within | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        limit = None if s.largest_mib is None else s.largest_mib + CONSOLIDATE_SLACK_MIB
        within = "-" if s.within is None else ("yes" if s.within else "**no**")
        lines.append(
            f"| {_params(s.params, s.size)} | {s.system} | {s.world} | {fmt(s.largest_mib, '.1f')} | {fmt(s.out_mb, '.0f')} "
            f"| {fmt(s.seconds, '.2f')} | {fmt(s.rss_before_mib, '.0f')} | {fmt(s.peak_over_mib, '.0f')} "
            f"| {fmt(limit, '.0f')} | {within} | {s.note.replace('|', '/')} |")
    return "\n".join(lines)


LEGEND = """\
What the numbers mean:

* disk: one process writing a file of random bytes sequentially (8 MiB writes) until its fsync
  returns, then reading it back after `posix_fadvise(POSIX_FADV_DONTNEED)` dropped it from the
  page cache; GB = 10^9 bytes. The fractions below use the medians.
* written / read per rank: bytes each rank sent to / fetched from storage during its save / load
  (`write_bytes` / `read_bytes` of `/proc/self/io`, all its threads), mean over ranks. Before
  every load all checkpoint files were fsynced and evicted from the page cache
  (`posix_fadvise(POSIX_FADV_DONTNEED)`), so loads read from the disk.
* save (s): the slowest rank's own `save_checkpoint` call, synchronous. `+ fsync`: the time
  an fsync of every file took afterwards: what the save left in the page cache unwritten
  (DeepSpeed's `torch.save` does not fsync; zerodp and DCP fsync before returning).
* save GB/s = all ranks' bytes written / (save + fsync); load GB/s = all ranks' bytes read /
  the slowest rank's `load_checkpoint` (which includes putting the state in place: at
  stage 1-2 the all-gather of the parameters). "of disk": that over the disk's bandwidth
  above (one sequential stream); target >= 70% for zerodp.
* save / load CPU: CPU time (user + system, all threads) of the busiest rank's process during
  its save / load; close to the wall time, the path is CPU-bound rather than waiting for the disk.
* async stall: in one process, after the synchronous save and load, `step` is the median
  training step (forward, backward, optimizer) without a save in flight, before and after.
  Then two `save_checkpoint(async_save=True)` in a row (DCP: `dcp.async_save` on a gloo
  group of its own), "1st" and "2nd" (the first may allocate host memory that the second
  reuses): "async call" is the time the call took to return, "step slowdown" the extra
  time of the steps that follow (as many as cover a synchronous save) over `step`, "final
  wait" the wait for the write to finish after them; stall = the sum, the training time the
  save cost (it can come out slightly negative from step-time noise). Target < 10% of the
  synchronous save. "async extra CPU": the process's CPU time from the call to the end of the
  write over that of as many plain steps, beside the synchronous save's CPU time: on a
  CPU-only machine training uses every core, so this work is taken from the steps (it is less
  noisy than the wall-time stall). RSS growth: the rank's RSS after the call and its steps
  over before it (the host copy the write runs from, kept or freed), beside the bytes the
  rank writes.
* consolidation: the checkpoint of the largest world size consolidated into safetensors
  weights in a fresh process (`zerodp.checkpoint.consolidate`: safetensors; DeepSpeed's
  `convert_zero_checkpoint_to_fp32_state_dict`: `torch.save`, as its safetensors output refuses
  the tied embedding); peak RSS (`VmHWM`, reset just before) minus the RSS just before it;
  target <= largest tensor (the model's largest parameter) + 100 MiB.
* every figure is the median over the repetitions of each run's figure (the slowest rank's
  time; peak memory: the largest)."""


def verdicts(io_rows: list[IoRow], stall_rows: list[StallRow], cons_rows: list[ConsolidateRow]) -> list[str]:
    """One line per target, for zerodp."""
    out = []
    mine = [s for s in io_rows if s.system == "zerodp"]
    for label, attr, target in (("save", "save_frac", SAVE_TARGET), ("load", "load_frac", LOAD_TARGET)):
        vals = [(getattr(s, attr), s) for s in mine if getattr(s, attr) is not None]
        if not vals:
            continue
        miss = [f"{_params(s.params, s.size)} w{s.world} {_pct(v)}" for v, s in vals if v < target]
        lo = min(v for v, _ in vals)
        out.append(f"zerodp {label} >= {target:.0%} of disk bandwidth: "
                   + ("met everywhere" if not miss else f"missed in {len(miss)} of {len(vals)}: " + ", ".join(miss))
                   + f" (lowest {lo:.0%})")
    stalls = [s for s in stall_rows if s.system == "zerodp" and s.stall_frac is not None]
    if stalls:
        worst = max(s.stall_frac for s in stalls)
        out.append(f"zerodp async stall < {STALL_TARGET:.0%} of a sync save: "
                   + ("met" if worst < STALL_TARGET else "missed") + " ("
                   + ", ".join(f"{_params(None, s.size)} w{s.world} save {s.save}: {_pct(s.stall_frac)}"
                               for s in stalls) + ")")
    cons = [s for s in cons_rows if s.system == "zerodp" and s.within is not None]
    if cons:
        out.append("zerodp consolidation peak <= largest tensor + 100 MiB: "
                   + ("met at every size" if all(s.within for s in cons) else "missed at "
                      + ", ".join(_params(s.params, s.size) for s in cons if not s.within))
                   + " (peaks " + ", ".join(f"{s.peak_over_mib:.0f}" for s in cons) + " MiB)")
    return out


# ---------------------------------------------------------------------------- main

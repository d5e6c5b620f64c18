"""``zerodp simulate``'s table: the simulated rank's figures beside ``zerodp estimate``'s."""
from __future__ import annotations

from typing import Optional

from ...estimator.inputs import _num
from .run import Simulation

__all__ = ["format_simulation", "ROWS"]

#: (label, simulated category, estimated category)
ROWS = [("parameters", "parameters", "parameters"),
        ("gradients", "gradients", "gradients"),
        ("master weights", "master_weights", "master_weights"),
        ("optimizer states", "optimizer_states", "optimizer_states"),
        ("model states", "model_states", "model_states"),
        ("gradient buckets (peak)", "gradient_buckets_peak", "gradient_buckets"),
        ("gathered parameters (peak)", "gathered_parameters_peak", "gathered_parameters"),
        ("peak, all allocations", "peak", "device_total")]


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def _diff(sim: int, est: Optional[int]) -> str:
    if not est:
        return "-" if est is None or sim == 0 else "new"
    return f"{(sim - est) / est * 100:+.1f}%"


def format_simulation(s: Simulation) -> str:
    d = s.to_dict()
    lines = [f"zerodp simulate: rank {s.rank} of {s.world} (data {s.dp} x tensor {s.tp} x pipeline {s.pp}), "
             f"stage {s.stage}, {s.precision}, offload {s.offload}, micro-batch {s.micro_batch} x {s.seq} tokens"
             + (f" ({s.seq // s.sp} on this rank, sequence-parallel {s.sp})" if s.sp > 1 else "")
             + (f", experts over expert-parallel groups of {s.ep}" if s.ep > 1 else ""),
             f"model: {s.model}: {_num(s.params)} parameter elements on this rank before ZeRO sharding",
             "",
             f"{'MiB per rank':<28}{'simulated':>14}{'estimated':>14}{'diff':>9}"]
    rows = ROWS
    if s.offload != "none":  # the categories count every place; the estimate's columns are the device's
        on = s.categories.get("model_states_on_compute", 0)
        d["model_states"] = on
        rows = [("model states on the device", "model_states", "model_states"), *ROWS[5:]]
    if s.categories.get("secondary_parameters_peak") or s.estimated.get("secondary_parameters"):
        at = next(i for i, r in enumerate(rows) if r[1] == "model_states")
        rows = [*rows[:at], ("hpZ copy (peak)", "secondary_parameters_peak", "secondary_parameters"), *rows[at:]]
    for label, mine, theirs in rows:
        lines.append(f"{label:<28}{_mib(d[mine]):>14}{_mib(s.estimated.get(theirs)):>14}"
                     f"{_diff(d[mine], s.estimated.get(theirs)):>9}")
    if s.pp > 1:
        lines.append(f"{'gradients held whole (peak)':<28}{_mib(s.categories.get('accumulated_gradients_peak')):>14}"
                     f"{'(in buckets)':>14}")
    if s.device_peak is not None:
        lines.append(f"{'peak, CUDA allocator':<28}{_mib(s.device_peak):>14}")
    if s.offload != "none":
        if s.device_peak is None:
            lines.append("(no GPU here: host and device are one memory, and 'peak' counts both)")
        host = s.categories.get("model_states_on_host", 0)
        lines.append(f"{'model states on the host':<28}{_mib(host):>14}{_mib(s.estimated.get('cpu')):>14}"
                     f"{_diff(host, s.estimated.get('cpu')):>9}")
    lines += ["", f"collectives per step: {s.collectives_per_step}, {s.bytes_per_step / 2**20:,.1f} MiB sent by "
                  "this rank (ring-algorithm bytes)"]
    if s.pp > 1:
        lines.append(f"  pipeline stage {s.pipeline_stage} of {s.pp}: {s.p2p_bytes / 2**20:,.1f} MiB point to point "
                     "(computed: activations forward, their gradients back)")
    for group, kinds in s.collectives.items():
        parts = ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in kinds.items() if k not in ("total", "calls") and v)
        lines.append(f"  {group:<8} {kinds.get('calls', 0):>5} calls  {parts}")
    lines += [""] + [f"note: {n}" for n in s.notes if n.startswith("pipeline stage")]
    lines += [f"estimated activations {_mib(s.estimated.get('activations'))} MiB (in 'peak' above); "
                  f"the simulation took {s.seconds:.1f} s"]
    return "\n".join(lines)

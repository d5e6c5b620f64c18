"""Memory of model states: what the engine really holds (the ledger).

``measure_model_states`` walks the engine's real tensors, never a formula, so tests can
compare it with the ZeRO accounting (docs/training.md; fp32 Adam: parameters 4Ψ, gradients 4Ψ,
Adam moments 8Ψ; the sharded parts divided by N, plus padding).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

import torch

from .collectives import SCRATCH
from .optim_shard import HostOptimizer, master_of

if TYPE_CHECKING:
    from ..config import ZeroConfig
    from .flat import FlatGroup
    from .reduce import GradReducer
    from .sharded import ShardedParams
    from .stages import StagePolicy

CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_states",
              "optimizer_scalars", "gathered_parameters", "gradient_buckets", "secondary_parameters")


class MeasuredEngine(Protocol):
    """What the ledger reads of an engine (a ``ZeroEngine``, not imported here: the engine
    imports this module)."""

    flat_groups: "list[FlatGroup]"            # every flat group
    trainable: "list[FlatGroup]"              # the groups the optimizer updates
    optimizer: torch.optim.Optimizer
    policy: "StagePolicy"                     # the stage table row of this engine
    sharded: "Optional[ShardedParams]"        # stage 3: the units (peak_gathered_bytes); None below
    zero_config: "ZeroConfig"
    offload: "Optional[HostOptimizer]"
    reducer: "GradReducer"                    # the gradient buckets alive now and their peak


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measure_model_states(engine: MeasuredEngine) -> dict[str, int]:
    """Bytes held on this rank, by category, from the engine's tensors.

    * ``parameters``: the persistent flat parameter buffers (full at stages 0-2, this rank's
      shards at stage 3);
    * ``secondary_parameters``: hpZ's secondary copy of the parameters (``secondary.py``) held
      right now: from a step's first gather of each unit until the optimizer step drops it (a
      frozen group's is kept); zero without hpZ; ``secondary_parameters_peak``: the most held at once
      so far (what a step holds between its first forward and its update);
    * ``gathered_parameters``: stage 3's full parameter buffers allocated right now (between
      a unit's gather and release; zero between steps), and ``gathered_parameters_peak``, the
      most allocated at once so far (prefetched units included);
    * ``gradients``: gradient storage of a step (the full buffer at stages 0-1, kept between
      steps; this rank's shard at stages 2-3, allocated by the step's first reduction and
      freed after the update, counted whether or not it is allocated right now);
    * ``master_weights``: fp32 master copies kept apart from the parameters (none in fp32
      training, where the optimizer updates the parameter shard in place);
    * ``optimizer_states``: optimizer state tensors with one value per parameter element
      (Adam's ``exp_avg`` and ``exp_avg_sq``);
    * ``optimizer_scalars``: other optimizer state (step counters);
    * ``gradient_buckets``: temporary stage 2-3 buckets alive right now (zero between steps;
      the reducer's, ``reduce.py``);
    * ``gradient_buckets_peak``: the most bytes of such buckets alive at once so far;
    * ``collective_buffers``: the transient buffers of gloo's all-to-all collectives that this
      process keeps for reuse (``collectives.ScratchPool``; shared by its engines; none on NCCL).

    ``model_states`` is the sum of the first four and ``secondary_parameters``. With offload,
    ``model_states_on_compute``,
    ``model_states_on_host`` and ``model_states_on_disk`` split it by where it lives (on a
    CPU-only machine "compute" and "host" are the same memory), ``offload_buffers`` is the
    host transfer buffers and ``offload_tiles_peak`` the most bytes of disk-offloaded tiles read
    into host memory at once.
    """
    out = dict.fromkeys(CATEGORIES, 0)
    for g in engine.flat_groups:
        numel = g.shard_numel if g.shards_parameters else g.padded_numel
        out["parameters"] += numel * g.full.element_size()
        if g.shards_parameters:
            out["gathered_parameters"] += g.full.untyped_storage().nbytes()
        if g.secondary is not None:
            out["secondary_parameters"] += g.secondary.nbytes
    for g in engine.trainable:
        out["gradients"] += g.grads.nbytes
        if master_of(g) is not None:
            out["master_weights"] += _nbytes(master_of(g))  # offloaded to disk: its size in the file
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            for value in engine.optimizer.state.get(p, {}).values():
                if not torch.is_tensor(value):
                    continue
                key = "optimizer_states" if value.shape == p.shape and value.numel() > 0 \
                    and value.dim() > 0 else "optimizer_scalars"
                out[key] += _nbytes(value)
    out["gradient_buckets"] = engine.reducer.bucket_bytes()
    out["gradient_buckets_peak"] = engine.reducer.peak_bucket_bytes
    out["gathered_parameters_peak"] = engine.sharded.peak_gathered_bytes if engine.sharded is not None else 0
    out["secondary_parameters_peak"] = engine.sharded.peak_secondary_bytes if engine.sharded is not None else 0
    out["collective_buffers"] = SCRATCH.held_bytes + (engine.sharded.scratch.held_bytes
                                                      if engine.sharded is not None else 0)
    out["model_states"] = (out["parameters"] + out["gradients"] + out["master_weights"]
                           + out["optimizer_states"] + out["secondary_parameters"])
    off = getattr(engine, "offload", None)
    if off is not None:
        out.update(_placement(engine, out, off))
    return out


def _placement(engine: MeasuredEngine, out: dict[str, int], off) -> dict[str, int]:
    """With offload: model-state bytes on the compute device, in host memory and on disk, the
    offload's host transfer buffers, and (disk offload) the most bytes of tiles read into host
    memory at once so far."""
    where = {"compute": 0, "host": 0, "disk": 0}
    params_at = {"cpu": "host", "nvme": "disk"}.get(engine.zero_config.param_offload, "compute")
    where[params_at] += out["parameters"] + out["secondary_parameters"]  # hpZ's copy beside the shards
    where["compute"] += out["gradients"]
    where[off.location] += out["master_weights"] + out["optimizer_states"]
    return {"model_states_on_compute": where["compute"], "model_states_on_host": where["host"],
            "model_states_on_disk": where["disk"], "offload_buffers": off.buffer_bytes,
            "offload_tiles_peak": off.peak_resident_bytes}

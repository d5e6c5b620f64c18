"""The temporary buffers zerodp allocates on top of model states: gradient buckets (stages
2-3) and stage 3's gathered parameters, sized from the config and the model's units."""
from __future__ import annotations

from dataclasses import dataclass

from ..core.reduce import MAX_BUCKETS_IN_FLIGHT
from .inputs import _num
from .model import ModelInfo


@dataclass(frozen=True)
class Buffers:
    """Temporary buffers on top of model states, per rank, with how they were sized."""

    buckets_stage2: int
    buckets_stage3: int
    bucket_note: str
    gathered: int
    gathered_note: str

    def gradient_buckets(self, stage: int) -> int:
        return {2: self.buckets_stage2, 3: self.buckets_stage3}.get(stage, 0)


def estimate_buffers(model: ModelInfo, p: int, reduce_bucket_size: int,
                     max_live_parameters: int, pipeline: bool = False) -> Buffers:
    """Gradient buckets (stages 2-3) and stage-3 gathered parameters, per rank, in bytes.

    Flat groups hold at most ``reduce_bucket_size`` elements (a larger parameter gets one of
    its own); backward fills a full-size bucket per group and keeps at most
    ``MAX_BUCKETS_IN_FLIGHT`` of them in flight. Stage 2 reduces a group as soon as it is
    complete, so one more bucket is filling; stage 3 reduces a unit's groups when backward
    has gone through the unit, so all buckets of the unit are filling, and the root unit's
    until the end of backward. Stage 3 keeps gathered at most ``stage3_max_live_parameters``
    elements through prefetching and reuse, plus the unit being computed, never more than
    the whole model. In a pipeline (``pipeline``) the stage's gradients are accumulated whole over
    the step and stage 3 keeps the whole stage gathered for it (``engine/pipeline.py``).
    """
    trained = model.trainable_params
    group = min(trained, max(reduce_bucket_size, model.largest_param or 0))
    stage2 = min(trained, (MAX_BUCKETS_IN_FLIGHT + 1) * group)
    bucket_note = (f"stage 2: {_num(stage2)} elements x {p} bytes: {MAX_BUCKETS_IN_FLIGHT} "
                   f"flat-group buckets in flight + 1 filling, each up to {_num(group)} elements "
                   f"(reduce_bucket_size {_num(reduce_bucket_size)})")
    if model.largest_unit is None:
        stage3 = stage2
        bucket_note += "; stage 3 the same (unit sizes are unknown for a bare parameter count)"
    else:
        filling = (model.largest_unit or 0) + (model.root_unit or 0)
        stage3 = min(trained, MAX_BUCKETS_IN_FLIGHT * group + filling)
        bucket_note += (f"; stage 3: {_num(stage3)} elements: {MAX_BUCKETS_IN_FLIGHT} in flight + "
                        "the largest unit's and the root unit's buckets filling")
    bucket_note += "; never more than the trainable parameters"
    if model.largest_unit is None:
        gathered = min(model.params, max_live_parameters)
        how = "plus the unit being computed (unit sizes are unknown for a bare parameter count)"
    else:
        live = max(model.root_unit or 0, max_live_parameters)
        gathered = min(model.params, live + model.largest_unit)
        how = (f"plus the unit being computed (the largest has {_num(model.largest_unit)} elements; "
               f"the root unit, gathered throughout, {_num(model.root_unit or 0)})")
    gathered_note = (f"{_num(gathered)} elements x {p} bytes: up to stage3_max_live_parameters "
                     f"{_num(max_live_parameters)} stay gathered (prefetch, reuse), {how}; "
                     "never more than the whole model")
    if pipeline:
        # a pipeline step accumulates its micro-batches' gradients whole (no_sync) and reduces them once
        # after the last, through buckets; stage 3 holds the stage's parameters gathered all the while
        whole = trained + MAX_BUCKETS_IN_FLIGHT * group
        stage2 = stage3 = min(2 * trained, whole)
        bucket_note = (f"pipeline: {_num(trained)} elements x {p} bytes of the stage's gradients, accumulated "
                       f"whole over the step's micro-batches and reduced once after the last, plus "
                       f"{MAX_BUCKETS_IN_FLIGHT} buckets in flight then")
        gathered = model.params
        gathered_note = (f"pipeline: the stage's {_num(gathered)} elements x {p} bytes, gathered once for all "
                         "the step's micro-batches")
    return Buffers(stage2 * p, stage3 * p, bucket_note, gathered * p, gathered_note)

"""What each ZeRO stage shards, and when each collective runs — as data.

The engine is one machine for every stage; a ``StagePolicy`` tells it:

* where optimizer state lives (the whole buffer, or this rank's 1/N shard);
* where gradients live between backward and step (a full buffer, or a shard);
* how gradients are reduced (all-reduce, or reduce-scatter), how often (once per
  accumulation boundary, or after every micro-batch) and when in backward (as a group
  completes, or as backward leaves a stage-3 unit);
* whether updated shards are all-gathered after the step.

The engine and the reducer tell stages apart by these fields, never by the state of a buffer.

What happens to a gradient, stage by stage (``engine.py`` runs the step, ``reduce.py`` the
reduction; ``collectives.py`` moves the bytes):

=====  ====================  ===================================  =========================
stage  gradient storage      reduction                            after the optimizer step
=====  ====================  ===================================  =========================
0      full buffer           all-reduce, at the boundary backward nothing (all ranks updated)
1      full buffer           reduce-scatter, at the boundary      all-gather the parameters
2      shard (+ buckets in   reduce-scatter of each bucket as it  all-gather the parameters
       flight in backward)   fills, in every micro-batch
3      as stage 2            as stage 2, but each unit's buckets  nothing: parameters stay
                             are launched when backward has gone  shards, gathered per unit
                             through the unit                     around its forward and
                                                                  backward (``gather.py``)
=====  ====================  ===================================  =========================

"gradient storage" is ``full_gradient_buffer``; launching per unit is ``reduces_per_unit``.
At stages 0 and 1 gradients of the micro-batches accumulate locally in the full buffer and
are communicated once per optimizer step; stage 2 has no full buffer to accumulate into, so it
reduces every micro-batch (more traffic under accumulation, 1/N the gradient memory).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    stage: int
    shard_optimizer: bool
    """Optimizer state (and fp32 masters) for this rank's 1/N shard only."""
    shard_gradients: bool
    """Only this rank's gradient shard persists between backward and step."""
    shard_parameters: bool
    """Parameters persist as this rank's shard only, gathered around use (stage 3)."""
    reduction: str
    """``"all_reduce"`` or ``"reduce_scatter"``."""
    reduce_every_micro_batch: bool
    """Reduce in every backward, not only in the accumulation boundary's."""

    @property
    def full_gradient_buffer(self) -> bool:
        """Gradients accumulate in a full-size gradient buffer per group, which ``p.grad``
        views and which is reduced in place (stages 0-1); otherwise each reduction fills a
        temporary bucket and only this rank's gradient shard is kept (stages 2-3)."""
        return not self.shard_gradients

    @property
    def reduces_per_unit(self) -> bool:
        """Gradients are reduced per stage-3 unit, when backward has gone through it, not per
        group as soon as its last gradient arrives (see ``reduce.py``)."""
        return self.shard_parameters

    @property
    def gather_after_step(self) -> bool:
        """Whether updated shards must be all-gathered into the full parameters."""
        return self.shard_optimizer and not self.shard_parameters


POLICIES: dict[int, StagePolicy] = {
    0: StagePolicy(0, shard_optimizer=False, shard_gradients=False, shard_parameters=False,
                   reduction="all_reduce", reduce_every_micro_batch=False),
    1: StagePolicy(1, shard_optimizer=True, shard_gradients=False, shard_parameters=False,
                   reduction="reduce_scatter", reduce_every_micro_batch=False),
    2: StagePolicy(2, shard_optimizer=True, shard_gradients=True, shard_parameters=False,
                   reduction="reduce_scatter", reduce_every_micro_batch=True),
    3: StagePolicy(3, shard_optimizer=True, shard_gradients=True, shard_parameters=True,
                   reduction="reduce_scatter", reduce_every_micro_batch=True),
}


def policy_for(stage: int) -> StagePolicy:
    """The policy of ``stage``."""
    if stage not in POLICIES:
        raise ValueError(f"zero_optimization.stage: got {stage}; allowed: 0, 1, 2, 3")
    return POLICIES[stage]

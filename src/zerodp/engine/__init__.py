"""The engine: one training step told from start to end, over the parts in ``core/`` (flat groups,
the reducer, stage 3's ``ShardedParams``, the optimizer's shards), with what ``offload/``,
``parallel/`` and ``checkpoint/`` add behind their interfaces.

* ``engine.py``: ``ZeroEngine``, set-up and the verbs forward, backward, step;
* ``engine_api.py``: ``EngineAPI``, the rest of DeepSpeed's engine API (thin delegations);
* ``pipeline.py``: ``PipelineEngine``, the same engine running torch's pipeline schedules.

This package sits above every other one it uses, so none of them imports it back.
"""
from .engine import ZeroEngine
from .pipeline import PipelineEngine

__all__ = ["ZeroEngine", "PipelineEngine"]

"""Per-rank memory estimates for ZeRO training: ``zerodp estimate`` and ``zerodp.estimate``.

Given a model (a parameter count such as ``7.5B``, a factory ``module:function`` or a
``transformers`` config, both built on the meta device), the number of ranks, the precision
and the optimizer, :func:`estimate` computes the model-state memory every rank holds at each
ZeRO stage, with and without offload, adds the buffers zerodp allocates on top (gradient
buckets, stage-3 gathered parameters) and, for known transformer shapes, activations; it then
says which configurations fit and recommends the fastest one that does; given a cluster, it
predicts each one's step time too (``timing.py``) and recommends by it.

Three accountings (bytes per parameter element; Ψ parameters, N ranks):

* ``mixed`` (the ZeRO paper's): 16-bit parameters 2, 16-bit gradients 2, and K bytes of
  optimizer state: an fp32 master copy 4 plus the fp32 optimizer states (Adam: m 4 + v 4,
  K = 12). Stage 0 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N.
* ``no-master``: 16-bit parameters and gradients and fp32 optimizer states, no fp32 master
  copy (Adam: 12Ψ at stage 0).
* ``fp32``: parameters 4, gradients 4, optimizer states 4 per state value; the parameters
  are the master weights.

``memory_check.compare_with_engine`` sets the estimate for a live engine beside the engine's
own ledger (``engine.memory_breakdown()``); they agree up to the padding of flat groups.

The modules, in the order :func:`estimate` uses them:

* ``inputs.py``      :class:`EstimateError`, counts and sizes read from text, the config's defaults
* ``accounting.py``  precisions, optimizers, bytes per parameter element, the per-stage formulas
* ``model.py``       the model: a count, a module, a factory or a transformers config; its units
* ``activations.py`` activations of a known transformer shape
* ``buffers.py``     gradient buckets and stage 3's gathered parameters
* ``stages.py``      one row per stage and offload: memory per rank and whether it fits
* ``cluster.py``     :class:`Cluster`: presets, JSON files and ``local`` (probed) for step times
* ``timing.py``      :class:`StepTime`: the model of one step's time on a cluster
* ``recommend.py``   :func:`estimate` and the recommendation
* ``report.py``      :class:`Estimate`, the result, and the report as text
"""
# ruff: noqa: F401 - the names of every module stay importable from the package
from __future__ import annotations

from .accounting import ACCOUNTINGS, FP32, OPTIMIZERS, PRECISIONS, Accounting, OptimizerSpec, make_accounting
from .activations import (
                         ACTIVATION_ASSUMPTIONS,
                         ACTIVATION_FORMULA,
                         Activations,
                         estimate_activations,
                         layer_activation_bytes,
)
from .buffers import Buffers, estimate_buffers
from .cluster import PRESETS as CLUSTERS
from .cluster import Cluster, probe_local, resolve_cluster
from .inputs import (
                         DEFAULT_MAX_LIVE,
                         DEFAULT_PERSISTENCE,
                         DEFAULT_REDUCE_BUCKET,
                         GB,
                         EstimateError,
                         parse_count,
                         parse_memory,
)
from .model import ModelInfo, TransformerShape, describe_model, resolve_model, transformer_shape
from .recommend import RECOMMENDATION_ORDER, Estimate, estimate
from .report import format_estimate
from .stages import ROW_KEYS, Row, estimate_row
from .timing import Job, StepTime, forward_flops

__all__ = ["estimate", "Estimate", "Row", "ModelInfo", "TransformerShape", "Accounting",
           "OptimizerSpec", "Activations", "EstimateError", "OPTIMIZERS",
           "PRECISIONS", "ACCOUNTINGS", "parse_count", "parse_memory", "describe_model", "Cluster", "CLUSTERS",
           "StepTime", "resolve_cluster"]

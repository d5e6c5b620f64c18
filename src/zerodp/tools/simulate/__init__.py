"""``zerodp simulate``: one rank of a job of N ranks, run for real in one process.

torch's fake process group (backend ``fake``) lets this process be rank r of N: every collective
returns at once without moving data, but every tensor the rank would allocate is allocated. The
simulation builds the model as that rank would (at stage 3 one unit at a time, keeping only its
shard; with tensor parallelism only its slice), runs zerodp's own engine for a few optimizer
steps on a tiny batch, and measures the last one:

* the engine's ledger (``engine.memory_breakdown()``): parameters, gradients, master weights,
  optimizer states, and the peaks of the gradient buckets and of stage 3's gathered parameters;
* the peak of all bytes allocated on the compute device at once (``tracker.PeakMemory``);
* the collectives the engine issued and the bytes it sent, per process group (``comm_stats``);

and sets ``zerodp estimate``'s row for the same job beside them.

What a fake group cannot show: time (collectives finish at once, so a reduction never stays in
flight: the simulated gradient buckets are those of a network faster than compute, the estimate's
those of the slowest) and values (parameters are zeros). A pipeline stage runs as a one-stage
pipeline over its own ranks (``pipeline.py`` says why and what that changes). See docs/estimate.md.

The modules: ``tracker.py`` (peak bytes), ``build.py`` (the rank's model), ``pipeline.py`` (a
decoder's pipeline stage), ``run.py`` (:func:`simulate`, :class:`Simulation`), ``report.py``
(the table), ``command.py`` (the command's options).
"""
from __future__ import annotations

from .report import format_simulation
from .run import OFFLOADS, PRECISIONS, Simulation, simulate

__all__ = ["simulate", "Simulation", "format_simulation", "OFFLOADS", "PRECISIONS"]

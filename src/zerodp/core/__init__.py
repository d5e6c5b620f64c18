"""The engine: the training step and what it is made of.

``engine`` (forward, backward, step), ``reduce`` (gradient reduction), ``gather`` (stage-3
units: gather, release, prefetch), ``param_api`` (``GatheredParameters``,
``register_external_parameter``), ``flat`` (flat groups), ``stages`` (what each stage shards,
as data), ``precision``, ``collectives`` (every collective, with byte counts), ``assemble``
(building the engine's pieces), ``norm`` (the step's global gradient norm), ``memory``
(the ledger), ``plain_loop`` (``loss.backward();
optimizer.step()``), ``data`` (the resumable loader), ``device`` (device and backend choice),
``view`` (``CheckpointView``: what a checkpoint reads and writes of an engine).
See ``docs/architecture.md``.
"""

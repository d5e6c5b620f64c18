"""Checkpoints: sharded, atomic, loadable at any world size and stage, from DeepSpeed too.

A checkpoint directory holds one directory per tag and a ``latest`` file naming the newest:

    ckpt/latest                       "global_step100"
    ckpt/global_step100/index.json    every parameter's shape, dtype and pieces; step counts,
                                      scheduler, loss scale, data position, client_state
    ckpt/global_step100/rank00000.safetensors, rank00000.json, rank00001...   one per rank

The modules, in the order a save or load uses them:

* ``layout.py``    what each rank writes of an engine, and the index
* ``tensorfile.py`` safetensors files written as a stream with a CRC per block; range reads
* ``state.py``     JSON (plus tensors) for everything that is not a parameter; RNG states
* ``coord.py``     agreement between ranks, so a failure on one rank reaches all
* ``save.py``      per-rank writes, atomic commit, asynchronous save
* ``source.py``    a checkpoint opened for reading, whatever wrote it
* ``load.py``      finding the tag, zerodp's reader, resharding into an engine
* ``deepspeed.py`` DeepSpeed's checkpoints as a source: their metadata and reads
* ``deepspeed_files.py`` their files, recognised and checked (allow-listed unpickling)
* ``deepspeed_layout.py`` where each parameter lies in their ZeRO partitions
* ``consolidate.py`` full weights, streamed; DeepSpeed's zero_to_fp32 names; save_16bit_model

An engine is seen only through its ``CheckpointView`` (``core/view.py``,
``engine.checkpoint_view()``), which declares everything a save or load reads and writes; no
module here imports the engine.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from ..core.view import CheckpointView
from .consolidate import consolidate, get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint
from .coord import Coordinator
from .load import list_tags, load_into_engine, open_source, resolve_tag_dir
from .source import CheckpointError, Source

__all__ = ["CheckpointError", "Source", "consolidate", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint", "list_tags", "open_source", "resolve_tag_dir",
           "load_checkpoint"]

logger = logging.getLogger("zerodp")


def load_checkpoint(view: CheckpointView, load_dir, tag: Optional[str] = None, *,
                    load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """``engine.load_checkpoint``, given ``engine.checkpoint_view()``: returns ``(path,
    client_state)``, or ``(None, None)`` when ``tag`` is None and ``load_dir`` has no ``latest``
    file (DeepSpeed's behaviour, so a script can call it unconditionally to resume)."""
    coord = Coordinator(view.ranks.coord_comm)
    err, tag_dir, src = None, None, None
    try:
        tag_dir = resolve_tag_dir(load_dir, tag)
        if tag_dir is not None:
            src = open_source(tag_dir)
    except Exception as e:  # noqa: BLE001 - reported to every rank
        err = e
    coord.agree(err, f"opening checkpoint in {load_dir}")
    found = coord.same_everywhere(int(tag_dir is not None))
    if len(set(found)) > 1:
        raise CheckpointError(f"{Path(load_dir) / 'latest'} exists on ranks "
                              f"{[r for r, f in enumerate(found) if f]} only; the checkpoint directory "
                              "must be one directory every rank can read")
    if tag_dir is None:
        if view.ranks.writer_rank == 0:  # the first start of a script that always tries to resume
            logger.info("no checkpoint to resume from: %s has no 'latest' file", load_dir)
        return None, None
    try:
        client_state = load_into_engine(view, src, strict=load_module_strict,
                                        load_optimizer_states=load_optimizer_states,
                                        load_lr_scheduler_states=load_lr_scheduler_states,
                                        load_module_only=load_module_only)
    finally:
        src.close()
    if view.ranks.writer_rank == 0:
        logger.info("loaded %s; resuming at step %d", src.describe(), view.global_steps)
    return str(tag_dir), client_state

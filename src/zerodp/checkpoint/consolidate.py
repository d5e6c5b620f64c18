"""Full weights out of a sharded checkpoint, and out of a running engine.

:func:`consolidate` writes a checkpoint's parameters (and buffers) as plain full tensors in
safetensors files (a packed 4-bit weight as its codes, in the dtype they are stored in and never
cast, beside its quantization state under the names ``state_dict()`` of a bitsandbytes model gives
it: the form of a pre-quantized checkpoint, which bitsandbytes dequantizes and transformers
loads), ``model.safetensors`` or, above ``max_shard_size``, ``model-0000k-of-0000n
.safetensors`` with the ``model.safetensors.index.json`` that ``transformers`` reads. It
streams: each tensor is read from the ranks' files and converted a chunk of
``CHUNK_ELEMENTS`` at a time, so peak memory stays about one chunk (tens of MB), whatever
the model or tensor size. It reads zerodp and DeepSpeed checkpoints alike (any ``Source``).
A ``config.json`` found in the checkpoint directory is copied beside the weights.

:func:`get_fp32_state_dict_from_zero_checkpoint` and
:func:`load_state_dict_from_zero_checkpoint` are DeepSpeed's names for the in-memory form.
:func:`save_16bit_model` is ``engine.save_16bit_model``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Iterator, Optional

import torch

from ..core.axes import DATA
from ..core.view import CheckpointView
from .coord import Coordinator
from .layout import persistent_buffers
from .load import open_source, resolve_tag_dir
from .save import INDEX
from .source import VALUE, CheckpointError, Read, Source
from .tensorfile import TensorSpec, TensorWriter, write_tensors

logger = logging.getLogger("zerodp")

CHUNK_ELEMENTS = 4 << 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
#: Files copied next to the weights when found in the checkpoint directory (a transformers
#: model's config), so that ``from_pretrained`` loads the output directory as it is.
MODEL_FILES = ("config.json", "generation_config.json")


def parse_size(text) -> int:
    """``"5GB"``, ``"500MB"``, ``"10GiB"`` or a number of bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r}: expected a number of bytes or e.g. 5GB, 500MB, 10GiB")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


def open_checkpoint(checkpoint_dir, tag: Optional[str] = None) -> Source:
    """A checkpoint given as its directory (with ``latest``, or ``tag``) or as a tag directory."""
    d = Path(checkpoint_dir)
    if tag is None and ((d / INDEX).is_file() or _is_deepspeed(d)):
        return open_source(d)
    tag_dir = resolve_tag_dir(d, tag)
    if tag_dir is None:
        raise CheckpointError(f"{d}: no 'latest' file naming a checkpoint tag and no tag given "
                              "(pass tag=, or the tag directory itself)")
    return open_source(tag_dir)


def _is_deepspeed(d: Path) -> bool:
    from .deepspeed import is_deepspeed_checkpoint
    return is_deepspeed_checkpoint(d)


def _tensor_list(src: Source, exclude_frozen: bool = False) -> list[tuple[str, str, tuple, torch.dtype]]:
    """(output name, checkpoint name, shape, stored dtype) of every parameter, alias and buffer."""
    out = []
    alias_of: dict[str, list[str]] = {}
    for alias, canon in src.aliases.items():
        alias_of.setdefault(canon, []).append(alias)
    for name, info in src.params.items():
        if exclude_frozen and info.param_group is None:
            continue
        for out_name in [name, *alias_of.get(name, [])]:
            out.append((out_name, name, tuple(info.shape), info.dtype))
    return out


def _chunks(src: Source, name: str, numel: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    for lo in range(0, numel, CHUNK_ELEMENTS):
        hi = min(lo + CHUNK_ELEMENTS, numel)
        buf = torch.empty(hi - lo, dtype=src.params[name].dtype)
        src.read([Read(name, VALUE, lo, hi, buf)])
        yield buf if buf.dtype == dtype else buf.to(dtype)


def consolidate(checkpoint_dir, output_dir, tag: Optional[str] = None, dtype: Optional[str] = None,
                max_shard_size="5GB", progress: bool = False, exclude_frozen_parameters: bool = False
                ) -> list[Path]:
    """Write a checkpoint's full weights as safetensors into ``output_dir`` (see module
    docstring); ``dtype`` ``fp32``/``bf16``/``fp16`` casts floating tensors (default: the
    dtype each is stored in: fp32 for trained parameters). Returns the files written."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    limit = parse_size(max_shard_size)
    out_dir = Path(output_dir)
    with open_checkpoint(checkpoint_dir, tag) as src:
        def target(stored: torch.dtype, name: Optional[str] = None) -> torch.dtype:
            cast = dtype is not None and stored.is_floating_point and name not in src.packed
            return DTYPES[dtype] if cast else stored
        items = [(o, n, shape, target(d, n)) for o, n, shape, d in _tensor_list(src, exclude_frozen_parameters)]
        buffers = {n: b for n, b in src.read_buffers().items()}
        for n, b in buffers.items():
            items.append((n, None, tuple(b.shape), target(b.dtype)))
        if not exclude_frozen_parameters:  # the quantization state of packed weights, as stored
            for n, t in src.read_packed_states().items():
                buffers[n] = t
                items.append((n, None, tuple(t.shape), t.dtype))
        shards: list[list] = [[]]
        size = 0
        for item in items:
            nbytes = TensorSpec(item[0], item[3], item[2]).nbytes
            if shards[-1] and size + nbytes > limit:
                shards.append([])
                size = 0
            shards[-1].append(item)
            size += nbytes
        out_dir.mkdir(parents=True, exist_ok=True)
        names = [WEIGHTS] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        total = sum(TensorSpec(o, d, s).nbytes for o, _, s, d in items)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="B", unit_scale=True, desc="consolidate", file=__import__("sys").stderr)
        written = []
        try:
            for fname, shard in zip(names, shards):
                specs = [TensorSpec(o, d, s) for o, _, s, d in shard]
                by_name = {o: (n, s, d) for o, n, s, d in shard}
                w = TensorWriter(out_dir / (fname + ".tmp"), specs, metadata={"format": "pt"})
                try:
                    for spec in w.order:
                        n, _, d = by_name[spec.name]
                        parts = [buffers[spec.name].to(d).reshape(-1)] if n is None \
                            else _chunks(src, n, spec.numel, d)
                        w.write(spec.name, _counted(parts, bar))
                except BaseException:
                    w.abort()
                    raise
                w.close()
                os.replace(out_dir / (fname + ".tmp"), out_dir / fname)
                written.append(out_dir / fname)
        finally:
            if bar is not None:
                bar.close()
        for extra in MODEL_FILES:  # a transformers model's config saved beside the checkpoints
            for where in (Path(checkpoint_dir), src.path):
                if (where / extra).is_file() and not (out_dir / extra).exists():
                    shutil.copyfile(where / extra, out_dir / extra)
                    written.append(out_dir / extra)
        if len(shards) > 1:
            weight_map = {o: fname for fname, shard in zip(names, shards) for o, *_ in shard}
            (out_dir / WEIGHTS_INDEX).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2), encoding="utf-8")
            written.append(out_dir / WEIGHTS_INDEX)
        return written


def _counted(parts, bar) -> Iterator[torch.Tensor]:
    for p in parts:
        if bar is not None:
            bar.update(p.numel() * p.element_size())
        yield p


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """The checkpoint's full fp32 weights (and buffers) in memory, by name, as DeepSpeed's
    function of that name returns them; tied parameters appear under each name, sharing
    one tensor. A packed 4-bit weight comes as its codes in their stored dtype, with its
    quantization state (see module docstring). ``lazy_mode`` is accepted for compatibility
    (tensors are always read)."""
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    with open_checkpoint(checkpoint_dir, tag) as src:
        cache: dict[str, torch.Tensor] = {}
        for out_name, name, shape, stored in _tensor_list(src, exclude_frozen_parameters):
            if name not in cache:
                as_fp32 = stored.is_floating_point and name not in src.packed
                full = torch.empty(shape, dtype=torch.float32 if as_fp32 else stored)
                src.read([Read(name, VALUE, 0, full.numel(), full.view(-1))])
                cache[name] = full
            out[out_name] = cache[name]
        for n, b in src.read_buffers().items():
            out[n] = b
        if not exclude_frozen_parameters:
            out.update(src.read_packed_states())
    return out


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag: Optional[str] = None):
    """Load the checkpoint's fp32 weights into ``model`` (moved to the CPU, as DeepSpeed's
    function does); returns the model."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def consolidated_16bit_state_dict(view: CheckpointView, exclude_frozen_parameters: bool = False
                                  ) -> "OrderedDict[str, torch.Tensor]":
    """The full model's weights in the compute dtype (gathered group by group at stage 3, a
    split parameter's tensor-parallel slices put together; packed 4-bit weights as their codes,
    with their quantization state) and persistent buffers, on the CPU,
    in the module's state-dict order, on rank 0; an empty dict on the other ranks. Every rank
    must call it. Under a pipeline each stage's first rank puts its stage's part together and
    rank 0 receives them in stage order (a tied weight once, from its first stage)."""
    first = view.ranks.stage_first
    state = _stage_16bit_state_dict(view, first, exclude_frozen_parameters)
    if view.ranks.pipe_size == 1 or not first:
        return state
    parts = view.ranks.pipe_comm.gather_objects(state)
    if view.ranks.writer_rank != 0:
        return OrderedDict()
    whole: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for part in parts:
        for name, value in part.items():
            whole.setdefault(name, value)
    return whole


def _stage_16bit_state_dict(view: CheckpointView, first: bool, exclude_frozen_parameters: bool
                            ) -> "OrderedDict[str, torch.Tensor]":
    """This module's part (the whole model without a pipeline) on ``first``; empty elsewhere."""
    state: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    aliases: dict[int, list[str]] = {}
    for name, p in view.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    experts = view.experts
    for g in view.flat_groups:
        if exclude_frozen_parameters and not g.trainable:
            continue
        gathered_here = g.shards_parameters and not g.gathered
        if gathered_here:
            view.shard_axes.gather(g)
        names = [experts.names_on(t) for t in range(experts.ep_size)] if g.axis != DATA else None
        for i, (slot, p) in enumerate(zip(g.slots, g.params)):
            value = g.view(g.full, i).detach()
            if names is not None:  # experts: every expert-parallel rank's, under the names of the unsplit model
                parts = experts.comm.all_gather_list(value.contiguous())
                if first and slot.tp is not None:
                    whole = torch.empty(slot.tp.shape, dtype=value.dtype)
                    for t, part in enumerate(parts):
                        slot.tp.place(whole, part.cpu(), t)
                    state[slot.name] = whole
                elif first:
                    for t, part in enumerate(parts):
                        state[names[t].get(slot.name, slot.name)] = part.to("cpu", copy=True)
                continue
            if slot.tp is not None:  # every tensor rank's slice, put in its place
                slices = view.ranks.tensor_comm.all_gather_list(value)
                if first:
                    whole = torch.empty(slot.tp.shape, dtype=value.dtype)
                    for t, part in enumerate(slices):
                        slot.tp.place(whole, part.cpu(), t)
                    value = whole
            if first:
                value = value.to("cpu", copy=True)
                for name in aliases.get(id(p), [slot.name]):
                    state[name] = value
        if gathered_here:
            g.release()
    if not first:
        return state
    managed = {id(p) for g in view.flat_groups for p in g.params}
    for name, p in view.module.named_parameters():
        if id(p) not in managed and not (exclude_frozen_parameters and not p.requires_grad):
            state[name] = p.detach().to("cpu", copy=True)
    for name, b in persistent_buffers(view.module).items():
        state[name] = b.detach().to("cpu", copy=True)
    if not exclude_frozen_parameters:  # packed 4-bit weights' quantization state, as state_dict() has it
        for states in view.packed_states().values():
            state.update(states)
    order = [k for k in view.module.state_dict().keys() if k in state]
    return OrderedDict((k, state[k]) for k in order + [k for k in state if k not in order])


def save_16bit_model(view: CheckpointView, save_dir, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Gather the full weights in the compute dtype and write them from rank 0 (see
    ``ZeroEngine.save_16bit_model``)."""
    coord = Coordinator(view.ranks.coord_comm)
    state = consolidated_16bit_state_dict(view, exclude_frozen_parameters)
    err = None
    if view.ranks.writer_rank == 0:
        try:
            path = Path(save_dir)
            path.mkdir(parents=True, exist_ok=True)
            target = path / save_filename
            tmp = path / (save_filename + ".tmp")
            if save_filename.endswith(".safetensors"):
                write_tensors(tmp, {k: v.contiguous() for k, v in state.items()}, metadata={"format": "pt"})
            else:
                torch.save(state, tmp)
            os.replace(tmp, target)
            logger.info("saved %d tensors (%s) to %s", len(state), view.compute_dtype, target)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            err = e
    coord.agree(err, f"save_16bit_model to {save_dir}")
    return True

"""Packed 4-bit parameters at stage 3: bitsandbytes' ``Params4bit``, loaded sharded and kept with
their quantization state.

A 4-bit weight (QLoRA's base) is a parameter whose data are the packed 4-bit codes, stored in the
``bnb_4bit_quant_storage`` dtype, and whose ``quant_state`` (bitsandbytes' ``QuantState``: the
per-block ``absmax``, the code book ``quant_map``, the weight's shape and dtype, the block size, and
with double quantization a nested state of its own) says how to read them. The engine lays out and
shards the packed data like any frozen parameter; the quantization state is small (an eighth of the
codes' bytes, about a thirtieth with double quantization) and stays whole on every rank, on the
parameter object, which is kept through every step of stage 3 (a parameter the engine replaces keeps
its class and attributes, :func:`empty_like_packed`).

What this module gives:

* :class:`ShardedLoad` (``zerodp.zero.ShardedLoad``): the context to call ``from_pretrained`` in,
  so that each rank keeps only its slice of every packed weight as transformers loads it, one
  tensor at a time (transformers builds a quantized model on the meta device and skips
  ``zero.Init``, so without it every rank holds the whole 4-bit model until ``initialize``);
* :func:`packed_states` / :func:`restore_packed_states`: the quantization state as the tensors
  ``model.state_dict()`` of a bitsandbytes model writes beside each weight (``<weight>.absmax``,
  ``<weight>.quant_map``, ``<weight>.nested_absmax``, ``<weight>.nested_quant_map``,
  ``<weight>.quant_state.bitsandbytes__nf4``), which checkpoints save with the packed weights,
  load back, and write out when consolidated;
* :func:`is_packed`, which precision casts and consolidation read so as never to cast packed codes;
* :func:`undo_cpu_repacking`, which a save calls first: bitsandbytes rewrites a weight's codes for
  its CPU kernels in an eval-mode forward, and a checkpoint must hold the standard layout.

The codes may be stored in any dtype (``bnb_4bit_quant_storage``: the model's dtype, or bitsandbytes'
default ``uint8``, which lays out in a flat group of its own). Only bitsandbytes' 4-bit weights are
packed parameters here; 8-bit bases (``load_in_8bit``) train exactly as ordinary frozen weights, but
bitsandbytes keeps a whole copy of each beside it, which stage 3 cannot shard
(:func:`held_whole_by_bitsandbytes`; the engine says so at ``initialize``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .collectives import Comm
from .init_shards import has_no_values, keep_own_slice

_ENGINE_ATTRS = ("ds_", "_zerodp")  # the engine's own attributes on a parameter: not carried over


def is_packed(param: torch.Tensor) -> bool:
    """Whether ``param`` holds packed 4-bit codes with their quantization state (a quantized
    bitsandbytes ``Params4bit``)."""
    return type(param).__name__ == "Params4bit" and param.__dict__.get("bnb_quantized", False) \
        and param.__dict__.get("quant_state") is not None


def empty_like_packed(old: nn.Parameter, empty: torch.Tensor) -> nn.Parameter:
    """A parameter of ``old``'s class and attributes (its quantization state, block size, module)
    whose data is ``empty``: what replaces a packed parameter kept as a slice when the engine lays
    it out, so that the layer still finds a ``Params4bit`` with its ``quant_state``."""
    new = torch.Tensor._make_subclass(type(old), empty, old.requires_grad)
    new.__dict__.update({k: v for k, v in old.__dict__.items() if not k.startswith(_ENGINE_ATTRS)})
    return new


def packed_states(module: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Every packed parameter's quantization state, by the parameter's name: the tensors (on the
    CPU) that ``state_dict()`` writes beside the weight, named as it names them
    (``<weight>.absmax`` ...; the non-tensor items packed in ``<weight>.quant_state.bitsandbytes__<type>``)."""
    out = {}
    for name, p in module.named_parameters():
        if is_packed(p):
            state = p.quant_state.as_dict(packed=True)
            out[name] = {f"{name}.{k}": v.detach().to("cpu", copy=True) for k, v in state.items()}
    return out


def restore_packed_states(module: nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Give each packed parameter of ``module`` the quantization state in ``tensors`` (named as
    :func:`packed_states` names them), on its own device; returns the parameters restored. A packed
    parameter with no state in ``tensors`` keeps its own. bitsandbytes is imported only when a
    packed parameter has a state to restore: a model without one loads where it is not installed."""
    done = []
    for name, p in module.named_parameters():
        if not is_packed(p):
            continue
        prefix = name + "."
        mine = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not mine:
            continue
        from bitsandbytes.functional import QuantState

        device = p.quant_state.absmax.device
        state = QuantState.from_dict(qs_dict=mine, device=device)
        p.quant_state = state
        if p.__dict__.get("module") is not None:
            p.module.quant_state = state
        done.append(name)
    return done


def held_whole_by_bitsandbytes(module: nn.Module) -> Optional[str]:
    """What stage 3 cannot shard of ``module``'s 8-bit weights (LLM.int8, bitsandbytes' ``Int8Params``),
    said for the user, or None without such weights: bitsandbytes keeps each one whole beside the
    parameter (``weight.CB``, then the layer's ``state.CB``) and computes from that copy, so training
    is exact at any stage but every rank holds them whole."""
    whole = [(n, p.numel() * p.element_size()) for n, p in module.named_parameters()
             if type(p).__name__ == "Int8Params" and getattr(p, "CB", None) is not None]
    if not whole:
        return None
    return (f"stage 3: bitsandbytes keeps each of the {len(whole)} 8-bit weights of this model ({whole[0][0]}, ...) "
            f"whole on every rank (weight.CB, state.CB: {sum(b for _, b in whole) / 2**20:.3g} MiB) and computes "
            "from that copy, so stage 3 shards only the engine's own copy of them; training is exact. For a base "
            "that stage 3 shards, load it in 4 bits: BitsAndBytesConfig(load_in_4bit=True, "
            "bnb_4bit_quant_storage=<the model's dtype>)")


def undo_cpu_repacking(module: nn.Module, gathered: Callable[[list], Any]) -> list[str]:
    """Give back the standard layout to 4-bit weights that bitsandbytes repacked for its CPU kernels
    (in eval mode, on a CPU with AVX512-BF16, the first forward rewrites a weight's codes and its
    quantization state, and marks the state ``packing_format_for_cpu``), as bitsandbytes' own
    ``state_dict()`` does before it writes them: a checkpoint then holds codes and a state that any
    machine reads. Each such weight is gathered for it (``gathered``: ``GatheredParameters``, which
    keeps the data assigned inside); every rank holds the same marks, so they gather the same
    weights. Returns the names of the weights given back."""
    repacked = [(n, p) for n, p in module.named_parameters()
                if is_packed(p) and getattr(p.quant_state, "packing_format_for_cpu", False)]
    if not repacked:
        return []
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse
    for _, p in repacked:
        with gathered([p]):
            p.data, p.quant_state = _convert_weight_packed_for_cpu_inverse(p.data, p.quant_state)
    return [n for n, _ in repacked]


class ShardedLoad:
    """Load a 4-bit model sharded: inside, every packed weight a module receives keeps only this
    rank's slice of its codes as soon as it is set (its quantization state whole), as if it had
    been built in ``zero.Init``; ``zerodp.initialize`` at stage 3 then takes the slices.

        with zerodp.zero.ShardedLoad():
            model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb, dtype=dtype)

    transformers reads and quantizes one weight at a time (from a full-precision checkpoint, or
    reads a pre-quantized one's packed weight and its state), so a rank holds at most one weight's
    full codes (and, quantizing, its full-precision values) beside its slices. Every rank reads
    the same files and quantizes alike, so each cuts its own slice without communication; on
    exit the ranks check that they kept the same weights. Other parameters (embeddings, norms, an
    unquantized output layer) stay whole until ``initialize`` shards them, rank 0's values.

    ``data_parallel_group``: the ranks that share the slices (the world by default); give
    ``initialize`` the same one. Not re-entrant; one model is loaded at a time."""

    def __init__(self, data_parallel_group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = data_parallel_group
        self._comm: Optional[Comm] = None
        self._handle = None
        self.kept: list[tuple[int, int]] = []  # (elements, slice elements) of each weight kept as a slice

    def _on_register(self, module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is None or not is_packed(param) or has_no_values(param):
            return None
        keep_own_slice(param, self._comm)
        self.kept.append((int(param.ds_numel), param.ds_tensor.numel()))
        return None

    def __enter__(self) -> "ShardedLoad":
        from torch.nn.modules.module import register_module_parameter_registration_hook

        if self._handle is not None:
            raise RuntimeError("ShardedLoad is not re-entrant")
        self._comm = Comm(self.group)
        self.kept = []
        self._handle = register_module_parameter_registration_hook(self._on_register)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._handle.remove()
        self._handle = None
        if exc_type is not None:
            return
        mine = [len(self.kept), sum(n for n, _ in self.kept)]
        every = self._comm.all_gather_objects(mine)
        if any(other != mine for other in every):
            raise RuntimeError(
                f"ShardedLoad: the ranks kept different 4-bit weights (weights, elements per rank: {every}); "
                "every rank must load the same model from the same files with the same quantization config")

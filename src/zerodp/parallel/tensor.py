"""Tensor parallelism on torch's own DTensor styles, and where each slice sits in the whole tensor.

A *plan* maps module names of the model to a :class:`Split`:

* ``column``: a ``Linear`` whose output features are split over the tensor-parallel ranks (torch's
  ``ColwiseParallel``: the weight's rows, ``Shard(0)``); its input is the whole activation and
  its output this rank's slice of features. ``blocks=k`` splits a fused weight made of ``k``
  stacked blocks (attention's ``q, k, v`` in one ``c_attn``): each rank takes its slice of every
  block, so it holds whole heads of each.
* ``row``: a ``Linear`` whose input features are split (``RowwiseParallel``: the weight's columns,
  ``Shard(1)``; the bias replicated); partial outputs are summed over the ranks (all-reduce).
* ``vocab``: an ``Embedding`` whose rows (the vocabulary) are split; each rank looks up the ids it
  holds and the results are summed (``RowwiseParallel`` on an embedding).
* ``column_gather``: a column split whose output is gathered whole (an output layer whose logits
  the loss needs whole).
* ``loss_output``: a column split of the output layer whose logits stay split over the vocabulary,
  as a ``DTensor`` (``Shard(-1)``), for torch's loss-parallel cross entropy.
* ``head_norm``: a norm over each attention head's features (Qwen3's ``q_norm`` and ``k_norm``,
  input ``(batch, T, heads, head_dim)``) run on this rank's heads: its parameters replicated
  ``DTensor`` s whose gradients are partial sums over the heads (``transformers``'
  ``replicated_with_grad_allreduce``).

With ``sequence=True`` the activations outside the split layers are split along the sequence
(dimension 1; Megatron's sequence parallelism): a column split gathers its input from the
sequence slices (all-gather) and a row or vocab split reduce-scatters its output onto them.
Between them:

* ``sequence_norm``: a norm run on this rank's sequence slice (torch's ``SequenceParallel``; its
  parameters replicated ``DTensor`` s whose gradients are partial sums over the slices);
* ``sequence_positions``: a replicated module (a position embedding) whose output is cut to this
  rank's sequence slice (its gradient gathered back in backward).

``transformers``' ``Conv1D`` (GPT-2's layers, weight stored transposed) takes the same splits.
Norms, biases of row splits and everything outside the plan stay replicated (the same values
on every tensor-parallel rank).

Each split parameter has a :class:`TPSlice` saying which part of the unsplit tensor this rank
holds (recorded on its module; :func:`model_slices` lists them), which the flat groups keep for
checkpoints, consolidation and the gradient-norm rule; and the attributes Megatron and DeepSpeed
use for the same (``tensor_model_parallel``, ``partition_dim``).
"""
from __future__ import annotations

import re
import types
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..core.collectives import Comm
from ..core.flat import is_dtensor


class TensorParallelError(ValueError):
    """A model or plan that cannot be split over the tensor-parallel ranks as asked."""


@dataclass(frozen=True)
class TPSlice:
    """Which part of an unsplit parameter one tensor-parallel rank holds.

    Along ``dim`` the unsplit tensor is ``blocks`` equal blocks (1 for a plain split); rank ``r``
    of ``size`` holds slice ``r`` of ``size`` equal slices of each block, concatenated in block
    order. ``shape`` is the unsplit shape."""

    dim: int
    size: int
    rank: int
    shape: tuple[int, ...]
    blocks: int = 1

    def ranges(self, rank: Optional[int] = None) -> list[tuple[int, int]]:
        """The ``[start, stop)`` ranges along ``dim`` of the unsplit tensor that ``rank`` (default:
        this one) holds, in the order its local tensor holds them."""
        rank = self.rank if rank is None else rank
        block = self.shape[self.dim] // self.blocks
        part = block // self.size
        return [(b * block + rank * part, b * block + (rank + 1) * part) for b in range(self.blocks)]

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.dim] //= self.size
        return tuple(shape)

    def take(self, full: torch.Tensor, rank: Optional[int] = None) -> torch.Tensor:
        """This rank's (or ``rank``'s) local tensor, cut from the unsplit ``full``."""
        return torch.cat([full.narrow(self.dim, a, b - a) for a, b in self.ranges(rank)], dim=self.dim)

    def place(self, full: torch.Tensor, local: torch.Tensor, rank: Optional[int] = None) -> None:
        """Write ``local`` (``rank``'s tensor) into its place in ``full``."""
        at = 0
        for a, b in self.ranges(rank):
            full.narrow(self.dim, a, b - a).copy_(local.narrow(self.dim, at, b - a))
            at += b - a

    def as_dict(self) -> dict:
        return {"dim": self.dim, "size": self.size, "shape": list(self.shape), "blocks": self.blocks}


#: Where a split module records its parameters' slices: ``{parameter name: TPSlice}``. On the
#: module, not the parameter: ``module.to()`` swaps a DTensor parameter's contents with a new
#: one's (``torch.utils.swap_tensors``), its ``__dict__`` included.
SLICES_ATTR = "_zerodp_tp_slices"


#: Where a split module keeps the parameters the split replaced: ``[(weakref to the old one, new one)]``.
REPLACED_ATTR = "_zerodp_tp_replaced"


def _replace(module: nn.Module, pname: str, old: nn.Parameter, new: nn.Parameter) -> None:
    module.register_parameter(pname, new)
    module.__dict__.setdefault(REPLACED_ATTR, []).append((weakref.ref(old), new))


def replaced_parameters(model: nn.Module) -> dict[int, nn.Parameter]:
    """``id(old parameter) -> the DTensor parameter that replaced it`` for every parameter of
    ``model`` that the split replaced and that is still alive (an optimizer built on the model
    before it was split holds them; ``initialize`` gives it the new ones)."""
    held = {id(p) for p in model.parameters()}  # a tied weight split twice keeps one of its new ones
    out: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for ref, new in mod.__dict__.get(REPLACED_ATTR, []):
            old = ref()
            if old is not None and id(new) in held:
                out[id(old)] = new
    return out


def mark(module: nn.Module, pname: str, param: torch.Tensor, tp: TPSlice) -> None:
    """Record which slice of the unsplit tensor ``module.<pname>`` holds (on the module), and mark
    the parameter as Megatron and DeepSpeed do a split one."""
    module.__dict__.setdefault(SLICES_ATTR, {})[pname] = tp
    param.tensor_model_parallel = True
    param.partition_dim = tp.dim
    param.partition_stride = 1


def model_slices(model: nn.Module, tp_size: int = 1, tp_rank: int = 0) -> dict[int, TPSlice]:
    """``id(parameter) -> TPSlice`` of every split parameter of ``model``: those zerodp split
    (recorded on their modules), and in a model split by its script those Megatron marks
    (``tensor_model_parallel`` with ``partition_dim``) or that are ``DTensor``s sharded on one
    dimension, taken to hold slice ``tp_rank`` of ``tp_size`` equal slices."""
    out: dict[int, TPSlice] = {}
    for mod in model.modules():
        for pname, tp in mod.__dict__.get(SLICES_ATTR, {}).items():
            p = getattr(mod, pname, None)
            if p is not None:
                out[id(p)] = tp
    for p in model.parameters():
        if id(p) in out:
            continue
        if is_dtensor(p):
            shards = [pl for pl in p.placements if pl.is_shard()]
            if shards:
                mesh = p.device_mesh
                out[id(p)] = TPSlice(shards[0].dim % p.dim(), mesh.size(), mesh.get_local_rank(), tuple(p.shape))
        elif getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False):
            dim = getattr(p, "partition_dim", 0)
            shape = list(p.shape)
            shape[dim] *= tp_size
            out[id(p)] = TPSlice(dim, tp_size, tp_rank, tuple(shape))
    return out


@dataclass(frozen=True)
class Split:
    """How one module is split (see the module docstring)."""

    kind: str  # one of KINDS
    blocks: int = 1
    whole_input: bool = False
    """A row split whose input arrives whole on every rank (each rank takes its slice of it)."""
    sequence: bool = False
    """The activations outside this module are split along the sequence (sequence parallelism)."""
    dtensor_output: bool = False
    """The output stays a ``DTensor`` (split along the sequence) instead of this rank's slice: for a
    model that reads the whole sequence's shape from its activations (``transformers``' decoders
    build positions and masks from the embeddings' shape)."""

    KINDS = ("column", "row", "vocab", "column_gather", "loss_output", "sequence_norm", "sequence_positions",
             "head_norm")
    COLUMN = ("column", "column_gather", "loss_output")
    SEQUENCE = ("sequence_norm", "sequence_positions")
    REPLICATED = SEQUENCE + ("head_norm",)
    """Kinds whose parameters stay whole on every rank (replicated ``DTensor`` s)."""

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise TensorParallelError(f"tensor_parallel: unknown split {self.kind!r}; allowed: {', '.join(self.KINDS)}")


def _is_conv1d(module: nn.Module) -> bool:
    """``transformers``' ``Conv1D``: a linear layer whose weight is stored ``(in, out)``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _param_splits(module: nn.Module, split: Split) -> dict[str, Optional[tuple[int, int]]]:
    """Parameter name -> (dim, blocks) of its split, or None where it stays replicated."""
    conv = _is_conv1d(module)
    if split.kind in Split.REPLICATED:
        return {pname: None for pname, _ in module.named_parameters(recurse=False)}
    if isinstance(module, nn.Embedding):
        if split.kind != "vocab" and split.kind != "column":
            raise TensorParallelError(f"an Embedding takes the 'vocab' or 'column' split, not {split.kind!r}")
        return {"weight": (0 if split.kind == "vocab" else 1, 1)}
    if not (isinstance(module, nn.Linear) or conv):
        raise TensorParallelError(f"only Linear, Embedding and transformers' Conv1D can be split, not "
                                  f"{type(module).__name__}")
    out_dim, in_dim = (1, 0) if conv else (0, 1)
    if split.kind in Split.COLUMN:
        return {"weight": (out_dim, split.blocks), "bias": (0, split.blocks)}
    if split.kind == "row":
        return {"weight": (in_dim, 1), "bias": None}
    raise TensorParallelError(f"a {type(module).__name__} takes the 'column', 'column_gather' or 'row' split, "
                              f"not {split.kind!r}")


def check_divisible(name: str, module: nn.Module, split: Split, tp: int) -> None:
    """Refuse, naming the layer, a split that does not come out even."""
    for pname, how in _param_splits(module, split).items():
        p = getattr(module, pname, None)
        if p is None or how is None:
            continue
        dim, blocks = how
        n = p.shape[dim]
        if n % blocks or (n // blocks) % tp:
            what = f"{blocks} blocks of {n // blocks}" if blocks > 1 else f"{n}"
            raise TensorParallelError(
                f"{name}.{pname}: dimension {dim} of shape {tuple(p.shape)} ({what}) does not split evenly over "
                f"{tp} tensor-parallel ranks; choose a tensor-parallel size that divides it")


def _style(split: Split):
    """Torch's parallel style for ``split``: its column or row style (inputs and outputs laid
    out as torch does), with the parameters cut by :func:`_partition` so that fused blocks and
    ``Conv1D`` split too and every split parameter is marked with its :class:`TPSlice`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    kwargs: dict = {}
    if split.kind == "sequence_norm":
        base = SequenceParallel
    elif split.kind == "head_norm":
        base, kwargs = "heads", {"sequence_dim": 2, "use_local_output": True}
    elif split.kind == "sequence_positions":
        base = "positions"
    elif split.kind in ("row", "vocab"):
        base = RowwiseParallel
        if split.kind == "vocab" or split.whole_input:
            kwargs["input_layouts"] = Replicate()
        if split.sequence:
            kwargs["output_layouts"] = Shard(1)
            kwargs["use_local_output"] = not split.dtensor_output
    else:
        base = ColwiseParallel
        kwargs["output_layouts"] = Replicate() if split.kind == "column_gather" else Shard(-1)
        if split.kind == "loss_output":
            kwargs["use_local_output"] = False
        if split.sequence:
            kwargs["input_layouts"] = Shard(1)
    style = _styles()[base](**kwargs)
    style.split = split
    return style


_STYLE_CLASSES: dict = {}


def _styles() -> dict:
    """Subclasses of torch's ``ColwiseParallel`` and ``RowwiseParallel`` whose parameters are cut
    by :func:`_partition` (made once, on first use: torch's TP imports only then)."""
    if not _STYLE_CLASSES:
        from functools import partial

        from torch.distributed.tensor import Replicate, Shard, distribute_module
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        def apply(self, module, device_mesh):
            if isinstance(self, RowwiseParallel):  # what torch's row style sets in its own _apply
                self.desired_input_layouts = (Replicate(),) if isinstance(module, nn.Embedding) else (Shard(-1),)
            vocab = isinstance(module, nn.Embedding) and self.split.kind == "vocab"
            if vocab:
                _check_vocab_embedding(module)
            out = distribute_module(
                module, device_mesh,
                lambda name, mod, mesh: _partition(mod, self.split, mesh) if mod is module else None,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
            if vocab:
                module.forward = types.MethodType(_vocab_embedding_forward, module)
            return out

        for base in (ColwiseParallel, RowwiseParallel):
            _STYLE_CLASSES[base] = type(f"Zerodp{base.__name__}", (base,), {"_apply": apply})
        _STYLE_CLASSES[SequenceParallel] = type("ZerodpSequenceParallel", (SequenceParallel,), {
            "_replicate_module_fn": lambda self, name, mod, mesh: [
                _replicate_param(mod, pname, mesh) for pname, _ in list(mod.named_parameters(recurse=False))]})
        _STYLE_CLASSES["positions"] = _positions_style()

        def on_heads(sharding, mod, inputs, device_mesh):  # (batch, T, heads, head_dim): split on heads
            if not (inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() == 4):
                shape = tuple(inputs[0].shape) if inputs and isinstance(inputs[0], torch.Tensor) else None
                raise TensorParallelError(
                    f"a 'head_norm' split (replicated_with_grad_allreduce) takes (batch, T, heads, head_dim) "
                    f"inputs; {type(mod).__name__} got {shape}: give a partition_config that leaves it out")
            return SequenceParallel._prepare_input_fn(sharding, mod, inputs, device_mesh)
        _STYLE_CLASSES["heads"] = type("ZerodpHeadNorm", (_STYLE_CLASSES[SequenceParallel],),
                                       {"_prepare_input_fn": staticmethod(on_heads)})
    return _STYLE_CLASSES


def _check_vocab_embedding(module: nn.Embedding) -> None:
    for option, off in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False)):
        if getattr(module, option) != off:
            raise TensorParallelError(
                f"an Embedding split over the vocabulary takes no {option}={getattr(module, option)!r} (it "
                "renormalizes or counts over the whole vocabulary): leave it out of the plan or unset it")


def _vocab_embedding_forward(module: nn.Embedding, ids):
    """A vocabulary-split ``Embedding``'s forward on this rank's rows alone (Megatron's
    vocabulary-parallel embedding): ids outside them look up row 0 and are zeroed, and the output
    is a ``Partial`` ``DTensor`` that the row style's output hook sums over the tensor ranks.
    Backward then makes the gradient of this rank's rows only; ``DTensor``'s own embedding
    backward makes one of the whole vocabulary on every rank first (1 GB for Llama-3 8B)."""
    from torch.distributed.tensor import DTensor, Partial

    weight = module.weight
    start, stop = getattr(module, SLICES_ATTR)["weight"].ranges()[0]
    x = ids.to_local() if isinstance(ids, DTensor) else ids
    outside = (x < start) | (x >= stop)
    local = (x - start).masked_fill(outside, 0)
    pad = module.padding_idx
    pad = pad - start if pad is not None and start <= pad < stop else None
    out = nn.functional.embedding(local, weight.to_local(), pad).masked_fill(outside.unsqueeze(-1), 0)
    return DTensor.from_local(out, weight.device_mesh, [Partial()], run_check=False)


def _positions_style():
    """A style whose module stays whole and whose output (``(..., T, C)``) is cut to this rank's
    slice of the sequence ``T``: a ``DTensor`` redistribution, so backward gathers the gradient.
    The slice, or with ``split.dtensor_output`` the ``DTensor``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel.style import ParallelStyle

    def apply(self, module, device_mesh):
        def cut(mod, args, out):
            dim = out.dim() - 2
            whole = DTensor.from_local(out, device_mesh, [Replicate()], run_check=False)
            part = whole.redistribute(device_mesh, [Shard(dim)])
            return part if self.split.dtensor_output else part.to_local()
        module.register_forward_hook(cut)
        return module

    return type("ZerodpSequencePositions", (ParallelStyle,), {"_apply": apply})


def _shard_param(module: nn.Module, pname: str, dim: int, blocks: int, mesh) -> None:
    """Replace ``module.<pname>`` by a DTensor parameter holding this rank's slice (of every
    block), taken from tensor-parallel rank 0's values, marked with its ``TPSlice``."""
    from torch.distributed.tensor import DTensor, Shard

    p = getattr(module, pname)
    size, rank = mesh.size(), mesh.get_local_rank()
    full = p.detach().contiguous()
    if size > 1:  # every rank cuts its slice from rank 0's values
        Comm(mesh.get_group(), "tensor").broadcast(full, src_rank=0)
    tp = TPSlice(dim, size, rank, tuple(full.shape), blocks)
    local = tp.take(full).contiguous()
    dt = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
    new = nn.Parameter(dt, requires_grad=p.requires_grad)
    _replace(module, pname, p, new)
    mark(module, pname, new, tp)


def _replicate_param(module: nn.Module, pname: str, mesh) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    p = getattr(module, pname)
    full = p.detach().contiguous()
    if mesh.size() > 1:
        Comm(mesh.get_group(), "tensor").broadcast(full, src_rank=0)
    _replace(module, pname, p, nn.Parameter(DTensor.from_local(full, mesh, [Replicate()], run_check=False),
                                            requires_grad=p.requires_grad))


def _partition(module: nn.Module, split: Split, mesh) -> None:
    for pname, how in _param_splits(module, split).items():
        if getattr(module, pname, None) is None:
            continue
        if how is None:
            _replicate_param(module, pname, mesh)
        else:
            _shard_param(module, pname, how[0], how[1], mesh)


def resolve_plan(model: nn.Module, plan: dict[str, Split]) -> dict[str, Split]:
    """The plan's patterns (module names; ``*`` matches one name component, as in
    ``transformers``' plans) matched to the model's modules: module name -> split. A pattern
    that matches nothing is an error naming it."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, Split] = {}
    for pattern, split in plan.items():
        rx = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        hits = [n for n in names if rx.match(n)]
        if not hits:
            raise TensorParallelError(f"tensor-parallel plan: {pattern!r} matches no module of the model")
        for n in hits:
            out[n] = split
    return out


def split_parameters(model: nn.Module, plan: dict[str, Split]) -> list[nn.Parameter]:
    """The parameters ``plan`` splits (each once; a row split's bias stays whole). No process group
    is needed: the estimator counts them on a model built on the meta device."""
    modules = dict(model.named_modules())
    seen: dict[int, nn.Parameter] = {}
    for name, split in resolve_plan(model, plan).items():
        for pname, how in _param_splits(modules[name], split).items():
            p = getattr(modules[name], pname, None)
            if p is not None and how is not None:
                seen[id(p)] = p
    return list(seen.values())


def apply_plan(model: nn.Module, plan: dict[str, Split], mesh) -> dict[str, Split]:
    """Split ``model`` in place over the tensor-parallel ``mesh`` as ``plan`` says, and make every
    parameter and buffer left whole the same on every tensor-parallel rank (rank 0's); returns
    the resolved plan (module name -> split)."""
    from torch.distributed.tensor.parallel import parallelize_module

    resolved = resolve_plan(model, plan)
    modules = dict(model.named_modules())
    tp = mesh.size()
    for name, split in resolved.items():
        check_divisible(name, modules[name], split, tp)
    tied = _tied_names(model)
    parallelize_module(model, mesh, {name: _style(split) for name, split in resolved.items()})
    _retie(model, tied)
    comm = Comm(mesh.get_group(), "tensor")
    with torch.no_grad():  # what stays whole: tensor rank 0's values
        for p in model.parameters():
            if not is_dtensor(p):
                comm.broadcast(p.data, src_rank=0)
        for b in model.buffers():
            if not is_dtensor(b):
                comm.broadcast(b, src_rank=0)
    return resolved


def _tied_names(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Parameters registered under more than one (module, name): each such set, in order."""
    by_id: dict[int, list[tuple[str, str]]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(recurse=False):
            by_id.setdefault(id(p), [])
            if (mname, pname) not in by_id[id(p)]:
                by_id[id(p)].append((mname, pname))
    return [v for v in by_id.values() if len(v) > 1]


def _retie(model: nn.Module, tied: list[list[tuple[str, str]]]) -> None:
    """Tie again the parameters a split replaced in one of their modules only: every module of
    a tied set takes the split parameter (both sides must ask for the same split)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for names in tied:
        slices = [modules[m].__dict__.get(SLICES_ATTR, {}).get(p) for m, p in names]
        split = [(m, p) for (m, p), tp in zip(names, slices) if tp is not None]
        if not split:
            continue
        if any(tp != slices[names.index(split[0])] for tp in slices):
            raise TensorParallelError(
                "tied parameters " + ", ".join(f"{m}.{p}" for m, p in names) + " are split differently by "
                "the plan; give the modules that share them the same split (an embedding tied to the output "
                "layer: 'vocab', 'column_gather' and 'loss_output' split the vocabulary)")
        first_m, first_p = split[0]
        first, tp = getattr(modules[first_m], first_p), slices[names.index(split[0])]
        for m, p in names:
            setattr(modules[m], p, first)
            modules[m].__dict__.setdefault(SLICES_ATTR, {})[p] = tp

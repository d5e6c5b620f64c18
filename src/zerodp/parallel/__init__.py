"""Parallelism beyond ZeRO's data-parallel sharding: the process grid and tensor parallelism.

What ``zerodp.initialize`` and the engine use of it:

* :func:`grid_for` builds the :class:`~zerodp.parallel.grid.Grid` of a run from what
  ``initialize`` was given (the config's ``tensor_parallel`` block and hybrid-sharding size, an
  ``mpu``, a ``DeviceMesh`` or a data-parallel ``process_group``) and splits the model over its
  tensor axis when zerodp owns the split (the config or a mesh; an ``mpu`` brings a model its
  script split itself, Megatron-style);
* :func:`parallelisms_for` makes the engine's list of parallelisms (``base.Parallelism``: what
  each does to inputs, the region forward and backward run in, where each parameter lives, the
  axis its parameters shard over); :class:`TensorParallel` is tensor parallelism's: it checks
  that every tensor-parallel rank runs the same batch, places the split parameters' slices and
  counts the activations' collectives.

``tp_model_init`` (DeepSpeed's ``deepspeed.tp_model_init``) splits a model before ``initialize``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn

from ..core.collectives import Comm, CommCounter
from ..core.flat import is_dtensor
from ..core.gather import runs_compiled
from .adapters import base_model, expand_adapters
from .base import Parallelism
from .expert import ExpertParallel, ExpertParallelError, expert_parallel_params
from .expert_capacity import join_expert_groups
from .grid import Grid, GridError, build_grid, grid_from_mesh, grid_from_mpu, with_secondary
from .plans import check_heads, localize, plan_for, with_loss_parallel, with_sequence_parallel
from .sequence import SequenceParallel, initialize_sequence_parallel
from .tensor import Split, TensorParallelError, TPSlice, apply_plan, model_slices, replaced_parameters, resolve_plan

__all__ = ["Grid", "GridError", "Parallelism", "TensorParallel", "TensorParallelError", "TPSlice", "Split",
           "grid_for", "parallelisms_for", "tensor_parallelize", "tp_model_init", "model_slices",
           "replaced_parameters"]

#: Where a model split by zerodp keeps its grid (``tp_model_init`` before ``initialize``).
GRID_ATTR = "_zerodp_grid"
#: Where a split module keeps its :class:`Split`.
SPLIT_ATTR = "_zerodp_split"


def hybrid_size(config) -> Optional[int]:
    """The hybrid shard size of a config (MiCS: ``mics_shard_size``), or None. (``zero_hpz_partition_size``
    is hpZ, not hybrid sharding: its groups are the grid's ``secondary`` axis.)"""
    size = config.zero_optimization.mics_shard_size
    return size if size > 1 else None


def _already_split(model: nn.Module) -> bool:
    return bool(model_slices(model)) or any(is_dtensor(p) for p in model.parameters())


def _has(model: nn.Module, option: str) -> bool:
    """Whether ``model`` was split with ``loss_parallel`` or ``sequence_parallel``."""
    splits = [s for m in model.modules() if (s := getattr(m, SPLIT_ATTR, None)) is not None]
    if option == "loss_parallel":
        return any(s.kind == "loss_output" for s in splits)
    return any(s.sequence for s in splits)


def grid_for(model: nn.Module, config, *, mpu: Any = None, mesh_param: Any = None,
             process_group: Any = None, pp: int = 1) -> Grid:
    """The process grid of a run (``pp`` pipeline stages: a ``PipelineModule``'s), and ``model``
    split over its tensor axis where zerodp splits it."""
    tpc = config.tensor_parallel
    stages = config.pipeline.stages
    if stages != "auto" and stages != pp:
        raise GridError(f"pipeline.stages: the config says {stages}, but the model has {pp} pipeline stages"
                        + ("" if pp > 1 else " (a model that is not a zerodp.pipe.PipelineModule has one)"))
    wanted = [k for k in ("loss_parallel", "sequence_parallel") if getattr(tpc, k)]
    if wanted and pp > 1:
        raise GridError(f"tensor_parallel.{wanted[0]}: not implemented under a pipeline (the schedule runs the "
                        "loss and its backward); leave it off with pipeline stages")
    shard = hybrid_size(config)
    given = [n for n, v in (("mpu", mpu), ("mesh_param", mesh_param), ("process_group", process_group))
             if v is not None]
    if len(given) > 1:
        raise GridError(f"initialize: give one of mpu, mesh_param and process_group, not {' and '.join(given)}")
    earlier: Optional[Grid] = getattr(model, GRID_ATTR, None)
    if mpu is not None:
        grid = grid_from_mpu(mpu, shard)
    elif mesh_param is not None:
        grid = grid_from_mesh(mesh_param, shard)
    elif earlier is not None:
        grid = earlier if shard is None else build_grid(earlier.tp_size, shard_size=shard, source="config")
    else:
        grid = build_grid(tp_size=tpc.size, pp_size=pp, shard_size=shard, data_group=process_group,
                          source="config" if tpc.size > 1 or pp > 1 else "world",
                          sequence=initialize_sequence_parallel(config.sequence_parallel_size)
                          if config.sequence_parallel_size > 1 else None)
    sp = config.sequence_parallel_size
    if sp > 1 and grid.sequence.size != sp:
        raise GridError(f"sequence_parallel_size: the config says {sp}, but the {grid.source} gives "
                        f"{grid.sequence.size} sequence-parallel ranks")
    if config.data_parallel_size is not None and config.data_parallel_size != grid.dp_size:
        raise GridError(f"data_parallel_size: the config says {config.data_parallel_size}, but the grid has "
                        f"{grid.dp_size} data-parallel ranks ({grid.describe()})")
    if tpc.size > 1 and grid.tp_size != tpc.size:
        raise GridError(f"tensor_parallel.autotp_size: the config says {tpc.size}, but the "
                        f"{grid.source} gives {grid.tp_size} tensor-parallel ranks")
    if grid.pipe.size != pp:
        raise GridError(f"the grid has {grid.pipe.size} pipeline stages, the model {pp}")
    if grid.tp_size > 1 and runs_compiled(model):
        raise GridError(f"a model compiled with torch.compile: {_NO_COMPILE}")
    if grid.tp_size > 1 and grid.source != "mpu" and not _already_split(model):
        tensor_parallelize(model, grid, tpc.partition_config, loss_parallel=tpc.loss_parallel,
                           sequence_parallel=tpc.sequence_parallel)
    elif grid.tp_size > 1 and (missing := [k for k in wanted if not _has(model, k)]):
        raise GridError(f"tensor_parallel.{missing[0]}: zerodp applies it when it splits the model; this model was "
                        f"split before initialize (by its script, an mpu or tp_model_init without the option)")
    join_expert_groups(model)  # DeepSpeed's MoE layers made before torch.distributed was up
    if config.expert_parallel.size > 1 and not expert_parallel_params(model):
        from .expert_hf import autoep
        autoep(base_model(model), config.expert_parallel)
    return with_secondary(grid, config.zero_optimization.zero_hpz_partition_size)


_NO_COMPILE = ("tensor parallelism does not run compiled yet: torch.compile cannot trace a DTensor parameter whose "
               "local tensor is a view into a larger buffer, which is how zerodp lays out the split parameters; "
               "train the tensor-parallel model uncompiled")


def tensor_parallelize(model: nn.Module, grid: Grid, partition_config: Optional[dict] = None, *,
                       loss_parallel: bool = False, sequence_parallel: bool = False) -> dict[str, Split]:
    """Split ``model`` in place over ``grid``'s tensor axis by its plan (``plans.py``), with the
    logits left split for the loss and the activations split along the sequence where asked;
    returns the plan, module name -> split."""
    tp = grid.tp_size
    inner = base_model(model)  # PEFT's wrapped model: the one the plan names
    check_heads(inner, tp)
    plan = plan_for(inner, partition_config)
    if sequence_parallel:
        plan = with_sequence_parallel(inner, plan, partition_config)
    if loss_parallel:
        plan = with_loss_parallel(plan)
    plan = apply_plan(inner, expand_adapters(inner, resolve_plan(inner, plan)), grid.tp_mesh)
    modules = dict(inner.named_modules())
    for name, split in plan.items():
        setattr(modules[name], SPLIT_ATTR, split)
    localize(inner, tp)
    setattr(model, GRID_ATTR, grid)
    return plan


def tp_model_init(model: nn.Module, tp_size: int, dtype: Optional[torch.dtype] = None, config: Any = None,
                  **kwargs) -> nn.Module:
    """DeepSpeed's ``deepspeed.tp_model_init``: split ``model`` over ``tp_size`` adjacent ranks (the
    grid's tensor axis; the process group is started if needed), cast it to ``dtype``, and return
    it; ``initialize`` then trains it with ZeRO over the data-parallel ranks."""
    from ..core.device import init_distributed
    init_distributed()
    if dtype is not None:
        model.to(dtype)
    tpc = (config.get("tensor_parallel") or {}) if isinstance(config, dict) else {}
    grid = build_grid(tp_size=tp_size, source="config")
    if tp_size > 1:
        tensor_parallelize(model, grid, tpc.get("partition_config"), loss_parallel=bool(tpc.get("loss_parallel")),
                           sequence_parallel=bool(tpc.get("sequence_parallel")))
    else:
        setattr(model, GRID_ATTR, grid)
    return model


def parallelisms_for(grid: Grid, model: nn.Module, counter: CommCounter) -> list[Parallelism]:
    """The parallelisms an engine over ``grid`` runs ``model`` with, in the order their inputs and
    regions apply: tensor parallelism where the grid's tensor axis has more than one rank, Ulysses
    sequence parallelism where its sequence axis has, expert parallelism where the model has layers
    whose experts are split (``expert.py``)."""
    out: list[Parallelism] = []
    if grid.tp_size > 1:
        out.append(TensorParallel(grid, model, counter))
    if grid.sequence.size > 1:
        out.append(SequenceParallel(grid, counter))
    if expert_parallel_params(model):
        others = [n for n, on in (("tensor parallelism", grid.tp_size > 1),
                                  ("pipeline parallelism", grid.pipe.size > 1),
                                  ("sequence parallelism", grid.sequence.size > 1),
                                  ("hybrid sharding (MiCS)", grid.replica.size > 1),
                                  ("hpZ", grid.secondary is not None and grid.secondary.size > 1),
                                  ("a data-parallel group narrower than the world", grid.data.size != grid.world_size))
                  if on]
        if others:
            raise ExpertParallelError(f"expert parallelism with {others[0]} is not supported yet; use it beside "
                                      "data parallelism alone")
        out.append(ExpertParallel(model, counter))
    return out


class TensorParallel(Parallelism):
    """The engine's handle on a model split over the grid's tensor axis (see the module docstring)."""

    name = "tensor"

    def __init__(self, grid: Grid, model: nn.Module, counter: CommCounter) -> None:
        self.grid = grid
        self.comm: Comm = grid.tensor.comm(counter)
        self.hooks = [m.register_forward_hook(_count_hook(self.comm, split))
                      for m in model.modules() if (split := getattr(m, SPLIT_ATTR, None)) is not None]
        self.loss_parallel = _has(model, "loss_parallel")
        if self.loss_parallel:
            self.hooks += _loss_parallel_hooks(model)

    def region(self):
        """The context the engine's forward and backward run in: torch's ``loss_parallel()`` when the
        logits stay split over the vocabulary (the cross entropy on the slices, forward and
        backward), else nothing."""
        return _loss_parallel_region() if self.loss_parallel else contextlib.nullcontext()

    def placement(self, model: nn.Module) -> dict[int, TPSlice]:
        """The split parameters' slices of their unsplit tensors (``tensor.model_slices``)."""
        return model_slices(model, self.grid.tp_size, self.grid.tensor.rank)

    def prepare_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Every tensor-parallel rank must run the same batch: each rank's inputs are summed into a
        fingerprint, and a difference inside the group fails on every rank, naming the ranks. The
        inputs are given back as they came."""
        if self.comm.world_size == 1:
            return args, kwargs
        from ..core.gather import tensors_in
        parts = []
        for t in tensors_in((args, kwargs)):
            x = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()
            x = x.reshape(-1).double()
            weights = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device).remainder_(97).add_(1)
            parts.append(torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device),
                                      x.sum(), (x * weights).sum()]))
        mine = torch.cat(parts).cpu() if parts else torch.zeros(1, dtype=torch.float64)
        prints = self.comm.all_gather_ints([hash(tuple(mine.tolist())) & ((1 << 62) - 1), mine.numel()])
        if len({tuple(p) for p in prints}) > 1:
            groups: dict[tuple, list[int]] = {}
            for r, p in enumerate(prints):
                groups.setdefault(tuple(p), []).append(self.comm.global_ranks[r])
            raise RuntimeError(
                "tensor parallelism: the ranks of one tensor-parallel group must run the same batch, but "
                + " and ".join(f"ranks {rs}" for rs in groups.values()) + " got different inputs. Give every "
                "rank of a tensor-parallel group the same data: split the data over the data-parallel ranks "
                "only (engine.dp_world_size, engine.dp_rank; initialize(training_data=...) does)")
        return args, kwargs

    def refuses_compile(self) -> str:
        """torch 2.13's dynamo cannot trace a ``DTensor`` whose local tensor starts at an offset into
        a larger storage ("Attempted to set the storage of a tensor on device cpu to a storage on
        different device meta"), and a flat group lays the split parameters' local tensors out so."""
        return _NO_COMPILE

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def _loss_parallel_hooks(model: nn.Module) -> list:
    """Hooks that run every call of the model (through the engine, or of the model itself: the
    Trainer's ``evaluate``, ``generate``) inside ``loss_parallel()``, and give back its outputs with
    every replicated ``DTensor`` (the loss computed on split logits) made a plain tensor (a
    one-element one, the loss, a copy that may be changed in place); split logits stay ``DTensor`` s
    (``.full_tensor()`` gives them whole)."""
    entered: list[Optional[contextlib.ExitStack]] = []

    def pre_forward(module, args):
        stack = None
        if not _loss_ops_on():
            stack = contextlib.ExitStack()
            stack.enter_context(_loss_parallel_region())
        entered.append(stack)

    def post_forward(module, args, output):
        stack = entered.pop() if entered else None
        if stack is not None:
            stack.close()
        return _local_outputs(output)

    return [model.register_forward_pre_hook(pre_forward),
            model.register_forward_hook(post_forward, always_call=True)]


def _loss_ops_on() -> bool:
    """Whether torch's loss-parallel operators are on (a ``loss_parallel()`` around this call)."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel.loss import customized_loss_ops
        return all(op in DTensor._op_dispatcher._custom_op_handlers for op in customized_loss_ops)
    except (ImportError, AttributeError):  # pragma: no cover - another torch's layout
        return False


@contextlib.contextmanager
def _loss_parallel_region():
    """torch's ``loss_parallel()``, left as it is when already on (torch's context switches the
    operators off at its exit, so nesting it would switch off a user's around the backward) and
    switched off also when the body raises (torch's does not)."""
    if _loss_ops_on():
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel
    context = loss_parallel()
    context.__enter__()
    try:
        yield
    finally:
        context.__exit__(None, None, None)


def _local_outputs(x: Any) -> Any:
    if is_dtensor(x):
        if not all(p.is_replicate() for p in x.placements):
            return x
        local = x.to_local()  # a view made by a custom Function, which autograd forbids changing in place:
        return local.clone() if local.numel() == 1 else local  # a loss is a copy (the Trainer's ``loss *= ...``)
    if isinstance(x, dict):  # transformers' ModelOutput too: its items set in place
        for k in list(x.keys()):
            x[k] = _local_outputs(x[k])
        return x
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_local_outputs(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_local_outputs(v) for v in x)
    return x


def _count_hook(comm: Comm, split: Split):
    """A forward hook adding the collectives torch's style runs for ``split`` (forward, and the
    backward that follows when the input needs a gradient) to ``comm``'s counter. Bytes as the
    ledger counts them: an all-reduce 2 (n-1)/n of the tensor, an all-gather or reduce-scatter
    (n-1)/n of the whole tensor."""
    n = comm.world_size
    factor = (n - 1) / n

    def nbytes(t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        if is_dtensor(t):
            t = t.to_local()
        return t.numel() * t.element_size()

    def add(op: str, size: float) -> None:
        comm.counter.add(op, (2 if op == "all_reduce" else 1) * size * factor, comm.label)

    def hook(module, args, output):
        if n == 1:
            return
        x = args[0] if args else None
        grad = torch.is_grad_enabled()
        x_grad = grad and isinstance(x, torch.Tensor) and x.requires_grad
        out_grad = grad and isinstance(output, torch.Tensor) and output.requires_grad
        if split.kind in ("row", "vocab"):
            if split.sequence:  # partial outputs reduce-scattered onto the sequence slices; gathered back
                add("reduce_scatter", nbytes(output) * n)
                if out_grad:
                    add("all_gather", nbytes(output) * n)
            else:  # partial outputs summed: an all-reduce (its backward moves nothing)
                add("all_reduce", nbytes(output))
        elif split.kind in Split.COLUMN:
            # x: the input as the style made it, whole on every rank (gathered from the sequence
            # slices with sequence parallelism)
            if split.sequence:
                add("all_gather", nbytes(x))
            if split.kind == "column_gather":  # each rank's slice of the output gathered
                add("all_gather", nbytes(output))
            if split.kind == "loss_output" and grad:  # the cross entropy on the slices: max, sum, target
                local = output.to_local()
                rows = local.numel() // max(1, local.shape[-1])
                for _ in range(3):
                    add("all_reduce", rows * 4)
            if x_grad:  # the input's gradient summed (onto the sequence slices)
                add("reduce_scatter" if split.sequence else "all_reduce", nbytes(x))
        elif split.kind in ("sequence_norm", "head_norm") and grad:  # each parameter's partial gradient summed
            for p in module.parameters(recurse=False):
                if p.requires_grad:
                    add("all_reduce", nbytes(p))
        elif split.kind == "sequence_positions" and out_grad:  # the output's gradient gathered whole
            add("all_gather", nbytes(output) * n)
    return hook

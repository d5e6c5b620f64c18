"""DeepSpeed's ``PipelineModule``: a model given as a sequence of layers, of which each pipeline
stage builds and runs its own contiguous slice.

The forward of the whole model is ``x = inputs; for layer in layers: x = layer(x)`` (a layer
receives what the previous one returned, a tensor or a tuple), and the loss is
``loss_fn(outputs, labels)``. Layers are modules, :class:`LayerSpec` (built only on the stage that
runs them), :class:`TiedLayerSpec` (one module per key, built on every stage that uses it, its
weights kept equal across those stages), or plain callables.

Parameter names are those of the unsplit model: a layer's module is registered under its index in
``layers`` (``"3.weight"``) and a tied one under ``tied_modules.<key>``, DeepSpeed's own names, so a
checkpoint loads at any number of stages. Layers are partitioned over ``num_stages`` x
``virtual_stages`` chunks (``partition_method``: ``"parameters"``, ``"uniform"`` or
``"type:REGEX"``); stage ``s`` runs chunks ``s``, ``s + num_stages``, ... (more than one with the
interleaved schedules).
"""
from __future__ import annotations

import logging
import re
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger("zerodp")


class PipelineError(ValueError):
    """A pipeline that cannot be built as asked."""


class LayerSpec:
    """A layer to build later, on the stage that runs it: ``typename(*module_args, **module_kwargs)``."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise PipelineError(f"LayerSpec takes an nn.Module class, not {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer shared by several positions of the pipeline (an embedding used again as the output
    layer): one module per ``key``; ``forward_fn(module, x)`` when given, else the module's forward;
    ``tied_weight_attr`` names the tied parameters (kept equal on every stage that holds them, their
    gradients summed over those stages)."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Optional[Callable] = None,
                 tied_weight_attr: Any = ("weight",), **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts of ``num_items`` items, as equal as can be."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for p in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if p < extra else 0))
    return bounds


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts whose largest total weight is smallest (binary
    search on that total, parts filled greedily); every part gets at least one item when it can."""
    n = len(weights)
    if num_parts >= n:
        return partition_uniform(n, num_parts)

    def parts_for(limit: float) -> Optional[list[int]]:
        bounds, total = [0], 0.0
        for i, w in enumerate(weights):
            if total + w > limit and i > bounds[-1]:
                bounds.append(i)
                total = 0.0
            total += w
        bounds.append(n)
        return bounds if len(bounds) - 1 <= num_parts else None

    lo, hi = max(weights), sum(weights)
    for _ in range(64):
        mid = (lo + hi) / 2
        if parts_for(mid) is None:
            lo = mid
        else:
            hi = mid
    bounds = parts_for(hi)
    while len(bounds) - 1 < num_parts:  # split the largest parts until there are num_parts
        sizes = [(bounds[i + 1] - bounds[i], i) for i in range(len(bounds) - 1)]
        size, i = max(sizes)
        if size < 2:
            bounds.append(n)
            continue
        bounds.insert(i + 1, bounds[i] + size // 2)
    return bounds


class _Chunk(nn.Module):
    """The layers of one chunk of the pipeline, as the module torch's ``PipelineStage`` runs. It is
    not registered in the ``PipelineModule`` (whose names are the model's)."""

    def __init__(self, funcs: list, first: bool, checkpoint_every: int) -> None:
        super().__init__()
        self.funcs = funcs
        self.layers = nn.ModuleList(_modules_of(funcs))  # for .parameters()
        self.first, self.checkpoint_every = first, checkpoint_every

    def forward(self, *args: Any) -> Any:
        if not self.first and getattr(self.funcs[0], "inplace", False):
            # the activations received from the previous stage are leaves that need a gradient:
            # an in-place first layer (ReLU(inplace=True)) works on a copy
            args = tuple(a.clone() if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad else a
                         for a in args)
        x = args[0] if len(args) == 1 else args
        if self.checkpoint_every <= 0 or not torch.is_grad_enabled():
            for f in self.funcs:
                x = f(x)
            return x
        from ..checkpointing import checkpoint
        for start in range(0, len(self.funcs), self.checkpoint_every):
            run = self.funcs[start:start + self.checkpoint_every]
            if not any(_modules_of(run)):  # nothing to recompute for
                for f in run:
                    x = f(x)
                continue
            x = checkpoint(_Run(run), *(x if isinstance(x, tuple) else (x,)))
        return x


class _Run:
    def __init__(self, funcs: list) -> None:
        self.funcs = funcs

    def __call__(self, *args: Any) -> Any:
        x = args[0] if len(args) == 1 else args
        for f in self.funcs:
            x = f(x)
        return x


def _modules_of(funcs: list) -> list[nn.Module]:
    out = []
    for f in funcs:
        if isinstance(f, nn.Module):
            out.append(f)
        elif isinstance(f, partial) and f.args and isinstance(f.args[0], nn.Module):
            out.append(f.args[0])
    return out


class PipelineModule(nn.Module):
    """DeepSpeed's ``deepspeed.pipe.PipelineModule`` (see the module docstring).

    ``num_stages``: pipeline stages (the outermost axis of the process grid: stage ``s`` is global
    ranks ``s * world / num_stages`` onwards); ``topology``: DeepSpeed's topology object instead
    (its ``pipe`` dimension). ``virtual_stages``: chunks per stage, for the interleaved schedules.
    ``activation_checkpoint_interval``: recompute every this many layers in backward (0: keep
    activations). ``seed_layers`` seeds each layer's construction with ``base_seed + index``, so a
    model's initial values do not depend on how it is split.
    """

    def __init__(self, layers, num_stages: Optional[int] = None, topology: Any = None,
                 loss_fn: Optional[Callable] = None, seed_layers: bool = False, seed_fn: Optional[Callable] = None,
                 base_seed: int = 1234, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0, activation_checkpoint_func: Any = None,
                 checkpointable_layers: Any = None, dynamic_shape: bool = False, virtual_stages: int = 1) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise PipelineError("PipelineModule needs num_stages= (or a topology=)")
        if topology is not None:
            num_stages = topology.get_dim("pipe")
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if num_stages < 1 or world % num_stages:
            raise PipelineError(f"num_stages ({num_stages}) must divide the world size ({world})")
        if virtual_stages < 1:
            raise PipelineError(f"virtual_stages must be at least 1, got {virtual_stages}")
        self.num_stages, self.virtual_stages = num_stages, virtual_stages
        self.stage_id = rank // (world // num_stages)
        self.loss_fn = loss_fn
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self._layer_specs = list(layers)
        chunks = num_stages * virtual_stages
        if len(self._layer_specs) < chunks:
            raise PipelineError(f"{len(self._layer_specs)} layers cannot fill {num_stages} stages x "
                                f"{virtual_stages} virtual stages")
        self.parts = self._partition(partition_method, chunks)
        self.chunk_ids = [self.stage_id + k * num_stages for k in range(virtual_stages)]
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._tie_keys_here: list[str] = []
        funcs_of: dict[int, list] = {}
        for c in self.chunk_ids:
            funcs_of[c] = [self._build_layer(i, seed_layers, seed_fn, base_seed)
                           for i in range(self.parts[c], self.parts[c + 1])]
        self.__dict__["chunks"] = [_Chunk(funcs_of[c], c == 0, activation_checkpoint_interval)
                                   for c in self.chunk_ids]

    # -- building ----------------------------------------------------------------------------

    def _build_layer(self, index: int, seed_layers: bool, seed_fn, base_seed: int):
        spec = self._layer_specs[index]
        if seed_layers:
            (seed_fn or torch.manual_seed)(base_seed + index)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:
                self.tied_modules[spec.key] = spec.build()
                self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                self._tie_keys_here.append(spec.key)
            module = self.tied_modules[spec.key]
            return module if spec.forward_fn is None else partial(spec.forward_fn, module)
        if isinstance(spec, LayerSpec):
            module = spec.build()
            self.add_module(str(index), module)
            return module
        if isinstance(spec, nn.Module):
            self.add_module(str(index), spec)
            return spec
        if callable(spec):
            return spec
        raise PipelineError(f"layer {index}: {spec!r} is not a module, a LayerSpec or a callable")

    def _layer_params(self, index: int) -> int:
        spec = self._layer_specs[index]
        if isinstance(spec, nn.Module):
            return sum(p.numel() for p in spec.parameters())
        if isinstance(spec, LayerSpec):
            with torch.device("meta"):
                return sum(p.numel() for p in spec.build().parameters())
        return 0

    def _layer_name(self, index: int) -> str:
        spec = self._layer_specs[index]
        if isinstance(spec, LayerSpec):
            return spec.typename.__name__
        return type(spec).__name__ if isinstance(spec, nn.Module) else getattr(spec, "__name__", type(spec).__name__)

    def _partition(self, method: str, parts: int) -> list[int]:
        n = len(self._layer_specs)
        how = method.lower()
        if how == "uniform":
            return partition_uniform(n, parts)
        if how == "parameters":
            return partition_balanced([float(self._layer_params(i)) for i in range(n)], parts)
        if how.startswith("type:"):
            rx = re.compile(method.split(":", 1)[1], re.IGNORECASE)
            weights = [1.0 if rx.search(self._layer_name(i)) else 0.0 for i in range(n)]
            if not any(weights):
                raise PipelineError(f"partition_method {method!r}: no layer's type matches")
            return partition_balanced(weights, parts)
        raise PipelineError(f"partition_method {method!r}: allowed: parameters, uniform, type:REGEX")

    # -- what the pipeline engine reads ------------------------------------------------------------

    def tied_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This stage's tied parameters, ``(key.attr, parameter)``, in key order."""
        out = []
        for key in sorted(self.tied_modules):
            for attr in self.tied_weight_attrs[key]:
                p = self.tied_modules[key]
                for part in attr.split("."):
                    p = getattr(p, part)
                out.append((f"{key}.{attr}", p))
        return out

    def tie_keys(self) -> list[str]:
        """Every tied module's key in the whole model (not only this stage's), sorted."""
        return sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})

    def tie_owners(self, key: str) -> list[int]:
        """The stages that hold tied module ``key``, ascending."""
        stages = set()
        for i, spec in enumerate(self._layer_specs):
            if isinstance(spec, TiedLayerSpec) and spec.key == key:
                chunk = next(c for c in range(len(self.parts) - 1) if self.parts[c] <= i < self.parts[c + 1])
                stages.add(chunk % self.num_stages)
        return sorted(stages)

    def forward(self, *inputs: Any) -> Any:
        """The whole model in one process (one stage): every chunk in order."""
        if self.num_stages * self.virtual_stages != len(self.chunks):
            raise RuntimeError("a PipelineModule split over several stages runs through the engine's "
                               "train_batch() / eval_batch(), not by calling it")
        x = inputs
        for chunk in self.chunks:
            x = chunk(*(x if isinstance(x, tuple) else (x,)))
        return x

    def describe(self) -> str:
        lines = []
        for c in range(len(self.parts) - 1):
            names = ", ".join(f"{i}:{self._layer_name(i)}" for i in range(self.parts[c], self.parts[c + 1]))
            lines.append(f"chunk {c} (stage {c % self.num_stages}): {names}")
        return "\n".join(lines)

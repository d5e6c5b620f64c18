"""What a checkpoint holds of an engine, and where.

Every flat group is cut into one range per rank and rank ``r`` writes range ``r`` into its own
tensor file: its shard at stages 1-3, where the group is partitioned over the ranks, and at
stage 0, where every rank holds everything, the ``r``-th of N equal slices, so the ranks
share the writing and the checkpoint holds each element once (``save_range``; hybrid replicas
share their shard the same way). Under tensor parallelism every tensor-parallel rank writes its
own file of its own slices (file ``data rank x tensor size + tensor rank``); a parameter
replicated over the tensor-parallel ranks is written by tensor rank 0 only. For its range a
rank writes:

* ``g{i}.value``: the parameters' values: the fp32 master where the run keeps one (16-bit
  training), otherwise the parameters themselves;
* ``g{i}.state.{key}``: each elementwise optimizer state (Adam's ``exp_avg``,
  ``exp_avg_sq``), laid out like the values (zeros where a parameter has no state);
* in its JSON file, per parameter piece, whether it has optimizer state and its scalar
  state (``step``).

Rank 0 also writes what is not sharded: parameters the optimizer does not manage
(``extra.{name}.value``), persistent buffers (``buffer.{name}``), the quantization state of
packed 4-bit weights (``packed.{name}``, by the names ``state_dict()`` gives it beside the weight:
``<weight>.absmax`` ...; the index's ``packed`` maps each such weight to them), and the tensors of
the client state, optimizer hyperparameters and scheduler.

The index (``index.json``, written by rank 0) maps every parameter name to its shape, dtype,
param group, optimizer-state keys and scalars, and its pieces: ``{rank, prefix, at, start,
stop}`` says that elements ``[start, stop)`` of the flattened parameter are elements
``[at, at + stop - start)`` of tensor ``{prefix}.value`` (and ``{prefix}.state.{key}``) in
that rank's file. A parameter split over tensor-parallel ranks has its unsplit shape, a ``tp``
entry (``dim``, ``size``, ``blocks``: see ``parallel/tensor.py``'s ``TPSlice``) and pieces that
also name the ``tp`` rank whose slice they hold: ``start`` and ``stop`` then count elements of
that slice, flattened. Nothing in it depends on the world size, grid or stage of the run that
reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from ..core.axes import DATA
from ..core.flat import FlatGroup, Piece
from ..core.optim_shard import leaves_of, values_of
from ..core.view import CheckpointView
from .state import encode
from .tensorfile import TensorSpec, dtype_name

FORMAT, VERSION = "zerodp", 1


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def rank_json(rank: int) -> str:
    return f"rank{rank:05d}.json"


def save_range(g: FlatGroup, rank: int, world: int) -> tuple[int, int]:
    """Elements [lo, hi) of ``g``'s full buffer that data-parallel ``rank`` of ``world`` writes:
    its shard where the group is partitioned over the ranks; the ``rank``-th of ``world`` equal
    slices where every rank holds it all (stage 0); with hybrid sharding (``world`` =
    replicas x shards, data rank = replica x shards + shard) its shard's ``replica``-th slice,
    so the replicas share the writing of the shard they all hold."""
    if g.partitions == 1:
        size = -(-g.numel // world)
        lo = min(rank * size, g.numel)
        return lo, min(lo + size, g.numel)
    shards = g.partitions
    shard, replica, replicas = rank % shards, rank // shards, world // shards
    first, last = min(shard * g.shard_numel, g.numel), min((shard + 1) * g.shard_numel, g.numel)
    size = -(-(last - first) // replicas)
    lo = min(first + replica * size, last)
    return lo, min(lo + size, last)


def model_aliases(module: torch.nn.Module) -> dict[str, str]:
    """Every other name of a parameter registered under several names -> its first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def loose_parameters(view: CheckpointView) -> dict[str, torch.nn.Parameter]:
    """Model parameters outside every flat group (trainable ones not given to the optimizer)."""
    managed = {id(p) for g in view.flat_groups for p in g.params}
    return {n: p for n, p in view.module.named_parameters() if id(p) not in managed}


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` includes."""
    out = {}
    for mname, mod in module.named_modules():
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        for bname, buf in mod._buffers.items():
            if buf is not None and bname not in skip:
                out[f"{mname}.{bname}" if mname else bname] = buf
    return out


def _scalar_json(value: Any) -> tuple[float, str]:
    if isinstance(value, torch.Tensor):
        return float(value.item()), dtype_name(value.dtype)
    return (float(value), "int" if isinstance(value, int) else "float")


@dataclass
class _Part:
    """One group's range on this rank, with its pieces' optimizer states."""

    group: FlatGroup
    lo: int
    hi: int
    pieces: list[Piece]
    states: list[Optional[dict]]        # per piece: the local optimizer state, or None
    local_offsets: list[int]            # per piece: offset of its first element in the local piece
    keys: list[str] = field(default_factory=list)
    state_dtypes: dict[str, torch.dtype] = field(default_factory=dict)


class RankPlan:
    """What this rank writes: tensor specs, their parts, and its JSON record."""

    def __init__(self, view: CheckpointView, *, exclude_frozen: bool = False) -> None:
        self.view, self.exclude_frozen = view, exclude_frozen
        world, rank = view.ranks.dp_world_size, view.ranks.dp_rank
        self.dp_rank, self.dp_world = rank, world
        self.rank, self.world = view.ranks.writer_rank, view.ranks.writer_count
        self.specs: list[TensorSpec] = []
        self._sources: dict[str, Any] = {}  # name -> tensor, or callable yielding parts
        self.extra_tensors: dict[str, torch.Tensor] = {}
        self.json: dict = {"rank": self.rank, "world_size": self.world, "groups": {}}
        opt_state = view.optimizer.state
        self.parts: list[_Part] = []
        for g in view.flat_groups:
            if exclude_frozen and not g.trainable:
                continue
            if not g.tp_split and view.ranks.tp_rank != 0:  # the same on every tensor rank: rank 0 writes it
                continue
            if not g.counted_here:  # a weight tied across pipeline stages: its first stage writes it
                continue
            lo, hi = save_range(g, *self._axis_place(g))
            if lo >= hi:
                continue
            pieces = g.pieces_in(lo, hi)
            local = {pc.slot: (pc, pp) for pc, pp in zip(g.pieces, leaves_of(g)) if pp is not None}
            states, offsets = [], []
            for sp in pieces:
                pc_pp = local.get(sp.slot)
                st = opt_state.get(pc_pp[1]) if pc_pp is not None else None
                states.append(st if st else None)
                offsets.append(lo + sp.shard_lo - (g.shard_lo + pc_pp[0].shard_lo) if pc_pp else 0)
            part = _Part(g, lo, hi, pieces, states, offsets)
            self._collect_keys(part)
            self.parts.append(part)
            best = values_of(g)
            if not g.pages:
                self._add(f"g{g.index}.value", best[lo - g.shard_lo:hi - g.shard_lo])
            else:  # disk offload: read from the tile's file while written
                self._add_parts(f"g{g.index}.value", best.dtype, hi - lo,
                                lambda g=g, best=best, a=lo - g.shard_lo, b=hi - g.shard_lo:
                                    _swapped_in(g, lambda: [best[a:b]]))
            for key in part.keys:
                self._add_parts(f"g{g.index}.state.{key}", part.state_dtypes[key], hi - lo,
                                lambda part=part, key=key: _swapped_in(part.group,
                                                                       lambda: self._state_parts(part, key)))
            self.json["groups"][str(g.index)] = {
                "keys": part.keys,
                "pieces": [None if st is None else {k: _scalar_json(v) for k, v in st.items()
                                                    if k not in part.keys and v is not None}
                           for st in states]}
        self._add_unsharded()

    def _axis_place(self, g: FlatGroup) -> tuple[int, int]:
        """``(rank, world)`` of this rank on the axis ``g`` shards over: the data-parallel ranks, or for
        expert parameters the ranks holding the same experts."""
        if g.axis == DATA:
            return self.dp_rank, self.dp_world
        experts = self.view.experts
        return experts.edp_rank, experts.edp_size

    def _collect_keys(self, part: _Part) -> None:
        for _piece, st in zip(part.pieces, part.states):
            if st is None:
                continue
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() >= 1:
                    if v.dim() != 1 and v.numel() != v.shape[0]:
                        raise ValueError(f"optimizer state {k!r} has shape {tuple(v.shape)}: not elementwise")
                    if k not in part.keys:
                        part.keys.append(k)
                        part.state_dtypes[k] = v.dtype
                elif v is not None and not isinstance(v, (int, float, torch.Tensor)):
                    raise TypeError(f"optimizer state {k!r} is a {type(v).__name__}; checkpoints store "
                                    "tensors and numbers only")

    def _state_parts(self, part: _Part, key: str) -> Iterator[torch.Tensor]:
        dtype, pos = part.state_dtypes[key], 0
        device = part.group.device
        for sp, st, off in zip(part.pieces, part.states, part.local_offsets):
            if sp.shard_lo > pos:
                yield torch.zeros(sp.shard_lo - pos, dtype=dtype, device=device)
            n = sp.shard_hi - sp.shard_lo
            value = None if st is None else st.get(key)
            if value is None:
                yield torch.zeros(n, dtype=dtype, device=device)
            else:
                yield value.reshape(-1)[off:off + n].to(dtype)
            pos = sp.shard_hi
        if part.hi - part.lo > pos:
            yield torch.zeros(part.hi - part.lo - pos, dtype=dtype, device=device)

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        self.specs.append(TensorSpec(name, tensor.dtype, (tensor.numel(),)))
        self._sources[name] = tensor

    def _add_parts(self, name: str, dtype: torch.dtype, numel: int, parts) -> None:
        self.specs.append(TensorSpec(name, dtype, (numel,)))
        self._sources[name] = parts

    def add_whole(self, name: str, tensor: torch.Tensor) -> None:
        """A tensor written whole, with its shape (rank 0's extras, client tensors, RNG)."""
        t = tensor.detach()
        self.specs.append(TensorSpec(name, t.dtype, tuple(t.shape)))
        self._sources[name] = t.reshape(-1)

    def parts_of(self, name: str) -> Iterator[torch.Tensor]:
        src = self._sources[name]
        if isinstance(src, torch.Tensor):
            yield src
        else:
            yield from src()

    # -- index (rank 0) -----------------------------------------------------------------

    def stage_skeleton(self) -> dict:
        """This pipeline stage's part of the index: its parameters (by the model's names), their
        pieces in the files of the stage's ranks, its aliases and buffers (see ``index_skeleton``)."""
        view, world, exclude_frozen = self.view, self.dp_world, self.exclude_frozen
        tp_size = view.ranks.tp_size
        base = view.ranks.pipe_rank * world * tp_size  # the stage's first file
        params: dict[str, dict] = {}
        for g in view.flat_groups:
            if exclude_frozen and not g.trainable:
                continue
            if not g.counted_here:
                continue
            if g.axis != DATA:
                self._expert_skeleton(g, params)
                continue
            value_dtype = torch.float32 if view.precision.keeps_master(g.dtype) and g.trainable else g.dtype
            for s in g.slots:
                params[s.name] = {"shape": list(s.tp.shape if s.tp is not None else s.shape),
                                  "dtype": dtype_name(value_dtype),
                                  "param_group": g.param_group if g.trainable else None,
                                  "state_keys": [], "scalars": None, "pieces": []}
                if s.tp is not None:
                    params[s.name]["tp"] = s.tp.as_dict()
            # every tensor rank's groups are laid out alike (its slices have the same shapes)
            for r in range(world):
                lo, hi = save_range(g, r, world)
                for t in range(tp_size) if g.tp_split else [0]:
                    for sp in g.pieces_in(lo, hi):
                        piece = {"rank": base + r * tp_size + t, "prefix": f"g{g.index}", "at": sp.shard_lo,
                                 "start": sp.param_lo, "stop": sp.param_lo + sp.shard_hi - sp.shard_lo,
                                 "group": g.index, "piece": None}
                        if g.tp_split:
                            piece["tp"] = t
                        params[g.slots[sp.slot].name]["pieces"].append(piece)
        # number each piece within its (rank, group) so rank records can be merged
        counters: dict[tuple[int, int], int] = {}
        for entry in params.values():
            for pc in entry["pieces"]:
                k = (pc["rank"], pc["group"])
                pc["piece"] = counters.get(k, 0)
                counters[k] = pc["piece"] + 1
        order = [n for n, _ in view.module.named_parameters() if n in params or n in self.loose]
        order += [n for n in params if n not in set(order)]  # other expert-parallel ranks' experts
        for name, p in self.loose.items():
            params[name] = {"shape": list(p.shape), "dtype": dtype_name(p.dtype), "param_group": None,
                            "state_keys": [], "scalars": None,
                            "pieces": [{"rank": base, "prefix": f"extra.{name}", "at": 0, "start": 0,
                                        "stop": p.numel(), "group": None, "piece": None}]}
        return {"params": {n: params[n] for n in order}, "aliases": model_aliases(view.module),
                "buffers": {n: {"shape": list(b.shape), "dtype": dtype_name(b.dtype), "rank": base}
                            for n, b in self.buffers.items()},
                "packed": {p: {n: {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "rank": base}
                               for n, t in states.items()} for p, states in self.packed.items()}}

    def _expert_skeleton(self, g: FlatGroup, params: dict[str, dict]) -> None:
        """The index entries of an expert group: this rank's layout stands for every expert-parallel
        rank's (their experts have the same shapes in the same order), under the names each rank's
        experts have in the model without expert parallelism; slices of fused experts are placed as
        tensor parallelism's are, with the expert-parallel rank as the slice's rank."""
        experts = self.view.experts
        value_dtype = torch.float32 if self.view.precision.keeps_master(g.dtype) and g.trainable else g.dtype
        for t in range(experts.ep_size):
            names = experts.names_on(t)
            for r in range(experts.edp_size):
                lo, hi = save_range(g, r, experts.edp_size)
                for sp in g.pieces_in(lo, hi):
                    s = g.slots[sp.slot]
                    name = names.get(s.name, s.name)
                    entry = params.setdefault(name, {
                        "shape": list(s.tp.shape if s.tp is not None else s.shape), "dtype": dtype_name(value_dtype),
                        "param_group": g.param_group if g.trainable else None, "state_keys": [], "scalars": None,
                        "pieces": [], **({"tp": s.tp.as_dict()} if s.tp is not None else {})})
                    piece = {"rank": experts.file_rank(r, t), "prefix": f"g{g.index}", "at": sp.shard_lo,
                             "start": sp.param_lo, "stop": sp.param_lo + sp.shard_hi - sp.shard_lo,
                             "group": g.index, "piece": None}
                    if s.tp is not None:
                        piece["tp"] = t
                    entry["pieces"].append(piece)

    def index_skeleton(self, stages: Optional[list[dict]] = None) -> dict:
        """The index without what only the other ranks know (state keys, scalars, file records),
        made of every pipeline stage's part (``stages``, in stage order: ``stage_skeleton`` of each
        stage's first rank; this rank's own part alone without a pipeline)."""
        view = self.view
        parts = stages if stages is not None else [self.stage_skeleton()]
        merged: dict = {"params": {}, "aliases": {}, "buffers": {}, "packed": {}}
        for part in parts:
            for key in merged:
                merged[key].update(part[key])
        return {"format": FORMAT, "version": VERSION, "world_size": self.world,
                "grid": {"pipe": view.ranks.pipe_size, "data": self.dp_world, "tensor": view.ranks.tp_size},
                "zero_stage": view.zero_stage, "compute_dtype": view.compute_dtype, **merged}

    def _add_unsharded(self) -> None:
        """The first rank of each pipeline stage (rank 0 without a pipeline) writes the stage's unsharded
        tensors: loose parameters, persistent buffers and the quantization state of packed weights."""
        self.loose = {n: p for n, p in loose_parameters(self.view).items()
                      if not (self.exclude_frozen and not p.requires_grad)}
        self.buffers = persistent_buffers(self.view.module)
        self.packed = {} if self.exclude_frozen else self.view.packed_states()  # packed weights are frozen
        if self.view.ranks.stage_first:
            for name, p in self.loose.items():
                self.add_whole(f"extra.{name}.value", p.detach())
            for name, b in self.buffers.items():
                self.add_whole(f"buffer.{name}", b)
            for states in self.packed.values():
                for name, t in states.items():
                    self.add_whole(f"packed.{name}", t)


def _swapped_in(g: FlatGroup, parts) -> Iterator[torch.Tensor]:
    """The tensors ``parts()`` yields, with group ``g``'s offloaded master and states in memory
    from before they are made until they are used."""
    with g.swapped_in():
        yield from parts()


def merge_rank_records(index: dict, records: list[dict]) -> None:
    """Put the ranks' optimizer-state keys and scalars into the index's parameter entries."""
    by_piece: dict[tuple[int, int, int], tuple[list[str], Optional[dict]]] = {}
    for rec in records:
        for gi, grp in rec["groups"].items():
            for k, scalars in enumerate(grp["pieces"]):
                by_piece[(rec["rank"], int(gi), k)] = (grp["keys"], scalars)
    for name, entry in index["params"].items():
        for pc in entry["pieces"]:
            if pc["group"] is None:
                continue
            keys, scalars = by_piece.get((pc["rank"], pc["group"], pc["piece"]), ([], None))
            if scalars is None:
                continue
            if entry["scalars"] is None:
                entry["scalars"] = {k: v[0] for k, v in scalars.items()}
                entry["scalar_types"] = {k: v[1] for k, v in scalars.items()}
                entry["state_keys"] = list(keys)
            elif set(keys) != set(entry["state_keys"]):
                raise ValueError(f"parameter {name}: optimizer state keys differ between its pieces "
                                 f"({entry['state_keys']} and {keys})")


def optimizer_record(view: CheckpointView, tensors: dict[str, torch.Tensor]) -> dict:
    """The optimizer's class and hyperparameters per param group (JSON; tensors to ``tensors``)."""
    opt = view.optimizer
    groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in opt.param_groups]
    return {"type": type(opt).__name__, "module": type(opt).__module__,
            "param_groups": encode(groups, tensors, "optim.", "optimizer param_groups")}

"""The process grid: where each rank sits among pipeline, data and tensor-parallel ranks.

Ranks are laid out by a :class:`~zerodp.core.layout.Layout` (``core/layout.py``: the ordered
named axes and the one rank formula), with the tensor axis innermost, so a tensor-parallel group is
adjacent ranks (one node's fast links), then the data axis, then the pipeline axis outermost::

    global rank = (pipe * data_size + data) * tensor_size + tensor
    data        = replica * shard_size + shard          (hybrid sharding)

* ``tensor``: the ranks that hold the slices of one layer's matrices (Megatron-style tensor
  parallelism); they see the same batches.
* ``data``: the data-parallel ranks that hold the same tensor slice and see different batches;
  gradients are averaged over them and ZeRO shards over them.
* ``shard`` and ``replica``: with hybrid sharding (MiCS, ``mics_shard_size``) ZeRO shards over
  groups of ``shard_size`` consecutive data ranks and replicates across them; without it ``shard``
  is the whole data axis and ``replica`` is one rank.
* ``secondary``: with hpZ (``zero_hpz_partition_size``) groups of that many consecutive data ranks
  that share a secondary copy of the parameters (``core/secondary.py``); None without.
* ``pipe``: pipeline stages (``zerodp.pipe``).

A grid comes from the config's ``tensor_parallel.autotp_size`` (and the hybrid size), from a
DeepSpeed/Megatron ``mpu`` passed to ``initialize``, or from a ``DeviceMesh`` (``mesh_param``).
Every axis of size one has no process group of its own (``Axis.group`` is ``None`` and nothing
is communicated over it); the data axis of a grid with no other axis is the default group, as
before grids existed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from ..core import teardown
from ..core.collectives import Comm, CommCounter
from ..core.layout import Layout

#: Names a DeviceMesh dimension may carry, by axis.
MESH_NAMES = {
    "data": ("dp", "data", "data_parallel", "dp_shard", "ddp"),
    "tensor": ("tp", "tensor", "tensor_parallel", "model_parallel", "mp"),
    "pipe": ("pp", "pipe", "pipeline", "pipeline_parallel"),
}


@dataclass
class Axis:
    """One axis of the grid as this rank sees it: its size, this rank's index along it, the
    global ranks of the group (in order), and the group (``None``: the default group, or no group
    at all when the size is one and the axis was not given a group)."""

    name: str
    size: int
    rank: int
    ranks: list[int]
    group: Optional[dist.ProcessGroup] = None

    def comm(self, counter: Optional[CommCounter] = None, label: Optional[str] = None) -> Comm:
        """A ``Comm`` over the axis (of one rank, communicating nothing, when the size is one),
        adding its bytes to ``counter`` under ``label`` (default: the axis name)."""
        label = label or self.name
        if self.size == 1 and self.group is None:
            return Comm.alone(label, counter)
        return Comm(self.group, label, counter)


class GridError(ValueError):
    """A process grid that cannot be built from what was given."""


@dataclass
class Grid:
    """The grid of one process: its axes and the device mesh of its tensor axis."""

    world_size: int
    rank: int
    data: Axis
    tensor: Axis
    pipe: Axis
    shard: Axis
    replica: Axis
    everyone: Axis
    """All ranks of the grid (the world, or the data-parallel group a script passed)."""
    source: str = "world"
    """Where the layout came from: ``"world"``, ``"config"``, ``"mpu"`` or ``"mesh"``."""
    secondary: Optional[Axis] = None
    """hpZ (``zero_hpz_partition_size``): the consecutive data-parallel ranks sharing a secondary copy
    of the parameters (``core/secondary.py``); None without hpZ."""
    sequence: Optional[Axis] = None
    """Ulysses sequence parallelism (``sequence_parallel_size``): the consecutive ranks that split one
    batch's sequence (``parallel/sequence.py``); they are part of ``data`` (ZeRO shards over both).
    One rank without sequence parallelism."""
    _tp_mesh: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.sequence is None:
            self.sequence = _trivial("sequence", self.rank)

    @property
    def layout(self) -> Layout:
        """The grid's shape as named axes, outermost first (``core/layout.py``): the order the ranks are
        numbered in when the grid is built from sizes, and checkpoints number their files in."""
        return Layout.of(pipe=self.pipe.size, replica=self.replica.size,
                         shard=self.shard.size // self.sequence.size, sequence=self.sequence.size,
                         tensor=self.tensor.size)

    @property
    def coords(self) -> dict[str, int]:
        """This rank's index along each axis of :attr:`layout`."""
        return {"pipe": self.pipe.rank, "replica": self.replica.rank,
                "shard": self.shard.rank // self.sequence.size, "sequence": self.sequence.rank,
                "tensor": self.tensor.rank}

    @property
    def only_data(self) -> bool:
        """Whether the grid is one data-parallel group, unsplit: no tensor, pipeline or replica axis."""
        return self.tensor.size == 1 and self.pipe.size == 1 and self.replica.size == 1

    @property
    def tp_size(self) -> int:
        return self.tensor.size

    @property
    def deepspeed_batch_ranks(self) -> Optional[int]:
        """How many ranks DeepSpeed counts in ``train_batch_size`` where that is not the data-parallel
        size: tensor parallelism from the config or ``tp_model_init`` (no ``mpu``, no mesh, no
        pipeline), where DeepSpeed counts every rank; else None."""
        if self.source == "config" and self.tp_size > 1 and self.pipe.size == 1:
            return self.everyone.size
        return None

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks that run different batches (the sequence ranks of a group share one)."""
        return self.data.size // self.sequence.size

    @property
    def dp_rank(self) -> int:
        return self.data.rank // self.sequence.size

    @property
    def tp_mesh(self):
        """A one-dimensional ``DeviceMesh`` over the tensor axis (what torch's tensor parallelism
        takes), or None without tensor parallelism."""
        if self._tp_mesh is None and self.tensor.size > 1:
            from torch.distributed.device_mesh import DeviceMesh

            from ..core.device import default_device, select
            device = default_device()
            if device.type == "cuda" and str(dist.get_backend(self.tensor.group)).lower() == "gloo":
                raise ValueError("tensor parallelism on CUDA needs an NCCL process group: torch's DTensor "
                                 "over gloo ends the process on CUDA tensors (a segmentation fault in "
                                 "its redistribution, seen with torch 2.11; benchmarks/gloo_cuda_probe.py "
                                 "shows it); start the group with backend 'nccl'")
            select(device)  # else the mesh sets cuda:LOCAL_RANK, which need not be the engine's device
            self._tp_mesh = DeviceMesh.from_group(self.tensor.group, device.type)
        return self._tp_mesh

    def describe(self) -> str:
        parts = [f"data {self.data.size}"]
        if self.shard.size != self.data.size:
            parts[0] += f" (shard {self.shard.size} x replica {self.replica.size})"
        if self.secondary is not None:
            parts[0] += f" (hpZ groups of {self.secondary.size})"
        if self.tensor.size > 1:
            parts.append(f"tensor {self.tensor.size}")
        if self.pipe.size > 1:
            parts.append(f"pipeline {self.pipe.size}")
        if self.sequence.size > 1:
            parts[0] = f"data {self.dp_size} x sequence {self.sequence.size} (ZeRO over {self.data.size})"
        return " x ".join(parts)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _trivial(name: str, rank: int) -> Axis:
    return Axis(name, 1, 0, [rank])


def _axis_of(name: str, group: Optional[dist.ProcessGroup]) -> Axis:
    """The axis a given process group makes (the default group for ``None``)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(size)]
    return Axis(name, size, rank, ranks, group)


#: Groups made by earlier grids of this process, by their ranks (a second engine over the same
#: layout reuses them instead of opening new connections): ``(default group, ranks) -> group``.
_GROUPS: dict[tuple, Optional[dist.ProcessGroup]] = {}
teardown.on_exit_release(_GROUPS.clear)


def new_axis(name: str, all_ranks: list[list[int]], me: int) -> Axis:
    """Make one group per list of ``all_ranks`` (every rank makes all of them, in the same order,
    as torch requires, member or not: torch numbers groups by how many a rank made; lists of one
    rank need none) and return this rank's axis (of this rank alone when it is in no list)."""
    mine = next((r for r in all_ranks if me in r), [me])
    world = dist.group.WORLD
    for ranks in all_ranks:
        key = (world, tuple(ranks))
        if len(ranks) > 1 and key not in _GROUPS:
            _GROUPS[key] = dist.new_group(ranks)
    if len(mine) == 1:
        return Axis(name, 1, 0, mine)
    return Axis(name, len(mine), mine.index(me), mine, _GROUPS[(world, tuple(mine))])


def build_grid(tp_size: int = 1, pp_size: int = 1, shard_size: Optional[int] = None,
               data_group: Optional[dist.ProcessGroup] = None, source: str = "config",
               sequence: Optional[Axis] = None) -> Grid:
    """The grid of the whole world (or of ``data_group``, which must then be the only axis)
    with the given tensor, pipeline and hybrid-shard sizes; with a ``sequence`` axis (made by
    ``parallel.sequence.initialize_sequence_parallel``) sequence parallelism beside data parallelism
    alone."""
    world, me = _world()
    if sequence is not None and sequence.size > 1:
        return _with_sequence(world, me, tp_size, pp_size, shard_size, data_group, sequence, source)
    if data_group is not None:
        if tp_size > 1 or pp_size > 1:
            raise GridError("process_group= gives the data-parallel group alone; with tensor or pipeline "
                            "parallelism pass an mpu or a DeviceMesh (mesh_param=) instead")
        data = _axis_of("data", data_group)
        return _with_hybrid(world, me, data, _trivial("tensor", me), _trivial("pipe", me), shard_size, "world")
    for what, size in (("tensor_parallel.autotp_size", tp_size), ("pipeline stages", pp_size)):
        if size < 1 or world % size:
            raise GridError(f"{what}: {size} does not divide the world size {world}")
    if world % (tp_size * pp_size):
        raise GridError(f"tensor parallel size {tp_size} x pipeline stages {pp_size} does not divide the "
                        f"world size {world}")
    dp_size = world // (tp_size * pp_size)
    if tp_size == 1 and pp_size == 1:  # the data axis is the world: the default group, as always
        data = _axis_of("data", None) if world > 1 else _trivial("data", me)
        return _with_hybrid(world, me, data, _trivial("tensor", me), _trivial("pipe", me), shard_size, source)
    layout = Layout.of(pipe=pp_size, shard=dp_size, tensor=tp_size)
    tensor = new_axis("tensor", layout.groups(["tensor"]), me)
    data = new_axis("data", layout.groups(["shard"]), me)
    pipe = new_axis("pipe", layout.groups(["pipe"]), me)
    return _with_hybrid(world, me, data, tensor, pipe, shard_size, source)


def _with_sequence(world: int, me: int, tp_size: int, pp_size: int, shard_size: Optional[int],
                   data_group: Optional[dist.ProcessGroup], sequence: Axis, source: str) -> Grid:
    """Data x sequence parallelism over the whole world: ZeRO's data axis is every rank, the sequence
    axis blocks of consecutive ranks (``parallel/sequence.py``)."""
    others = [n for n, v in (("tensor", tp_size > 1), ("pipeline", pp_size > 1), ("hybrid sharding", bool(shard_size)),
                             ("a process_group= narrower than the world", data_group is not None)) if v]
    if others:
        raise GridError(f"sequence_parallel_size: sequence parallelism with {others[0]} is not supported (DeepSpeed "
                        "does not compose them either); use it beside data parallelism alone")
    data = _axis_of("data", None)
    return Grid(world, me, data, _trivial("tensor", me), _trivial("pipe", me), data, _trivial("replica", me), data,
                source, sequence=sequence)


def _with_hybrid(world: int, me: int, data: Axis, tensor: Axis, pipe: Axis, shard_size: Optional[int],
                 source: str) -> Grid:
    """Split the data axis into shard groups of ``shard_size`` consecutive data ranks and the
    replica groups across them (every data group of the grid is split the same way)."""
    everyone = data if data.size * tensor.size * pipe.size != world else \
        (_axis_of("everyone", None) if world > 1 else _trivial("everyone", me))
    if not shard_size or shard_size >= data.size:
        return Grid(world, me, data, tensor, pipe, data, _trivial("replica", me), everyone, source)
    if data.size * tensor.size * pipe.size != world:
        raise GridError("hybrid sharding splits the data-parallel ranks of the whole world; a process_group= "
                        "narrower than the world cannot be split (pass an mpu or a DeviceMesh instead)")
    if data.size % shard_size:
        raise GridError(f"hybrid shard size {shard_size} does not divide the data-parallel size {data.size}")
    # every rank must create every group: gather all data groups' rank lists (they tile the world);
    # each splits as a layout of replicas x shards over its own ranks
    all_data = _all_lists(data.ranks, world)
    split = Layout.of(replica=data.size // shard_size, shard=shard_size)
    shard = new_axis("shard", _within(all_data, split, "shard"), me)
    replica = new_axis("replica", _within(all_data, split, "replica"), me)
    return Grid(world, me, data, tensor, pipe, shard, replica, everyone, source)


def with_secondary(grid: Grid, size: int) -> Grid:
    """``grid`` with hpZ's secondary axis (``zero_hpz_partition_size``): groups of ``size``
    consecutive data-parallel ranks, which share a secondary copy of the parameters (nothing changes
    for a size of 1). The data-parallel group must be the whole world, with no tensor or pipeline
    axis."""
    if size <= 1:
        return grid
    if grid.tensor.size > 1 or grid.pipe.size > 1:
        raise GridError("zero_optimization.zero_hpz_partition_size: hpZ with tensor or pipeline parallelism is not "
                        "implemented (its groups would have to follow the data axis of each tensor slice and "
                        "stage); leave it at 1 there")
    data = grid.data
    if grid.sequence.size > 1:
        raise GridError("zero_optimization.zero_hpz_partition_size: hpZ with sequence parallelism is not supported")
    if data.size != grid.world_size:
        raise GridError("zero_optimization.zero_hpz_partition_size: hpZ splits the data-parallel ranks of the whole "
                        "world; a process_group= narrower than the world cannot be split")
    if size > data.size or data.size % size:
        raise GridError(f"zero_optimization.zero_hpz_partition_size: {size} does not divide the {data.size} "
                        "data-parallel ranks")
    grid.secondary = new_axis("secondary", _within([data.ranks], Layout.of(replica=data.size // size, shard=size),
                                                   "shard"), grid.rank)
    return grid


def _within(groups: list[list[int]], split: Layout, axis: str) -> list[list[int]]:
    """The groups along ``axis`` of ``split`` laid over each of ``groups`` (a group's ``i``-th rank
    is ``split``'s rank ``i``), as global rank lists."""
    return [[g[i] for i in sub] for g in groups for sub in split.groups([axis])]


def _all_lists(mine: list[int], world: int) -> list[list[int]]:
    """Every rank's group (equal-sized groups tiling the world), deduplicated, in order of their
    first rank."""
    if world == 1:
        return [mine]
    seen = {tuple(o) for o in Comm(None, "grid").all_gather_ints(mine)}
    return [list(s) for s in sorted(seen, key=lambda s: s[0])]


def grid_from_mpu(mpu: Any, shard_size: Optional[int] = None) -> Grid:
    """The grid DeepSpeed's ``mpu`` contract describes: ``get_data_parallel_group()`` and
    ``get_tensor_model_parallel_group()`` (or ``get_model_parallel_group()``), and a pipeline
    group when the mpu has one."""
    world, me = _world()
    if callable(getattr(mpu, "initialize_sequence_parallel", None)):  # DeepSpeed's Ulysses mpu (parallel_state_sp)
        sequence = _axis_of("sequence", mpu.get_sequence_parallel_group())
        if world % sequence.size or sequence.ranks != list(range(sequence.ranks[0], sequence.ranks[0] + sequence.size)):
            raise GridError("mpu: the sequence-parallel groups must be blocks of consecutive ranks, as "
                            "initialize_sequence_parallel makes them")
        return build_grid(shard_size=shard_size, sequence=sequence, source="mpu")
    for name in ("get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank"):
        if not callable(getattr(mpu, name, None)):
            raise GridError(f"mpu: the object passed has no {name}(); DeepSpeed's contract is "
                            "get_{data,model}_parallel_{group,world_size,rank}()")
    tp_getter = next((getattr(mpu, n) for n in ("get_tensor_model_parallel_group", "get_model_parallel_group")
                      if callable(getattr(mpu, n, None))), None)
    if tp_getter is None:
        raise GridError("mpu: the object passed has neither get_tensor_model_parallel_group() nor "
                        "get_model_parallel_group()")
    data = _axis_of("data", mpu.get_data_parallel_group())
    tensor = _axis_of("tensor", tp_getter())
    pp_getter = getattr(mpu, "get_pipeline_model_parallel_group", None)
    pipe = _axis_of("pipe", pp_getter()) if callable(pp_getter) and _pp_size(mpu) > 1 else _trivial("pipe", me)
    if data.size != mpu.get_data_parallel_world_size():
        raise GridError(f"mpu: get_data_parallel_world_size() says {mpu.get_data_parallel_world_size()}, "
                        f"but its group has {data.size} ranks")
    if data.size * tensor.size * pipe.size != world:
        raise GridError(f"mpu: data {data.size} x tensor {tensor.size} x pipeline {pipe.size} ranks do not "
                        f"make the world size {world}")
    return _with_hybrid(world, me, data, tensor, pipe, shard_size, "mpu")


def _pp_size(mpu: Any) -> int:
    getter = getattr(mpu, "get_pipeline_model_parallel_world_size", None)
    return getter() if callable(getter) else 1


def grid_from_mesh(mesh: Any, shard_size: Optional[int] = None) -> Grid:
    """The grid a ``DeviceMesh`` (``mesh_param``) describes, by its dimension names (``dp``, ``tp``,
    ``pp`` and the longer spellings in ``MESH_NAMES``), or DeepSpeed's ``(data, sequence)`` tuple
    (sequence parallelism is not implemented: its size must be 1)."""
    world, me = _world()
    if isinstance(mesh, (tuple, list)):
        if len(mesh) != 2 or mesh[1] != 1:
            raise GridError(f"mesh_param: {tuple(mesh)} is DeepSpeed's (data parallel, sequence parallel) "
                            "sizes; sequence parallelism is not implemented (its size must be 1); pass a "
                            "DeviceMesh with dims named 'dp' and 'tp' for tensor parallelism")
        if mesh[0] != world:
            raise GridError(f"mesh_param: data parallel size {mesh[0]} is not the world size {world}")
        return build_grid(shard_size=shard_size, source="mesh")
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise GridError("mesh_param: the DeviceMesh has no mesh_dim_names; name its dimensions "
                        f"(data: {MESH_NAMES['data'][0]!r}, tensor: {MESH_NAMES['tensor'][0]!r}, "
                        f"pipeline: {MESH_NAMES['pipe'][0]!r})")
    axes = {}
    for dim, name in enumerate(names):
        kind = next((k for k, spellings in MESH_NAMES.items() if name in spellings), None)
        if kind is None:
            raise GridError(f"mesh_param: dimension {name!r} names no axis zerodp knows; allowed: "
                            + ", ".join(f"{k}: {', '.join(v)}" for k, v in MESH_NAMES.items()))
        if kind in axes:
            raise GridError(f"mesh_param: two dimensions name the {kind} axis")
        axes[kind] = _axis_of(kind, mesh.get_group(dim))
    data = axes.get("data") or _trivial("data", me)
    tensor = axes.get("tensor") or _trivial("tensor", me)
    pipe = axes.get("pipe") or _trivial("pipe", me)
    if data.size * tensor.size * pipe.size != world:
        raise GridError(f"mesh_param: the mesh's {tuple(mesh.shape)} ranks are not the world size {world}")
    grid = _with_hybrid(world, me, data, tensor, pipe, shard_size, "mesh")
    if "tensor" in axes and mesh.ndim == 1:
        grid._tp_mesh = mesh
    return grid

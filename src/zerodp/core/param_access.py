"""DeepSpeed's parameter-access functions (``deepspeed.utils.safe_get_full_grad`` and its family),
and ``ParamAccess``: what they read and write of an engine.

A parameter is found in the engine that manages it through the registry of live engines
(``live.py``); within it, a flat group and a slot (``flat.py``). This rank holds the part of the
parameter that falls into its shard (a ``Piece``, possibly none): of the fp32 master (the
parameter shard itself in fp32 training), of the reduced gradient shard, and of each optimizer
state (the optimizer's state of the piece's leaf tensor). So:

* the *full* getters put this rank's piece into a zero tensor of the parameter's size and sum it
  over the group the parameter is sharded over: a collective wherever the group is sharded
  (stages 1-3), which every rank of the data-parallel group must call, as with DeepSpeed; at
  stage 0 every rank holds everything and nothing is communicated. They return fp32 tensors in
  the parameter's shape (under tensor parallelism, the shape of this rank's slice);
* the *local* getters return this rank's piece, flat (empty where the parameter has no element in
  this rank's shard);
* the setters write this rank's piece from the full (or local) value, and never communicate.
  Setting the fp32 parameter also rounds it into the model's parameter, and where the full
  parameter is materialized on this rank (stages 0-2, or inside a stage-3 gather), into that too,
  so the next forward computes with the new value.

Gradients are readable between the backward that reduced them and the step that applies them:
averaged over the data-parallel ranks and unscaled (fp16), in fp32, as the optimizer will see them
before clipping. At stages 0-1 that is after the accumulation boundary's backward; at stages 2-3
every reducing backward leaves the sum so far. Otherwise (before a backward, after the step) there
is no gradient and the getters return None. A parameter no engine trains (frozen, or never given
to an engine) gives None, and setters leave it alone.

With optimizer offload the masters and states are read and written where they live (host memory,
or their file on disk, paged in for the duration).
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import torch

from . import live
from .flat import FlatGroup, Piece
from .optim_shard import master_of, values_of

if TYPE_CHECKING:
    from .collectives import Comm


class ParamAccess:
    """What the parameter-access functions read and write of one engine (only its public
    members): its flat groups, optimizer, groups and the gradient's divisor."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    @property
    def flat_groups(self) -> list[FlatGroup]:
        return self._engine.flat_groups

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer over this rank's pieces (None for an engine without one)."""
        return self._engine.optimizer

    def comm_of(self, g: FlatGroup) -> "Comm":
        """The ranks flat group ``g`` is sharded over (its axis, ``axes.py``)."""
        return self._engine.shard_axes.of(g)

    @property
    def replica_comm(self) -> "Comm":
        """Hybrid sharding's replicas of this rank's shard (one rank without hybrid sharding):
        their gradients are summed by the step, so a read before it sums them itself."""
        return self._engine.replica_comm

    @property
    def grad_divisor(self) -> float:
        """What the reduced gradient sums are divided by: data-parallel (times sequence-parallel) ranks
        times the loss scale."""
        return self._engine.seq_dp_world_size * self._engine.loss_scale

    @property
    def gradients_reduced(self) -> bool:
        return self._engine.gradients_reduced


_ACCESS: "weakref.WeakKeyDictionary[Any, dict[int, tuple[FlatGroup, int]]]" = weakref.WeakKeyDictionary()


class _Found(NamedTuple):
    """Where a trained parameter lives: its engine, flat group and slot, and this rank's piece of it
    with the optimizer's leaf tensor for that piece (None where this rank holds none of it)."""

    access: ParamAccess
    g: FlatGroup
    slot: int
    pc: Optional[Piece]
    leaf: Optional[torch.nn.Parameter]

    def part(self, shard: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a shard-sized tensor."""
        return shard[self.pc.shard_lo:self.pc.shard_hi]

    def of_full(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the flattened full parameter ``flat``."""
        return flat[self.pc.param_lo:self.pc.param_lo + self.pc.shard_hi - self.pc.shard_lo]

    def empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.float32, device=self.g.device)


def _locate(param: torch.Tensor) -> Optional[_Found]:
    """Where ``param`` lives; None if no live engine trains it."""
    for engine in live.live_engines():
        where = _ACCESS.get(engine)
        if where is None:
            where = _ACCESS[engine] = {id(p): (g, i) for g in engine.flat_groups for i, p in enumerate(g.params)}
        found = where.get(id(param))
        if found is not None and found[0].params[found[1]] is param:
            g, slot = found
            if not g.trainable:
                return None
            for k, pc in enumerate(g.pieces):
                if pc.slot == slot:
                    leaf = g.optim.leaves[k] if g.optim is not None else None
                    return _Found(ParamAccess(engine), g, slot, pc, leaf)
            return _Found(ParamAccess(engine), g, slot, None, None)
    return None


def _fp32_values(g: FlatGroup) -> torch.Tensor:
    """This rank's shard of fp32 values: the master, or the parameter shard in fp32 training."""
    return values_of(g)


def _full(f: _Found, part: Optional[torch.Tensor], flags: tuple[float, ...] = ()) -> tuple[torch.Tensor, list[float]]:
    """The parameter assembled in fp32 from every rank's piece (``part``: this rank's, flat), summed
    over the group where it is sharded; with it the sums of every rank's ``flags``."""
    s = f.g.slots[f.slot]
    out = torch.zeros(s.numel + len(flags), dtype=torch.float32, device=f.g.device)
    if f.pc is not None and part is not None:
        f.of_full(out).copy_(part)
    for k, flag in enumerate(flags):
        out[s.numel + k] = flag
    if f.g.partitions > 1:
        f.access.comm_of(f.g).all_reduce_sum(out)
    return out[:s.numel].view(s.shape), out[s.numel:].tolist()


def _reduced_grad(f: _Found) -> Optional[torch.Tensor]:
    """This rank's piece of the reduced gradient, averaged and unscaled, in fp32 (None without a
    piece, or outside the window between backward and step)."""
    if f.pc is None or not _has_grads(f):
        return None
    return f.part(f.g.grads.shard).to(torch.float32, copy=True).mul_(1.0 / f.access.grad_divisor)


def _over_replicas(f: _Found, t: torch.Tensor) -> torch.Tensor:
    if f.access.replica_comm.world_size > 1:
        f.access.replica_comm.all_reduce_sum(t)
    return t


def _has_grads(f: _Found) -> bool:
    return f.access.gradients_reduced and f.g.grads.shard is not None


def _write_fp32(f: _Found, part: torch.Tensor) -> None:
    """Write this rank's piece of the fp32 values and of the parameter shard."""
    with torch.no_grad():
        f.part(_fp32_values(f.g)).copy_(part)
        if master_of(f.g) is not None:
            f.part(f.g.shard).copy_(part)


# -- full values ---------------------------------------------------------------------------------

def safe_get_full_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The fp32 master of ``param`` (its value in fp32 training), whole, in the parameter's shape.
    Collective at stages 1-3: every rank calls it."""
    f = _locate(param)
    if f is None:
        return None
    with f.g.swapped_in():
        return _full(f, None if f.pc is None else f.part(_fp32_values(f.g)))[0]


def safe_get_full_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The reduced gradient of ``param``: averaged over the data-parallel ranks, unscaled, fp32, in
    the parameter's shape, as the optimizer will see it (before clipping); None outside the window
    between the backward that reduced it and the step. Collective at stages 1-3."""
    f = _locate(param)
    if f is None or not _has_grads(f):
        return None
    return _over_replicas(f, _full(f, _reduced_grad(f))[0])


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """The optimizer's elementwise state ``optim_state_key`` of ``param`` (Adam's ``"exp_avg"``,
    ``"exp_avg_sq"``), whole, fp32, in the parameter's shape; None before the optimizer made it.
    Collective at stages 1-3."""
    f = _locate(param)
    if f is None:
        return None
    with f.g.swapped_in():
        value = _state(f, optim_state_key)
        bad = value is not None and not _elementwise(f, value)
        out, (has, wrong) = _full(f, None if value is None or bad else value.reshape(-1),
                                  flags=(float(value is not None), float(bad)))
    if wrong:  # the same verdict on every rank, so none is left waiting in the collective
        raise ValueError(f"optimizer state {optim_state_key!r} is not elementwise (not one value per "
                         "parameter element): there is no full tensor of it to assemble")
    return out if has else None


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the fp32 master of ``param`` from its full ``value`` (the same on every rank), and the
    model's parameter (rounded to its dtype) with it. No communication."""
    f = _locate(param)
    if f is None:
        return
    flat = _full_value(f, value)
    with torch.no_grad(), f.g.swapped_in():
        if f.pc is not None:
            _write_fp32(f, f.of_full(flat))
        if f.g.gathered:  # the full parameter this rank computes with (stages 0-2, or inside a gather)
            f.g.view(f.g.full, f.slot).copy_(flat.view(f.g.slots[f.slot].shape))


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the optimizer's state ``optim_state_key`` of ``param`` from its full ``value``. No
    communication; the optimizer must have made the state (after its first step)."""
    f = _locate(param)
    if f is not None:
        _set_state(f, f.of_full(_full_value(f, value)) if f.pc is not None else None, optim_state_key)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the reduced gradient of ``param`` (between backward and step) from its full ``value``,
    averaged and unscaled as ``safe_get_full_grad`` returns it. No communication."""
    f = _locate(param)
    if f is None:
        return
    if not _has_grads(f):
        raise RuntimeError("safe_set_full_grad: no reduced gradient to set (call it after backward and before step)")
    if f.pc is not None:
        with torch.no_grad():
            f.part(f.g.grads.shard).copy_(f.of_full(_full_value(f, value)) * f.access.grad_divisor)


def safe_update_full_grad_vectorized(param_list: list[torch.Tensor],
                                     update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Replace each parameter's reduced gradient ``g`` by ``update_func(g, param)`` (full values,
    as ``safe_get_full_grad`` gives them). Collective at stages 1-3."""
    for p in param_list:
        grad = safe_get_full_grad(p)
        if grad is not None:
            safe_set_full_grad(p, update_func(grad, p))


# -- this rank's part ----------------------------------------------------------------------------

def safe_get_local_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's part of ``param``'s fp32 master: the elements in its shard, flat (empty if none)."""
    f = _locate(param)
    if f is None or f.pc is None:
        return None if f is None else f.empty()
    with f.g.swapped_in():
        return f.part(_fp32_values(f.g)).to(f.g.device, torch.float32, copy=True)


def safe_get_local_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's part of ``param``'s reduced gradient (fp32, averaged, flat); None outside the
    window between backward and step. Collective over hybrid sharding's replicas only."""
    f = _locate(param)
    if f is None or not _has_grads(f):
        return None
    return f.empty() if f.pc is None else _over_replicas(f, _reduced_grad(f))


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """This rank's part of ``param``'s optimizer state ``optim_state_key`` (flat; None if the
    optimizer has not made it, empty if this rank holds no element of ``param``)."""
    f = _locate(param)
    if f is None or f.pc is None:
        return None if f is None else f.empty()
    with f.g.swapped_in():
        value = _state(f, optim_state_key)
        return None if value is None else value.reshape(-1).to(f.g.device, torch.float32, copy=True)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's part of ``param``'s fp32 master (and of the model's parameter) from ``value``,
    as ``safe_get_local_fp32_param`` returns it."""
    f = _locate(param)
    if f is None:
        return
    part = _local_value(f, value)
    if f.pc is None:
        return
    with torch.no_grad(), f.g.swapped_in():
        _write_fp32(f, part)
        if f.g.gathered and f.g.shards_parameters:  # inside a stage-3 gather: the full copy too
            f.part(f.g.shard_of(f.g.full)).copy_(part)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's part of ``param``'s optimizer state ``optim_state_key`` from ``value``."""
    f = _locate(param)
    if f is not None:
        _set_state(f, _local_value(f, value), optim_state_key)


# -- checks and state ----------------------------------------------------------------------------

def _full_value(f: _Found, value: torch.Tensor) -> torch.Tensor:
    s = f.g.slots[f.slot]
    if value.numel() != s.numel:
        raise ValueError(f"parameter {s.name} has {s.numel} elements (shape {tuple(s.shape)}); "
                         f"the value given has {value.numel()}")
    return value.detach().reshape(-1)


def _local_value(f: _Found, value: torch.Tensor) -> torch.Tensor:
    n = 0 if f.pc is None else f.pc.shard_hi - f.pc.shard_lo
    if value.numel() != n:
        raise ValueError(f"this rank holds {n} elements of the parameter; the value given has {value.numel()}")
    return value.detach().reshape(-1)


def _state(f: _Found, key: str) -> Optional[torch.Tensor]:
    """The optimizer's state ``key`` of this rank's piece (None if it has none)."""
    if f.leaf is None or f.access.optimizer is None:
        return None
    value = f.access.optimizer.state.get(f.leaf, {}).get(key)
    return value if isinstance(value, torch.Tensor) else None


def _elementwise(f: _Found, value: torch.Tensor) -> bool:
    return value.dim() >= 1 and value.numel() == f.pc.shard_hi - f.pc.shard_lo


def _set_state(f: _Found, part: Optional[torch.Tensor], key: str) -> None:
    """Write this rank's piece (``part``, flat) of the optimizer's state ``key``."""
    if f.pc is None:
        return
    with torch.no_grad(), f.g.swapped_in():
        value = _state(f, key)
        if value is None or not _elementwise(f, value):
            raise KeyError(f"parameter {f.g.slots[f.slot].name} has no elementwise optimizer state {key!r} "
                           "(the optimizer makes its state in its first step)")
        value.view(-1).copy_(part)

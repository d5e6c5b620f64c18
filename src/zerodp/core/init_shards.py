"""Parameters built inside ``zero.Init``: each keeps only this rank's slice of its values.

When a module built inside the context has finished its constructor (so its parameters hold
the values its ``reset_parameters`` gave them), each real parameter it registered is replaced
by one that looks like DeepSpeed's partitioned parameter: empty data (``torch.Size([0])``) on the
real device, its shape in ``ds_shape``, and an :class:`InitShard`: the
flattened values, padded to a multiple of the group size, cut into one contiguous slice per
rank; this rank keeps its slice (:class:`ShardedConstruction`, which wraps the ``__init__`` of
every ``nn.Module`` class while active, as DeepSpeed's ``Init`` does). The values are rank 0's
(broadcast as the parameter is sharded, as DeepSpeed does), so every rank agrees whatever its
random state. No rank holds more than one module's full parameters at a time. A parameter
registered after its module was built (``module.weight = nn.Parameter(...)``) is sharded at once.

Until an engine adopts them, such parameters can be read and written whole with
``GatheredParameters`` (:func:`gathered`): inside, the parameter holds its full values on every
rank; on exit with ``modifier_rank=r``, rank r's values become every rank's slices. That is how
``transformers`` loads a checkpoint into a model built under ``zero.Init`` (rank 0 copies each
module's weights in, inside ``GatheredParameters(params, modifier_rank=0)``) and initializes the
weights the checkpoint lacks.

``zerodp.initialize`` (stage 3) then gives each unit its values from the slices
(:func:`full_values`, one unit at a time), keeps this rank's shard of the unit's flat groups,
and drops the slices. A parameter built inside ``Init`` never holds values of its own outside
those moments. Code that follows ``param.device`` or ``model.device`` gets the real device (so
``peft`` puts a new adapter where its base layer's weight lives, with the values it gave it),
code that reads the shape reads ``ds_shape`` as it does under DeepSpeed, and code that reads
values needs ``GatheredParameters``.

What ``initialize`` makes of a model at stage 3 (:func:`prepare_for_sharding`): a parameter
created after ``Init`` (an adapter, a new head) keeps the values its creator gave it (rank 0's,
sharded in place as ``Init`` would have); a parameter on the meta device with no values behind
it, in a model whose other parameters have values, is an error naming it, never initialized
afresh without a word.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import itertools
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .collectives import Comm
from .device import default_device


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's parameter status names (``param.ds_status``)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


@dataclass
class InitShard:
    """This rank's slice of a parameter built inside ``zero.Init``."""

    data: torch.Tensor          # 1-D: chunk ``comm.rank`` of the flat values, padded to ``comm.world_size`` chunks
    shape: torch.Size
    comm: Comm                  # the group whose ranks share the slices

    @property
    def numel(self) -> int:
        return self.shape.numel()


_ATTR = "_zerodp_init_shard"  # in the parameter's __dict__ (torch.utils.swap_tensors forbids weak references)
_ids = itertools.count()


def _slice_of(flat: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Chunk ``comm.rank`` of ``flat`` padded with zeros to ``comm.world_size`` equal chunks."""
    per = -(-flat.numel() // comm.world_size)
    out = torch.zeros(per, dtype=flat.dtype, device=flat.device)
    lo, hi = comm.rank * per, min((comm.rank + 1) * per, flat.numel())
    if hi > lo:
        out[: hi - lo].copy_(flat[lo:hi])
    return out


def _sliced(param: torch.Tensor, comm: Comm, dtype: Optional[torch.dtype]) -> tuple[InitShard, torch.Tensor]:
    """This rank's slice of ``param``'s values (rank 0's: broadcast from rank 0 of ``comm``'s
    group first), in ``dtype`` if given and the parameter is floating point; and the empty
    tensor that stands for the parameter's data from then on (on the real device)."""
    full = param.detach()
    if dtype is not None and full.is_floating_point():
        full = full.to(dtype)
    if comm.rank == 0:
        full = full.to(default_device()).contiguous()
    else:  # rank 0's values land in a buffer of this rank's own, never in the parameter's storage
        full = torch.empty(full.shape, dtype=full.dtype, device=default_device())  # (which may map a file)
    comm.broadcast(full, src_rank=0)
    shard = InitShard(_slice_of(full.reshape(-1), comm), param.shape, comm)
    return shard, torch.empty(0, dtype=full.dtype, device=full.device)


class PartitionNumel:
    """``param.partition_numel()``, a method of DeepSpeed's ZeRO-3 parameter: how many of its
    elements this rank keeps (Lightning's model summary calls it at stage 3). A callable object,
    not a lambda, so that a module holding the parameter still pickles."""

    def __init__(self, numel: int) -> None:
        self.numel = int(numel)

    def __call__(self) -> int:
        return self.numel


def _describe(param: nn.Parameter, shard: InitShard) -> None:
    """Give ``param`` its slice and DeepSpeed's attributes of a partitioned parameter."""
    setattr(param, _ATTR, shard)
    param.ds_id = next(_ids)
    param.ds_shape = shard.shape
    param.ds_numel = shard.numel
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    param.ds_tensor = shard.data
    param.partition_numel = PartitionNumel(shard.data.numel())
    param.ds_persist = False
    param.ds_active_sub_modules = set()


def shard_parameter(param: nn.Parameter, comm: Comm, dtype: Optional[torch.dtype] = None) -> nn.Parameter:
    """A parameter standing for ``param`` that keeps this rank's slice of its values (rank 0's),
    in ``dtype`` if given and the parameter is floating point: empty data on the real device, with
    DeepSpeed's ``ds_*`` attributes (``ds_shape`` is the shape)."""
    shard, empty = _sliced(param, comm, dtype)
    new = nn.Parameter(empty, requires_grad=param.requires_grad)
    _describe(new, shard)
    return new


def shard_in_place(param: nn.Parameter, comm: Comm) -> None:
    """Make ``param`` itself keep only this rank's slice of its values (rank 0's), as if it had
    been built in ``Init``: the same object, so optimizers and param groups that hold it still do."""
    shard, empty = _sliced(param, comm, None)
    param.data = empty
    _describe(param, shard)


def keep_own_slice(param: nn.Parameter, comm: Comm) -> None:
    """Make ``param`` itself keep only this rank's slice of the values it holds, with no
    communication: for values every rank computed alike (a weight read from the same file and
    quantized the same way, ``core/packed.py``), where ``shard_in_place`` would broadcast rank 0's."""
    full = param.detach().reshape(-1)
    shard = InitShard(_slice_of(full, comm), param.shape, comm)
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    _describe(param, shard)


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of ``param``'s values: ``ds_shape`` for a parameter kept as a slice (whose data is
    empty), else its own shape."""
    shard = init_shard(param)
    return shard.shape if shard is not None else param.shape


def has_no_values(param: torch.Tensor) -> bool:
    """Whether ``param`` holds no values of its own here: on the meta device, or kept as a slice."""
    return param.is_meta or init_shard(param) is not None


def init_shard(param: torch.Tensor) -> Optional[InitShard]:
    """The slice ``param`` keeps, if it was built inside ``zero.Init`` and no engine has
    adopted it yet."""
    return param.__dict__.get(_ATTR)


def full_values(shard: InitShard) -> torch.Tensor:
    """The parameter's full values (every rank's slice gathered), shaped like it."""
    full = torch.empty(shard.data.numel() * shard.comm.world_size, dtype=shard.data.dtype, device=shard.data.device)
    full.chunk(shard.comm.world_size)[shard.comm.rank].copy_(shard.data)
    shard.comm.all_gather(full)
    return full[: shard.numel].view(shard.shape)


def set_values(shard: InitShard, full: torch.Tensor, src_rank: int) -> None:
    """Make rank ``src_rank``'s ``full`` (its values, shaped like the parameter) every rank's."""
    full = full.detach().to(shard.data.device).contiguous()
    shard.comm.broadcast(full, src_rank=src_rank)
    shard.data.copy_(_slice_of(full.reshape(-1), shard.comm))


def adopted(param: torch.Tensor) -> None:
    """An engine has taken ``param``'s values: it keeps no slice of its own any more."""
    param.__dict__.pop(_ATTR, None)
    param.__dict__.pop("ds_tensor", None)


_DS_ATTRS = ("ds_id", "ds_shape", "ds_numel", "ds_status", "ds_tensor", "ds_persist", "ds_active_sub_modules",
             "partition_numel")


def materialize(param: nn.Parameter) -> None:
    """Give a parameter kept as a slice its full values again, in place (stages 0-2 keep whole
    parameters); it is then an ordinary parameter."""
    param.data = full_values(init_shard(param)).clone()
    adopted(param)
    for name in _DS_ATTRS:
        param.__dict__.pop(name, None)


def prepare_for_sharding(model: nn.Module, comm: Comm, shard_parameters: bool) -> None:
    """Before an engine takes ``model``: make its parameters agree on where their values are.

    Stages 0-2 (``shard_parameters`` false) keep whole parameters, so those built in ``Init`` get
    their full values back. At stage 3, in a model with parameters built in ``Init``, a parameter
    created afterwards with values of its own (a LoRA adapter, a new head, resized embeddings) is
    kept as a slice of those values in place, rank 0's as ``Init`` would have kept them; and a
    parameter on the meta device with nothing behind it is an error naming it: its values were
    lost before ``initialize`` (a library that moves new parameters to the device of old ones,
    when those were on the meta device), and initializing it afresh would train from another
    model without a word. A model built wholly on the meta device is left as it is: ``initialize``
    initializes it unit by unit, as documented."""
    named = list(model.named_parameters())
    built = [p for _, p in named if init_shard(p) is not None]
    if not built:
        return
    if not shard_parameters:
        for p in built:
            materialize(p)
        return
    lost = [n for n, p in named if p.is_meta]  # (a slice's data is empty on the real device, never meta)
    if lost:
        more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
        raise ValueError(
            f"parameters on the meta device with no values: {', '.join(lost[:5])}{more}. The rest of the "
            "model was built in zero.Init and holds its values; these hold none, so their values were lost "
            "before initialize (e.g. moved to the meta device by code that followed another parameter's "
            "device) and would have to be invented. Create them with real values (after zero.Init is fine: "
            "they are then kept as their creator made them) or inside zero.Init")
    for _, p in named:  # each parameter once: named_parameters() skips tied repeats
        if init_shard(p) is None:
            shard_in_place(p, comm)


_active: Optional["ShardedConstruction"] = None
_DEPTH = "_zerodp_init_depth"  # in a module's __dict__ while its constructors run


def _wrap_init(cls: type) -> None:
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_zerodp_wrapped", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if _active is None:
            return init(self, *args, **kwargs)
        self.__dict__[_DEPTH] = self.__dict__.get(_DEPTH, 0) + 1
        try:
            init(self, *args, **kwargs)
        finally:
            self.__dict__[_DEPTH] -= 1
        if self.__dict__[_DEPTH] == 0:  # the outermost constructor of this module has returned
            del self.__dict__[_DEPTH]
            if _active is not None:
                _active.shard_own(self)

    __init__._zerodp_wrapped = True
    __init__._zerodp_original = init
    cls.__init__ = __init__


def _module_classes() -> list[type]:
    seen, todo = {nn.Module}, [nn.Module]
    while todo:
        fresh = [c for c in todo.pop().__subclasses__() if c not in seen]
        seen.update(fresh)
        todo.extend(fresh)
    return list(seen)


class ShardedConstruction:
    """While entered: every module built shards its own real parameters when its constructor
    returns, and a parameter registered later on an already built module is sharded at once
    (``zero.Init``); with ``meta``, replaced by parameters on the meta device that keep no values
    at all. Not re-entrant across threads: one model is built at a time."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, dtype: Optional[torch.dtype] = None,
                 meta: bool = False) -> None:
        self.group, self.dtype, self.meta = group, dtype, meta
        self._comm: Optional[Comm] = None  # made on entry, when the group has been started
        self._wrapped: list[type] = []
        self._handle = None
        self._outer: Optional[ShardedConstruction] = None
        self._device: Optional[torch.device] = None  # the device context entered while building

    def _replace(self, param: nn.Parameter) -> nn.Parameter:
        if self.meta:  # no values kept: they come later (initialize's per-unit initialization, weight files)
            return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        return shard_parameter(param, self._comm, self.dtype)

    def shard_own(self, module: nn.Module) -> None:
        for name, p in list(module._parameters.items()):
            if p is not None and not has_no_values(p):
                module._parameters[name] = self._replace(p)

    def _on_register(self, module: nn.Module, name: str, param: Optional[nn.Parameter]):
        if param is None or has_no_values(param) or module.__dict__.get(_DEPTH, 0) > 0:
            return None  # meta or already a slice (a tied weight), or sharded when the constructor returns
        old = module._parameters.get(name)
        if old is not None and old.is_meta:
            return None  # a value put in place of a parameter built on the meta device: kept as is
        return self._replace(param)

    def __enter__(self) -> "ShardedConstruction":
        global _active
        from torch.nn.modules.module import register_module_parameter_registration_hook

        self._comm = Comm(self.group)
        self._outer, _active = _active, self
        if self._outer is None:
            for cls in _module_classes():
                if "__init__" in cls.__dict__ and not getattr(cls.__dict__["__init__"], "_zerodp_wrapped", False):
                    _wrap_init(cls)
                    self._wrapped.append(cls)
            nn.Module.__init_subclass__ = classmethod(lambda cls, **kw: _wrap_init(cls))  # classes defined inside
        self._handle = register_module_parameter_registration_hook(self._on_register)
        # Built on the engine's device, as DeepSpeed's Init builds on the accelerator: each module
        # initializes there (on a GPU: its random generator, so a seed gives DeepSpeed's and DDP's
        # values) and only then keeps its slice. Not over a device the caller chose (meta, say).
        self._device = None
        if self._outer is None and not self.meta and torch.get_default_device().type == "cpu":
            device = default_device()
            if device.type != "cpu":
                self._device = torch.device(device)
                self._device.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        global _active
        self._handle.remove()
        if self._device is not None:
            self._device.__exit__(*exc)
            self._device = None
        _active = self._outer
        if self._outer is None:
            del nn.Module.__init_subclass__
            for cls in self._wrapped:  # a class defined inside keeps its wrapper, inert when none is active
                cls.__init__ = cls.__dict__["__init__"]._zerodp_original
            self._wrapped = []


@contextlib.contextmanager
def gathered(params: list[nn.Parameter], modifier_rank: Optional[int]) -> Iterator[None]:
    """``GatheredParameters`` for parameters built inside ``zero.Init`` and not yet in an
    engine: full values inside; on exit, ``modifier_rank``'s values become the slices (without
    it, changes are dropped)."""
    swapped = []
    try:
        for p in params:
            shard = init_shard(p)
            whole = nn.Parameter(full_values(shard).clone(), requires_grad=p.requires_grad)
            whole.__dict__.update(p.__dict__)
            torch.utils.swap_tensors(p, whole)  # p now holds the values; ``whole`` the empty data
            p.ds_status = ZeroParamStatus.AVAILABLE
            swapped.append((p, whole, shard))
        yield
    finally:
        for p, empty, shard in swapped:
            if modifier_rank is not None:
                with torch.no_grad():
                    set_values(shard, p.detach(), modifier_rank)
            empty.__dict__.update(p.__dict__)
            torch.utils.swap_tensors(p, empty)
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE

"""FlatGroup: parameters stored in one padded buffer that splits into equal shards.

A flat group holds parameters that share an optimizer param group, a dtype, whether they are
trained, a stage-3 unit and a shard axis. It is three things, one per part:

* its layout (``GroupLayout``, ``group_layout.py``, which it extends): where each parameter
  lies in the padded buffer, this rank's shard and the ``pieces`` of parameters in it, and what
  a checkpoint's index records;
* the parameters' storage (this class): while the full buffer exists, every parameter's
  ``.data`` is a view into it. At stage 3 the shard persists in a buffer of its own, and the
  full buffer exists only while the group is gathered (``axes.ShardAxes.gather`` drives
  ``open_for_gather`` / ``gathering`` / ``wait_gathered``; ``release`` ends it); the shard's
  storage is freed meanwhile (its values are in ``full``) and refilled on release;
* its gradients (``grads``, a ``GroupGrads``, ``grads.py``): a full gradient buffer or a
  shard, as the stage policy decides.

What the optimizer updates over the pieces (an fp32 master, one leaf tensor per piece) is the
group's ``optim`` (``optim_shard.py``), attached by :meth:`FlatGroup.attach_optimizer`.

Under tensor parallelism a parameter is a ``DTensor`` whose local tensor is this rank's slice of
the layer (``parallel/tensor.py``; the helpers are in ``dtensor.py``). The group lays out the
local tensors: each parameter's local tensor is the view into the buffer, and its gradient
arrives as a ``DTensor`` whose local tensor is what is reduced. Slots hold local shapes;
``tp_split`` says whether the group's parameters are split over the tensor-parallel ranks (each
rank holds different values) or replicated (every rank the same), which the gradient norm needs.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn

from .dtensor import bind_local, grad_like, grad_local, is_dtensor, local_tensor, set_param_data  # noqa: F401
from .grads import GroupGrads
from .group_layout import ALIGN_BYTES, GroupLayout, Piece, Slot  # noqa: F401
from .init_shards import ZeroParamStatus, full_shape, has_no_values
from .packed import empty_like_packed, is_packed


class FlatGroup(GroupLayout):
    """One contiguous, padded, shardable buffer of parameters (see module docstring): its layout
    (``GroupLayout``), the parameters' storage, and its gradients (``grads``, ``GroupGrads``)."""

    def __init__(self, index: int, named_params: list[tuple[str, nn.Parameter]], *,
                 param_group: int, trainable: bool, partitions: int,
                 unit: int = 0, rank: int, device: torch.device, tp_of: Optional[dict] = None,
                 axis: str = "data", counted_here: bool = True) -> None:
        if not named_params:
            raise ValueError("a flat group needs at least one parameter")
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) != 1:
            raise ValueError(f"flat group {index} mixes dtypes {sorted(map(str, dtypes))}")
        self.param_group = param_group
        self.params = [p for _, p in named_params]
        tp_of = tp_of or {}
        self.tp_split = id(self.params[0]) in tp_of
        if any((id(p) in tp_of) != self.tp_split for p in self.params):
            raise ValueError(f"flat group {index} mixes tensor-parallel split and replicated parameters")
        # a zero.Init slice's data is empty: its shape is ds_shape
        super().__init__(index, [(name, full_shape(local_tensor(p)), tp_of.get(id(p))) for name, p in named_params],
                         self.params[0].dtype, partitions=partitions, rank=rank, axis=axis)
        self.counted_here = counted_here  # in this rank's share of the gradient norm and its checkpoint file
        self.trainable = trainable
        self.unit = unit
        self.device = device
        self._empty = torch.empty(0, dtype=self.dtype, device=device)  # the data of released parameters

        self._own_shard: Optional[torch.Tensor] = None  # stage 3: this rank's persistent shard
        self._shard_in_full = False  # stage 3, gathered: the own shard's values are only in full
        self._shard_being_copied = False  # an asynchronous checkpoint copy reads the shard: keep it
        self._pending = None  # a stage-3 all-gather in flight (prefetch)
        self.replaced: dict[int, nn.Parameter] = {}
        # slot -> (dtype, shape) a module gave the parameter's data in place of the slot's own
        # (``keep_assigned_data``): the parameter is bound to its bytes viewed that way
        self._shown_as: dict[int, tuple[torch.dtype, torch.Size]] = {}
        self._assigned = False  # stage 3: full holds assigned data the shard and master lack yet
        self.holds = 0  # stage 3: ``GatheredParameters`` contexts holding the group gathered
        self.secondary: Optional[Any] = None  # hpZ's secondary copy (``secondary.SecondaryCopy``)
        self._keep_secondary = False  # a gather over every rank in flight: keep the secondary part after
        self.release_pending = False  # a release came while held: done when the last hold ends
        if any(has_no_values(local_tensor(p)) for p in self.params):
            if (self.tp_split and axis == "data") or any(is_dtensor(p) for p in self.params):  # (experts' slices:
                # their own axis, built in zero.Init)
                raise ValueError("a tensor-parallel model cannot be on the meta device: build it with values "
                                 "(zero.Init or a meta-device model is for data parallelism alone)")
            self._adopt_meta_params()
        else:
            self.full: torch.Tensor = torch.zeros(self.padded_numel, dtype=self.dtype, device=device)
            with torch.no_grad():
                for slot, p in zip(self.slots, self.params):
                    self.full[slot.offset:slot.offset + slot.numel].copy_(local_tensor(p).detach().reshape(-1))
            self.bind_params_to_full()

        self.grads = GroupGrads(self)
        self.shard_page: Optional[Any] = None   # stage-3 parameter offload to disk: the shard's file
        self.optim: Optional[Any] = None  # what the optimizer updates (``optim_shard.OptimizerShard``)

    def _adopt_meta_params(self) -> None:
        """Parameters built on the meta device or kept as ``zero.Init`` slices hold no data: replace
        them by parameters that are views of a full buffer which is never filled here (its storage
        is freed at once, so no rank holds the whole model); ``self.replaced`` maps old ids to the
        new parameters, and the values come from ``gather.initialize_meta_units`` (stage 3 only)."""
        if not all(has_no_values(p) for p in self.params):
            raise ValueError(f"flat group {self.index} mixes parameters on the meta device with "
                             "materialized ones; build the model all on the meta device or not at all")
        self.full = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)  # untouched
        new = [empty_like_packed(p, torch.empty(0, dtype=self.dtype, device=self.device)) if is_packed(p)
               else nn.Parameter(torch.empty(0, dtype=self.dtype, device=self.device), requires_grad=p.requires_grad)
               for p in self.params]  # a packed 4-bit weight stays one, with its quantization state
        self.replaced = {id(old): p for old, p in zip(self.params, new)}
        self.params = new
        self.full.untyped_storage().resize_(0)  # the new parameters' data stays empty until materialize()
        # written whole by keep_own_shard; left untouched until then (no memory is committed)
        self._own_shard = torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)

    def materialize(self) -> None:
        """Allocate the full buffer with zeros for initialization (no communication)."""
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        self.full.zero_()
        self.bind_params_to_full()

    def keep_own_shard(self) -> None:
        """After initializing a materialized buffer: keep this rank's shard, free the rest."""
        self._own_shard.copy_(self.shard_of(self.full))
        self.release()

    # -- views ------------------------------------------------------------------------

    @property
    def shard(self) -> torch.Tensor:
        """This rank's shard of the parameters: a view into ``full`` (stages 0-2), or its own
        persistent buffer once ``shard_parameters()`` was called (stage 3; taken back from
        ``full`` first if the group is gathered, see ``gather``)."""
        if not self.shards_parameters:
            return self.shard_of(self.full)
        self._take_back_own_shard()
        return self._own_shard

    # -- stage 3: parameters persist as a shard, gathered around use ---------------------

    # -- what other parts attach --------------------------------------------------------------

    def attach_optimizer(self, optim: Any) -> None:
        """What the optimizer updates over this group's pieces (``optim_shard.OptimizerShard``)."""
        self.optim = optim

    def attach_secondary(self, copy: Any) -> None:
        """hpZ: the group's secondary copy (``secondary.SecondaryCopy``), gathered within a few ranks."""
        self.secondary = copy

    def attach_shard_page(self, page: Any) -> None:
        """Stage-3 parameter offload to disk: the file the shard lives in (``offload/params.py``)."""
        self.shard_page = page

    def hold(self) -> None:
        """A ``GatheredParameters`` context holds the gathered group: a release waits for its end."""
        self.holds += 1

    def unhold(self, release: bool) -> None:
        """That context ended; once no context holds the group, release it if a release came
        meanwhile or ``release`` (the context gathered it)."""
        self.holds -= 1
        if not self.holds and (self.release_pending or release):
            self.release()

    def shard_parameters(self) -> None:
        """Keep only this rank's shard in a buffer of its own, and release ``full``.

        The full buffer keeps its identity (parameters stay views into it, and autograd may
        hold views of it for backward); only its storage is freed and re-allocated, as
        ``release()`` and ``gather()`` do.
        """
        self._own_shard = self.shard_of(self.full).clone()
        self.release()

    def offload_shard(self, pin: bool) -> None:
        """Keep this rank's shard in host memory (stage 3 ``offload_param``; page-locked with
        ``pin`` on a GPU); ``gather`` copies it to the device."""
        shard = torch.empty(self.shard_numel, dtype=self.dtype,
                            pin_memory=pin and self.device.type == "cuda")
        shard.copy_(self._own_shard)
        self._own_shard = shard

    @property
    def shards_parameters(self) -> bool:
        """Whether parameters persist as this rank's shard only (stage 3)."""
        return self._own_shard is not None

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    @property
    def gather_in_flight(self) -> bool:
        """An asynchronous all-gather (a prefetch) was started and not yet waited for."""
        return self._pending is not None and not self._pending.done

    def release(self) -> None:
        """Free the full buffer's storage (stage 3, after use), first keeping any data a module
        assigned to a parameter while it was gathered (``keep_assigned_data``); the parameters are
        left as DeepSpeed leaves a partitioned one (``_bind_params_released``). While a
        ``GatheredParameters`` context holds the group (``holds``) the release waits for its end:
        a forward inside the context (TRL's generation between PEFT's merge and unmerge) leaves
        the parameters the context gave."""
        if self.holds:
            self.release_pending = True
            return
        self.release_pending = False
        self.wait_gathered()
        if self.gathered:
            self.keep_assigned_data()
        in_full = self._shard_in_full
        self._take_back_own_shard()
        if self._assigned:
            self.drop_secondary()
            if not in_full:  # the shard kept storage of its own (on the host, on disk): update it
                self.update_own_shard_from_full()
            if self.optim is not None:
                self.optim.refresh()
            self._assigned = False
        self.full.untyped_storage().resize_(0)
        self._bind_params_released()
        _mark(self, ZeroParamStatus.NOT_AVAILABLE)

    def _bind_params_released(self) -> None:
        """Outside a gather a parameter's data is empty (``torch.Size([0])``) on the real device, as
        under DeepSpeed: code written for DeepSpeed reads ``ds_shape`` and tells a partitioned
        parameter by ``numel() == 0`` (peft), and a read of one fails with a shape error instead of
        touching freed memory. Views of ``full`` that autograd saved in a forward keep its storage,
        which the next gather fills again. A ``DTensor`` (tensor parallelism) keeps its view: its
        shape is its own metadata, not its local tensor's."""
        for p in self.params:
            if not is_dtensor(p):
                p.data = self._empty

    def _take_back_own_shard(self) -> None:
        """Give the own shard its storage again, with its values from ``full`` (after a
        ``gather`` that freed it)."""
        if self._shard_in_full:
            self.wait_gathered()
            storage = self._own_shard.untyped_storage()
            storage.resize_(self.shard_numel * self._own_shard.element_size())
            self._own_shard.copy_(self.shard_of(self.full))
            self._shard_in_full = False

    def open_for_gather(self) -> torch.Tensor:
        """Re-allocate the full buffer, with this rank's shard in its place, and return it for the
        all-gather that fills the rest (``ShardAxes.gather`` issues it and hands its work to
        :meth:`gathering`); with a valid hpZ copy, this rank's part of that copy instead, for the
        all-gather within its few ranks."""
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        self.bind_params_to_full()
        if self.secondary is not None and self.secondary.valid:  # hpZ: a gather within the few ranks
            self.secondary.fill(self.full)  # (the own shard keeps its storage meanwhile)
            return self.full
        page = self.shard_page
        if page is not None and not page.resident:  # on disk: read, copy, drop
            page.page_in()
            self.shard_of(self.full).copy_(self._own_shard)
            page.page_out(write=False)
        elif self._own_shard.device == self.full.device and not self._shard_being_copied:
            # while gathered, this rank's values live in full alone: the shard's storage is
            # freed (its identity kept: optimizer pieces alias it) and refilled by release()
            self.shard_of(self.full).copy_(self._own_shard)
            self._own_shard.untyped_storage().resize_(0)
            self._shard_in_full = True
        else:
            self.shard_of(self.full).copy_(self._own_shard, non_blocking=True)  # from the host
        return self.full

    def gathering(self, work) -> None:
        """The all-gather into the full buffer was issued: ``work`` (a prefetch's, still in flight,
        until :meth:`wait_gathered`). With hpZ, a gather over every rank keeps this rank's part of
        the secondary copy once it is done."""
        self._pending = work
        self._keep_secondary = self.secondary is not None and not self.secondary.valid
        _mark(self, ZeroParamStatus.AVAILABLE)
        if self._keep_secondary and work.done:
            self.wait_gathered()

    def wait_gathered(self) -> None:
        """Finish a prefetch in flight, if any."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        if self._keep_secondary:
            self._keep_secondary = False
            self.secondary.keep(self.full, self._own_shard.device)

    def drop_secondary(self) -> None:
        """The parameters changed: hpZ's secondary copy, if any, is stale (the next gather is over
        every rank again, and keeps a fresh one)."""
        if self.secondary is not None:
            self.secondary.drop()

    def bind_params_to_full(self) -> None:
        """Make every parameter's ``.data`` a view into ``full`` (typed and shaped as a module left
        it, ``keep_assigned_data``)."""
        for i, p in enumerate(self.params):
            bind_local(p, self.param_view(i))

    def param_view(self, slot: int) -> torch.Tensor:
        """Parameter ``slot``'s data as it is bound: its elements in ``full``, shaped like the
        parameter, or their bytes in the dtype and shape a module gave its data."""
        if slot not in self._shown_as:
            return self.view(self.full, slot)
        s, (dtype, shape) = self.slots[slot], self._shown_as[slot]
        return self.full[s.offset:s.offset + s.numel].view(dtype).view(shape)

    # -- data a module assigns to a gathered parameter --------------------------------

    def keep_assigned_data(self) -> bool:
        """Keep the data a module assigned to a gathered parameter (``p.data = t``), as one process
        keeps it, instead of losing it at release: bitsandbytes repacks a 4-bit weight for the CPU's
        kernels in the first forward in eval mode (and marks its quantization state so); PEFT's
        safe merge assigns the merged weight. ``t`` is written into ``full`` (whence the shards,
        the next gathers and checkpoints have it) and the parameter is bound to its place there
        again, typed and shaped as ``t`` (a new dtype is a new reading of the same bytes, so ``t``
        must have the slot's bytes). Every rank must assign the same, as a module's forward does.
        Returns whether any parameter had new data; the master follows (at stage 3 with the shard,
        at release). Data of another size, or of another dtype for a trained parameter, is refused with
        the parameter's name."""
        assigned = False
        base, size = self.full.data_ptr(), self.full.element_size()
        for i, (s, p) in enumerate(zip(self.slots, self.params)):
            if is_dtensor(p) or s.numel == 0:
                continue
            dtype, shape = self._shown_as.get(i, (self.dtype, s.shape))
            if p.data_ptr() == base + s.offset * size and p.dtype == dtype and p.shape == shape:
                continue  # still its place in full (written in place, or not at all)
            self._store_assigned(i, p, p.data)
            assigned = True
        if assigned and not self.shards_parameters:  # stages 0-2: full is the parameters; the master follows
            if self.optim is not None:
                self.optim.refresh()
        elif assigned:
            self._assigned = True  # stage 3: shard and master follow at release
        return assigned

    def _store_assigned(self, i: int, p: nn.Parameter, new: torch.Tensor) -> None:
        s = self.slots[i]
        region = self.full[s.offset:s.offset + s.numel]
        nbytes, step = s.numel * region.element_size(), new.element_size()
        what = (f"a module assigned parameter '{s.name}' (shape {tuple(s.shape)}, {self.dtype}) new data "
                f"of shape {tuple(new.shape)} and {new.dtype} while it was gathered")
        if new.numel() * step != nbytes:
            raise ValueError(f"{what}: ZeRO keeps a parameter in a fixed place of its flat group, so new data "
                             f"must keep its {nbytes} bytes; change the values in place, or build the module "
                             "with the new shape before zerodp.initialize")
        if new.dtype != self.dtype and p.requires_grad:
            raise ValueError(f"{what}: a trained parameter keeps the dtype its optimizer state was built for; "
                             "cast the model before zerodp.initialize")
        if (region.storage_offset() * region.element_size()) % step:
            raise ValueError(f"{what}: its place in the flat group is not aligned for {new.dtype}")
        with torch.no_grad():
            region.view(torch.uint8).copy_(new.detach().contiguous().reshape(-1).view(torch.uint8))
        if new.dtype == self.dtype and new.shape == s.shape:
            self._shown_as.pop(i, None)
        else:
            self._shown_as[i] = (new.dtype, new.shape)
        p.data = self.param_view(i)

    def update_own_shard_from_full(self) -> None:
        """Write this rank's part of ``full`` into its persistent shard (stage 3), wherever that is
        kept (on the device, on the host, in a file)."""
        page = self.shard_page
        if page is not None and not page.resident:
            page.page_in()
            self._own_shard.copy_(self.shard_of(self.full))
            page.page_out(wait=True)
        else:
            self._own_shard.copy_(self.shard_of(self.full))

    # -- disk offload --------------------------------------------------------------------

    @contextlib.contextmanager
    def swapped_in(self):
        """With disk offload, the optimizer's master and states (``optim.page``) and with parameter
        offload to disk the parameter shard (``shard_page``) are in memory inside this context:
        read from their files, written back after. Otherwise nothing happens."""
        paged_in = []
        try:
            for page in self.pages:
                if page.resident:
                    page.wait()
                else:
                    page.page_in()
                    paged_in.append(page)
            yield
        finally:
            for page in paged_in:
                page.page_out(wait=True)

    # -- checkpoints -----------------------------------------------------------------------

    @property
    def pages(self) -> list:
        """The files some of the group's values live in (disk offload): the optimizer's master and
        states (``optim.page``), the parameter shard (``shard_page``); empty without."""
        return [page for page in (self.optim.page if self.optim is not None else None, self.shard_page)
                if page is not None]

    def copying_shard(self, on: bool) -> None:
        """An asynchronous checkpoint copy reads the shard (``on``) or is done: while it reads,
        a stage-3 gather keeps the shard's own storage instead of moving its values into ``full``."""
        self._shard_being_copied = on


def _mark(g: FlatGroup, status: ZeroParamStatus) -> None:
    """Keep ``param.ds_status`` (DeepSpeed's; TRL reads it) true of a sharded group."""
    if g.shards_parameters:
        for p in g.params:
            p.ds_status = status

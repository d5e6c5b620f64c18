"""Stage 3's parameter API for user code (DeepSpeed's names): :func:`GatheredParameters` gives
parameters their full values for the duration of a context, :func:`register_external_parameter`
declares that a module's forward uses a parameter another module owns. With them, what the
engine records for them: which flat group holds each parameter (:func:`register_params`) and
which modules registered external parameters (:func:`external_users`)."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .agree import GATHERED_PARAMETERS
from .flat import FlatGroup
from .init_shards import PartitionNumel, ZeroParamStatus, gathered, init_shard

if TYPE_CHECKING:
    from .agree import UnitAgreement
    from .axes import ShardAxes


# -- parameters used outside their unit ----------------------------------------------------------

_EXTERNAL_ATTR = "_zerodp_external_parameters"


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter`` although another module owns it
    (DeepSpeed's API of the same name), e.g. a parent that reads ``self.child.weight``.

    At stage 3 the unit holding ``parameter`` is then gathered, and kept gathered, for the
    whole forward of ``module``, and gathered again when backward reaches ``module``'s
    outputs. Call it before or after ``zerodp.initialize``; at stages 0-2 it changes nothing.
    """
    registered = module.__dict__.setdefault(_EXTERNAL_ATTR, [])
    if all(p is not parameter for p in registered):
        registered.append(parameter)


def external_users(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Modules of ``model`` with parameters registered by ``register_external_parameter``."""
    return [(m, m.__dict__[_EXTERNAL_ATTR]) for m in model.modules() if m.__dict__.get(_EXTERNAL_ATTR)]


# -- GatheredParameters -----------------------------------------------------------------------

_GROUP_OF: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def register_params(groups: Iterable[FlatGroup], axes: "ShardAxes", sharded: bool,
                    agreement: Optional["UnitAgreement"] = None) -> None:
    """Remember which flat group holds each parameter (for ``GatheredParameters``); give
    sharded ones DeepSpeed's ``ds_*`` attributes (``ds_status`` kept by the group).
    ``agreement``: the engine's check that its ranks run the same units (stage 3), which
    ``GatheredParameters`` joins before a collective."""
    for g in groups:
        kept = [0] * len(g.slots)  # this rank's elements of each parameter
        for piece in g.pieces:
            kept[piece.slot] += piece.shard_hi - piece.shard_lo
        for slot, p, mine in zip(g.slots, g.params, kept):
            _GROUP_OF[p] = (g, axes, sharded, agreement)
            if sharded:  # DeepSpeed's attributes of a ZeRO-3 parameter (TRL, transformers, Lightning read them)
                p.ds_shape, p.ds_numel = slot.shape, slot.numel
                p.partition_numel = PartitionNumel(mine)
                p.ds_id = getattr(p, "ds_id", id(p))
                p.ds_active_sub_modules = set()
                p.ds_status = ZeroParamStatus.AVAILABLE if g.gathered else ZeroParamStatus.NOT_AVAILABLE


@contextlib.contextmanager
def GatheredParameters(params: Any, modifier_rank: Optional[int] = None, fwd_module: Optional[nn.Module] = None,
                       enabled: bool = True):
    """Gather full parameters for the duration of the context (DeepSpeed's API).

    ``params``: a parameter or an iterable of them (``None`` entries and parameters zerodp does
    not manage are left alone). Inside, they hold their full values on every rank. With
    ``modifier_rank``, that rank's values on exit (e.g. after an in-place initialization or a
    checkpoint copied in) are broadcast to every rank and become the new shards; otherwise
    edits are discarded at stage 3. The parameters are those of an engine, or ones built inside
    ``zero.Init`` that no engine has yet (``init_shards.py``). ``fwd_module``: registers the
    parameters as external parameters of that module (``register_external_parameter``). Every
    rank of the data-parallel group must enter the context with the same parameters.
    """
    if not enabled:
        yield
        return
    if isinstance(params, torch.Tensor):
        params = [params]
    params = [p for p in params if p is not None]
    lost = [p for p in params if p.is_meta]  # (zero.Init's slices are empty on the real device, not meta)
    if lost:  # nothing to gather, and an edit inside would vanish without a word
        shapes = ", ".join(str(tuple(p.shape)) for p in lost[:5])
        raise ValueError(f"GatheredParameters: {len(lost)} parameter(s) on the meta device hold no values "
                         f"(shapes {shapes}); build them with values, or inside zero.Init, before gathering them")
    if fwd_module is not None:  # DeepSpeed's meaning: fwd_module's forward uses these parameters
        for p in params:
            register_external_parameter(fwd_module, p)
    unadopted = [p for p in params if init_shard(p) is not None]
    with gathered(unadopted, modifier_rank), _gathered_in_engines(params, modifier_rank):
        yield


@contextlib.contextmanager
def _gathered_in_engines(params: list, modifier_rank: Optional[int]):
    seen, entries = set(), []
    for p in params:
        entry = _GROUP_OF.get(p)
        if entry is not None and id(entry[0]) not in seen:
            seen.add(id(entry[0]))
            entries.append(entry)
    # a gather, or a prefetch still in flight (in a forward): a collective every rank must
    # reach from the same units, so the ranks first agree on what they ran (``agree.py``)
    needing = [e for e in entries if e[2] and (not e[0].gathered or e[0].gather_in_flight)]
    for agreement in {id(e[3]): e[3] for e in needing if e[3] is not None}.values():
        agreement.meet(GATHERED_PARAMETERS)
    gathered_here = [g for g, _, _, _ in needing if not g.gathered]
    for g, axes, _, _ in needing:
        axes.gather(g)  # or, for a prefetch in flight, wait for it
    held = [g for g, _, sharded, _ in entries if sharded]
    for g in held:  # released when the context ends, not by a forward run inside it
        g.hold()
    try:
        yield
    finally:
        for g, axes, sharded, _ in entries:
            if g.gathered:  # data assigned to a parameter inside (``p.data = t``) is kept like an edit in place
                g.keep_assigned_data()
            if modifier_rank is not None:
                with torch.no_grad():
                    axes.of(g).broadcast(g.full, src_rank=modifier_rank)
                    if sharded:
                        with g.swapped_in():
                            g.shard.copy_(g.shard_of(g.full))
                        g.drop_secondary()  # hpZ's copy holds the values from before
                    if g.optim is not None:
                        g.optim.refresh()
        for g in held:
            g.unhold(release=any(g is h for h in gathered_here))

"""Muon with an AdamW half, over the engine's flat shards, each whole matrix orthogonalized once.

``"optimizer": {"type": "Muon", "params": {...}}`` trains as DeepSpeed's ``MuonWithAuxAdam``:

* which parameters Muon takes is a property of each parameter, ``param.use_muon``. ``initialize``
  tags every parameter of the model that has no tag by DeepSpeed's rule (a matrix, 2-D or more,
  whose name contains neither ``embed`` nor ``lm_head``); a tag the caller set is kept. A
  parameter tagged for Muon that is not a matrix goes to the AdamW half, and the split is logged;
* each param group splits into a Muon half and an AdamW half (:func:`muon_param_groups`), with
  settings resolved most-specific-last: the config's shared value, then ``muon_lr`` / ``adam_lr``,
  then the group's own;
* the Muon half's update is momentum (elementwise, on each rank's shard, kept as the optimizer
  state ``momentum_buffer``), the whole blended matrix orthogonalized by its owner rank
  (``muon_owners.py``; the math in ``muon_math.py``), then ``p <- p (1 - lr wd) - lr update``;
* the AdamW half is torch's AdamW (Adam with ``adam_w_mode: false``) over the same state dict;
* a matrix split by tensor parallelism is whole over its tensor-parallel ranks: its owner is the
  same data-parallel rank in each (their layouts are alike); one of those owners, chosen so that
  they share the work, receives the others' slices, orthogonalizes the whole and sends each its
  slice back.

The engine drives it through the declared interface ``whole_matrices`` (``core/optim_shard.py``):
``plan_whole_matrices`` once, ``whole_matrix_update`` for each trainable group (every rank, in
group order) before ``step``. A step that finds a Muon gradient that was not orthogonalized
raises, rather than degrading to momentum SGD.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional

import torch
from torch.optim.adam import adam

from ..config import ConfigError
from .muon_math import FLAVOURS, NS_COEFFICIENTS, NS_METHODS, ns_flops, orthogonalize
from .muon_owners import GroupPlan, exchange, plan_owners

logger = logging.getLogger("zerodp")

__all__ = ["MuonWithAuxAdam", "muon_param_groups", "tag_for_muon", "is_muon_type", "from_torch_muon"]

#: The keys each half of a param group takes from the config and from the group itself (DeepSpeed's).
MUON_HALF_KEYS = ("lr", "momentum", "weight_decay", "ns_method", "ns_steps", "nesterov")
ADAM_HALF_KEYS = ("lr", "betas", "eps", "weight_decay")
#: DeepSpeed's defaults for each half (``MuonWithAuxAdam``).
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram", "ns_steps": 5,
                 "nesterov": True}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
#: Config keys DeepSpeed reads for other optimizers or its own kernels: accepted, no effect here.
_IGNORED_KEYS = ("torch_adam", "fused", "fp32_optimizer_states", "set_grad_none")
CONFIG_KEYS = tuple(sorted(set(MUON_HALF_KEYS + ADAM_HALF_KEYS) | {"muon_lr", "adam_lr", "adam_w_mode",
                                                                   "per_head_muon"}))


def is_muon_type(type_name: Any) -> bool:
    return isinstance(type_name, str) and type_name.strip().lower() == "muon"


def _number(key: str, value: Any, low: float = 0.0, below: Optional[float] = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= low
    if ok and below is not None:
        ok = value < below
    if not ok:
        span = f"a number >= {low}" + (f" and < {below}" if below is not None else "")
        raise ConfigError(f"optimizer.params.{key}: got {value!r}; allowed: {span}")


def check_muon_params(params: dict) -> None:
    """Check the Muon block's ``params`` (ConfigError naming the key)."""
    for key, value in params.items():
        if key in _IGNORED_KEYS:
            continue
        if key not in CONFIG_KEYS:
            raise ConfigError(f"optimizer.params.{key}: got {value!r}; allowed: only Muon's keys "
                              f"({', '.join(CONFIG_KEYS)})")
        if key in ("lr", "muon_lr", "adam_lr", "weight_decay"):
            _number(key, value)
        elif key == "momentum":
            _number(key, value, 0.0, 1.0)
        elif key == "eps":
            _number(key, value, 0.0)
        elif key == "ns_method" and value not in NS_METHODS:
            raise ConfigError(f"optimizer.params.ns_method: got {value!r}; allowed: {' or '.join(NS_METHODS)}")
        elif key == "ns_steps" and (not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 100):
            raise ConfigError(f"optimizer.params.ns_steps: got {value!r}; allowed: an integer from 1 to 99")
        elif key in ("nesterov", "adam_w_mode") and not isinstance(value, bool):
            raise ConfigError(f"optimizer.params.{key}: got {value!r}; allowed: true or false")
        elif key == "betas" and not (isinstance(value, (list, tuple)) and len(value) == 2
                                     and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in value)):
            raise ConfigError(f"optimizer.params.betas: got {value!r}; allowed: a list of 2 numbers in [0, 1)")
        elif key == "per_head_muon" and value:
            raise ConfigError("optimizer.params.per_head_muon: got true; zerodp does not find attention heads "
                              "from the model's config; set `param.muon_num_heads` on the projections to "
                              "orthogonalize them head by head")


def wants_muon(name: str, shape: torch.Size) -> bool:
    """DeepSpeed's rule: a matrix (2-D or more) whose name has neither ``embed`` nor ``lm_head``."""
    low = name.lower()
    return len(shape) >= 2 and "embed" not in low and "lm_head" not in low


def tag_for_muon(module: torch.nn.Module, shape_of: Callable[[torch.Tensor], torch.Size] = lambda p: p.shape
                 ) -> int:
    """Set ``use_muon`` on each parameter of ``module`` that has none, by :func:`wants_muon` on its
    layer shape (``shape_of``); returns how many were tagged here."""
    tagged = 0
    for name, p in module.named_parameters():
        if not hasattr(p, "use_muon"):
            p.use_muon = wants_muon(name, shape_of(p))
            tagged += 1
    return tagged


def muon_param_groups(groups: list[dict], params: dict,
                      shape_of: Callable[[torch.Tensor], torch.Size] = lambda p: p.shape,
                      names: Optional[dict[int, str]] = None, report: bool = True) -> list[dict]:
    """Split each of ``groups`` (dicts with ``params``, from the caller) into its Muon and AdamW
    halves, as DeepSpeed's engine does (module docstring). Every parameter must carry a
    ``use_muon`` tag; one tagged for Muon that is not a matrix (``shape_of``) goes to the AdamW
    half. Logs the split where ``report``."""
    check_muon_params(params)
    names = names or {}
    untagged = [p for g in groups for p in g["params"] if not hasattr(p, "use_muon")]
    if untagged:
        shown = ", ".join(names.get(id(p), f"a tensor of shape {tuple(p.shape)}") for p in untagged[:5])
        raise ValueError(f"the Muon optimizer needs every parameter tagged with use_muon; {len(untagged)} are not "
                         f"({shown}); set `param.use_muon = True / False`")

    def half(keys: tuple, lr_key: str, defaults: dict) -> dict:
        out = dict(defaults)
        out.update({k: params[k] for k in keys if k in params})
        if lr_key in params:
            out["lr"] = params[lr_key]
        return out

    muon_defaults = half(MUON_HALF_KEYS, "muon_lr", MUON_DEFAULTS)
    adam_defaults = half(ADAM_HALF_KEYS, "adam_lr", ADAM_DEFAULTS)
    adam_defaults["betas"] = tuple(adam_defaults["betas"])
    out, moved = [], []
    counts = {True: [0, 0], False: [0, 0]}
    for index, group in enumerate(groups):
        overrides = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        trainable = [p for p in group["params"] if p.requires_grad]
        for use_muon, label, keys, defaults in ((True, "muon", MUON_HALF_KEYS, muon_defaults),
                                                (False, "adam", ADAM_HALF_KEYS, adam_defaults)):
            members = []
            for p in trainable:
                takes = bool(p.use_muon) and len(shape_of(p)) >= 2
                if bool(p.use_muon) and not takes and use_muon:
                    moved.append(names.get(id(p), f"shape {tuple(shape_of(p))}"))
                if takes is use_muon:
                    members.append(p)
            if not members:
                continue
            settings = dict(defaults)
            settings.update({k: v for k, v in overrides.items() if k in keys})
            if use_muon:
                settings.update(flavour="deepspeed")
            prefix = overrides.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append(dict(params=members, use_muon=use_muon, name=name, **settings))
            counts[use_muon][0] += len(members)
            counts[use_muon][1] += sum(shape_of(p).numel() for p in members)
    if moved and report:
        logger.warning("Muon: %d parameter(s) tagged use_muon are not matrices and go to the AdamW half: %s",
                       len(moved), ", ".join(moved[:5]) + (" ..." if len(moved) > 5 else ""))
    if report:
        logger.info("Muon: %d parameters (%s elements) by Muon, %d (%s elements) by AdamW",
                    counts[True][0], f"{counts[True][1]:,}", counts[False][0], f"{counts[False][1]:,}")
    return out


def from_torch_muon(groups: list[dict]) -> list[dict]:
    """The groups of a ``torch.optim.Muon`` a script passed in (its hyperparameters, the engine's
    pieces), as Muon groups in torch's flavour (its bf16 iteration, ``eps``, ``ns_coefficients``,
    ``ns_steps``, ``adjust_lr_fn``)."""
    out = []
    for g in groups:
        settings = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        out.append(dict(settings, params=g["params"], use_muon=True, flavour="torch",
                        ns_method="standard", ns_coefficients=tuple(settings.get("ns_coefficients", NS_COEFFICIENTS))))
    return out


def _finish_replicated(whole: torch.Tensor, comm: Any, finisher: int, wire: Optional[torch.device],
                       orthogonalize_whole: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The update of a matrix every tensor-parallel peer (``comm``) holds whole and alike: ``finisher``
    orthogonalizes it and sends it to the others."""
    n, me, numel = comm.world_size, comm.rank, whole.numel()
    if me == finisher:
        result = orthogonalize_whole(whole)
        out = result.repeat(n)
    else:
        out = whole.new_empty(0)
    staged = wire is not None and getattr(comm, "backend", "") == "nccl" and out.device != wire
    back = comm.all_to_all_rows(out.to(wire) if staged else out, [numel if me == finisher else 0] * n,
                                [numel if r == finisher else 0 for r in range(n)],
                                what="a replicated matrix's update for Muon", kind="muon_scatter")
    return back.to(whole.device)


def _finish_split(local: torch.Tensor, split: Any, comm: Any, finisher: int, wire: Optional[torch.device],
                  orthogonalize_whole: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """This rank's slice of the orthogonalized unsplit matrix, from its flat slice ``local``: the
    tensor-parallel peers (``comm``, every one of them holding its slice) send their slices to
    ``finisher``, which joins them (``split``: a ``parallel.tensor.TPSlice``), runs
    ``orthogonalize_whole`` on the unsplit matrix and sends each peer its slice back."""
    n, me, numel = comm.world_size, comm.rank, local.numel()
    to_finisher = [numel if r == finisher else 0 for r in range(n)]
    from_peers = [numel if me == finisher else 0 for _ in range(n)]
    staged = wire is not None and getattr(comm, "backend", "") == "nccl" and local.device != wire
    got = comm.all_to_all_rows(local.to(wire) if staged else local, to_finisher, from_peers,
                               what="a tensor-parallel matrix's slices for Muon", kind="muon_gather")
    if me == finisher:
        unsplit = got.new_empty(split.shape)
        for r, chunk in enumerate(got.view(n, -1)):
            split.place(unsplit, chunk.view(split.local_shape()), rank=r)
        update = orthogonalize_whole(unsplit.reshape(-1)).view(split.shape)
        out = torch.cat([split.take(update, rank=r).reshape(-1) for r in range(n)])
    else:
        out = got.new_empty(0)
    back = comm.all_to_all_rows(out, from_peers, to_finisher, what="a tensor-parallel matrix's update slices",
                                kind="muon_scatter")
    return back.to(local.device)


class MuonWithAuxAdam(torch.optim.Optimizer):
    """Muon for groups with ``use_muon``, AdamW for the others (module docstring), over the
    engine's pieces. ``adam_w_mode=False`` makes the AdamW half Adam with L2 weight decay."""

    #: the declared interface: this optimizer needs each Muon parameter whole (``core/optim_shard.py``)
    whole_matrices = True

    def __init__(self, param_groups: list[dict], adam_w_mode: bool = True) -> None:
        for g in param_groups:
            if "use_muon" not in g:
                raise ValueError("MuonWithAuxAdam: each param group needs use_muon")
            for k, v in (MUON_DEFAULTS if g["use_muon"] else ADAM_DEFAULTS).items():
                g.setdefault(k, v)
            if g["use_muon"]:
                g.setdefault("flavour", "deepspeed")
                if g["flavour"] not in FLAVOURS or g["ns_method"] not in NS_METHODS:
                    raise ValueError(f"MuonWithAuxAdam: flavour {g['flavour']!r}, ns_method {g['ns_method']!r}")
        super().__init__(param_groups, {})
        self.adam_w_mode = adam_w_mode
        leaves = [p for g in self.param_groups if not g["use_muon"] for p in g["params"]]
        # torch's fused kernel where it has one (fp32 leaves on a CPU or GPU), as the config's AdamW
        self._fused = bool(leaves) and all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32
                                           for p in leaves)
        self._plans: dict[int, GroupPlan] = {}
        self._heads: dict[int, list[Optional[int]]] = {}
        self._splits: dict[int, list[Any]] = {}  # per group, per slot: its tensor-parallel slice, or None
        self._tensor_comm: Any = None
        self._finisher: dict[tuple[int, int], int] = {}  # (group, slot) of a split matrix: its finishing TP rank
        self._work = {"matrices": 0, "flops": 0}
        self._ready: set[int] = set()

    # -- the engine's side ----------------------------------------------------------------

    def plan_whole_matrices(self, groups: list, comm_of: Callable[[Any], Any],
                            wire: Optional[torch.device] = None, tensor_comm: Any = None) -> None:
        """Choose each Muon parameter's owner rank (``muon_owners.py``) over the trainable flat
        ``groups`` (``comm_of(group)``: its shard axis's comm; ``wire``: the device the
        collectives' buffers live on; ``tensor_comm``: the tensor-parallel ranks, over which a
        split matrix is whole)."""
        muon = [g for g in groups if self.param_groups[g.param_group]["use_muon"]]
        self._tensor_comm = tensor_comm
        for g in muon:
            if getattr(g, "tp_split", False) and (tensor_comm is None or tensor_comm.world_size == 1):
                raise ValueError(f"Muon needs each matrix whole, and {g.slots[0].name} is split over "
                                 "tensor-parallel ranks this optimizer was not given: tag the split parameters "
                                 "`use_muon = False`, or let the engine build the optimizer")
            self._heads[g.index] = [getattr(p, "muon_num_heads", None) for p in g.params]
            self._splits[g.index] = [s.tp for s in g.slots]

        def cost(g, slot: int) -> int:
            pg, split = self.param_groups[g.param_group], self._splits[g.index][slot]
            shape = torch.Size(split.shape) if split is not None else g.slots[slot].shape
            return ns_flops(shape, pg["ns_steps"], pg["ns_method"], self._heads[g.index][slot])

        self._plans = {p.index: p for p in plan_owners(muon, comm_of, cost, wire)}
        # each matrix is finished by one of its tensor-parallel owners: largest first, to the least loaded
        tp = tensor_comm.world_size if tensor_comm is not None else 1
        finished = [0] * tp
        self._finisher = {}
        # (with tensor parallelism a matrix no layer split is held alike by every tensor-parallel rank: one of them
        # finishes it too)
        slots = [(grp, i) for grp in muon for i in range(len(grp.slots))] if tp > 1 else []
        for grp, slot in sorted(slots, key=lambda gi: (-cost(*gi), gi[0].index, gi[1])):
            t = min(range(tp), key=lambda r: (finished[r], r))
            finished[t] += cost(grp, slot)
            self._finisher[(grp.index, slot)] = t
        self._work = {"matrices": 0, "flops": 0}
        me = tensor_comm.rank if tensor_comm is not None else 0
        for g in muon:
            for slot in self._plans[g.index].mine:
                if self._finisher.get((g.index, slot), me) == me:
                    self._work["matrices"] += 1
                    self._work["flops"] += cost(g, slot)
        split = [(g.index, tuple(self._plans[g.index].owner)) for g in muon if getattr(g, "tp_split", False)]
        if split:  # a split matrix's slices meet at the same data-parallel rank of each tensor-parallel rank
            mine = [hash(tuple(split)) & 0x7FFFFFFF]
            if len({v[0] for v in tensor_comm.all_gather_ints(mine, what="Muon's owners")}) != 1:
                raise ValueError("Muon: the tensor-parallel ranks laid their split matrices out differently, so "
                                 "their slices would not meet at one owner; tag the split parameters "
                                 "`use_muon = False`")

    def whole_matrix_update(self, group, grad: torch.Tensor) -> None:
        """Replace ``group``'s gradient shard ``grad`` (fp32, unscaled, clipped; the optimizer's
        leaves' ``.grad`` are views of it) by Muon's update: momentum, then each whole matrix
        orthogonalized by its owner. Every rank of the group's axis calls it, in group order."""
        pg = self.param_groups[group.param_group]
        if not pg["use_muon"]:
            return
        plan = self._plans.get(group.index)
        if plan is None:
            raise RuntimeError(f"Muon: flat group {group.index} has no owner plan; the engine calls "
                               "plan_whole_matrices first")
        beta, torch_flavour = pg["momentum"], pg["flavour"] == "torch"
        for pc, leaf in zip(group.pieces, group.optim.leaves):
            g = grad[pc.shard_lo:pc.shard_hi]
            if leaf.grad is None:
                if torch_flavour:  # torch's Muon skips a parameter without a gradient
                    continue
                g.zero_()  # DeepSpeed's: a parameter without a gradient steps on zeros
                leaf.grad = g
            state = self.state[leaf]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(leaf)
            buf = state["momentum_buffer"]
            buf.lerp_(g, 1 - beta)
            if pg["nesterov"]:
                g.lerp_(buf, beta)
            else:
                g.copy_(buf)
            self._ready.add(id(leaf))
        heads = self._heads[group.index]
        kwargs: dict[str, Any] = dict(ns_method=pg["ns_method"], ns_steps=pg["ns_steps"], flavour=pg["flavour"])
        if torch_flavour:
            kwargs.update(coefficients=pg["ns_coefficients"], eps=pg["eps"], adjust_lr_fn=pg["adjust_lr_fn"])

        splits = self._splits[group.index]

        def compute(slot: int, whole: torch.Tensor) -> torch.Tensor:
            split, finisher = splits[slot], self._finisher.get((group.index, slot))
            if split is None:
                def local(w: torch.Tensor) -> torch.Tensor:
                    return orthogonalize(w, plan.shapes[slot], num_heads=heads[slot], **kwargs)
                if finisher is None:
                    return local(whole)
                # the same matrix on every tensor-parallel rank: one of them orthogonalizes it
                return _finish_replicated(whole, self._tensor_comm, finisher, plan.wire, local)
            # a tensor-parallel slice: whole over the tensor-parallel ranks, which own it too (the same
            # layout gives them the same owner among their data-parallel ranks); one of them finishes it
            return _finish_split(whole, split, self._tensor_comm, self._finisher[(group.index, slot)], plan.wire,
                                 lambda unsplit: orthogonalize(unsplit, torch.Size(split.shape), num_heads=heads[slot],
                                                               **kwargs))

        exchange(plan, grad, compute)

    @property
    def comm_kinds(self) -> tuple[str, ...]:
        """The collective kinds the update sends (counted in ``engine.comm_stats()``): the exchange's,
        where some group is sharded."""
        return ("muon_gather", "muon_scatter") if any(p.partitions > 1 for p in self._plans.values()) else ()

    def work(self) -> dict[str, int]:
        """This rank's share of the orthogonalization: matrices it orthogonalizes and their FLOPs per step
        (a tensor-parallel matrix whole, on the one of its owners that finishes it)."""
        return dict(self._work)

    # -- the step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            if not g["use_muon"]:
                continue
            leaves = [p for p in g["params"] if p.grad is not None]
            stale = [p for p in leaves if id(p) not in self._ready]
            if stale:
                raise RuntimeError("Muon's step found gradients that were not orthogonalized: it runs inside "
                                   "the engine's step (engine.step() or the optimizer initialize returned)")
            if not leaves:
                continue
            if g["weight_decay"]:
                torch._foreach_mul_(leaves, 1 - g["lr"] * g["weight_decay"])
            torch._foreach_add_(leaves, [p.grad for p in leaves], alpha=-g["lr"])
        self._ready.clear()
        for g in self.param_groups:
            if not g["use_muon"]:
                self._adam_step(g)
        return loss

    def _adam_step(self, g: dict) -> None:
        """The AdamW half (Adam with L2 decay without ``adam_w_mode``): torch's Adam, with the
        states AdamW keeps (``exp_avg``, ``exp_avg_sq``, ``step``)."""
        params, grads, avgs, sqs, steps = [], [], [], [], []
        for p in g["params"]:
            if p.grad is None:  # DeepSpeed's: a parameter without a gradient steps on zeros
                p.grad = torch.zeros_like(p)
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if self._fused else "cpu")
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            params.append(p)
            grads.append(p.grad)
            avgs.append(state["exp_avg"])
            sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            beta1, beta2 = g["betas"]
            adam(params, grads, avgs, sqs, [], steps, fused=self._fused or None,
                 decoupled_weight_decay=self.adam_w_mode, amsgrad=False, beta1=beta1, beta2=beta2,
                 lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)

"""Loading: find the checkpoint, open it as a ``Source``, and reshard it into an engine.

:func:`resolve_tag_dir` turns ``(load_dir, tag)`` into a tag directory (``latest`` names the
newest tag). :func:`open_source` opens it as zerodp's format (``ZerodpSource``, here) or
DeepSpeed's (``deepspeed.DeepSpeedSource``). :func:`load_into_engine` then fills an engine of
any world size and stage from it:

1. every rank checks the checkpoint against its model (names, shapes, optimizer) and reads
   what its shard needs into new tensors: for each parameter piece of its flat groups the
   value and the optimizer states, by element range, so each rank reads only its share;
2. the ranks agree that every rank succeeded (``coord.py``); on failure all raise and no
   engine has changed;
3. every rank puts what it read in place: optimizer state, fp32 masters (16-bit parameters
   rounded from them; with disk offload each tile read and written once, its states with it),
   then the all-gather that completes the full parameters at stages 1-2; packed 4-bit weights
   take the checkpoint's quantization state with their codes;
   the scheduler, loss scale, counters, RNG states (same world size only) and the
   data-loader position follow.
"""
from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Optional

import torch

from ..core.optim_shard import leaves_of, values_of
from ..core.view import CheckpointView
from .coord import Coordinator
from .layout import FORMAT, loose_parameters, model_aliases, persistent_buffers, rank_file, rank_json
from .save import INDEX, LATEST
from .source import VALUE, CheckpointError, EngineState, OptimizerInfo, ParamInfo, Read, Source
from .state import decode, restore_rng
from .tensorfile import FileRecord, TensorFile, _Checksum, dtype_from_name

logger = logging.getLogger("zerodp")


# -- finding the checkpoint -------------------------------------------------------------------

def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def list_tags(load_dir: Path) -> list[str]:
    """Tag directories in ``load_dir`` that hold a complete checkpoint (zerodp's or DeepSpeed's)."""
    from .deepspeed import is_deepspeed_checkpoint
    if not load_dir.is_dir():
        return []
    tags = [d.name for d in load_dir.iterdir() if d.is_dir() and not d.name.startswith(".")
            and ((d / INDEX).is_file() or is_deepspeed_checkpoint(d))]
    return sorted(tags, key=_natural)


def resolve_tag_dir(load_dir, tag: Optional[str] = None) -> Optional[Path]:
    """The tag directory to load, or None when ``tag`` is None and there is no ``latest``."""
    load_dir = Path(load_dir)
    for stale in sorted(load_dir.glob(".*.partial")) if load_dir.is_dir() else []:
        logger.warning("ignoring %s: an incomplete save left by an interrupted run (the next save "
                       "removes it)", stale)
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            return None
        tag = latest.read_text(encoding="utf-8").strip()
        if not tag:
            raise CheckpointError(f"{latest} is empty; pass tag= (tags in {load_dir}: "
                                  f"{', '.join(list_tags(load_dir)) or 'none'})")
    tag = str(tag)
    d = load_dir / tag
    if d.is_dir():
        return d
    old = load_dir / f".{tag}.old"
    if (old / INDEX).is_file():
        logger.warning("checkpoint %s is missing but %s, its previous version, is complete (a save of "
                       "the same tag was interrupted); loading that", d, old)
        return old
    tags = list_tags(load_dir)
    raise CheckpointError(f"no checkpoint tag {tag!r} in {load_dir}; tags there: "
                          f"{', '.join(tags) if tags else 'none'}")


def open_source(tag_dir: Path) -> Source:
    """The checkpoint in ``tag_dir``, whichever engine wrote it."""
    if (tag_dir / INDEX).is_file():
        return ZerodpSource(tag_dir)
    from .deepspeed import DeepSpeedSource, is_deepspeed_checkpoint
    if is_deepspeed_checkpoint(tag_dir):
        return DeepSpeedSource(tag_dir)
    listing = sorted(p.name for p in tag_dir.iterdir())[:12] if tag_dir.is_dir() else []
    raise CheckpointError(f"{tag_dir} is not a complete checkpoint: no {INDEX} (zerodp) and no DeepSpeed "
                          f"model-states file; it holds: {', '.join(listing) or 'nothing'}")


# -- zerodp's format ----------------------------------------------------------------------------

class ZerodpSource(Source):
    """A checkpoint in zerodp's format (see ``layout.py``)."""

    kind = "zerodp"

    def __init__(self, tag_dir: Path) -> None:
        self.path = Path(tag_dir)
        try:
            index = json.loads((self.path / INDEX).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.path / INDEX}: cannot be read ({e})") from None
        if index.get("format") != FORMAT:
            raise CheckpointError(f"{self.path / INDEX}: not a zerodp checkpoint index")
        self.index = index
        self.tag = index.get("tag", self.path.name)
        self.world_size, self.zero_stage = int(index["world_size"]), int(index["zero_stage"])
        self.compute_dtype = index["compute_dtype"]
        self._records = {name: FileRecord.from_json(r) for name, r in index["files"].items()}
        for r in range(self.world_size):
            for name in (rank_file(r), rank_json(r)):
                if name not in self._records:
                    raise CheckpointError(f"{self.path / INDEX}: no record of {name}")
                if not (self.path / name).is_file():
                    raise CheckpointError(f"{self.path / name} is missing: the checkpoint was written by "
                                          f"{self.world_size} ranks and each wrote one such file")
        self._files: dict[str, TensorFile] = {}
        self._split_cache: Optional[tuple] = None
        self.params = {}
        for name, e in index["params"].items():
            self.params[name] = ParamInfo(name, tuple(e["shape"]), dtype_from_name(e["dtype"]),
                                          e["param_group"], tuple(e.get("state_keys") or ()))
        self.aliases = dict(index.get("aliases", {}))
        opt = index.get("optimizer")
        if opt is not None:
            keys = [k for e in index["params"].values() for k in e.get("state_keys") or ()]
            scalars = [k for e in index["params"].values() for k in (e.get("scalars") or {})]
            self.optimizer = OptimizerInfo(opt["type"], decode(opt["param_groups"], self._rank0_tensor),
                                           tuple(dict.fromkeys(keys)), tuple(dict.fromkeys(scalars)))
        else:
            self.optimizer = None
        self.engine_state = EngineState(**{k: int(index["engine"].get(k, 0)) for k in
                                           ("global_steps", "micro_steps", "skipped_steps", "global_samples")})
        self.lr_scheduler = decode(index.get("lr_scheduler"), self._rank0_tensor)
        self.loss_scaler = index.get("loss_scaler")
        self.data_loader = index.get("data_loader")
        self.client_state = decode(index.get("client_state", {}), self._rank0_tensor)
        self.buffer_names = tuple(index.get("buffers", {}))
        self.packed = {p: tuple(states) for p, states in index.get("packed", {}).items()}

    def file(self, name: str) -> TensorFile:
        if name not in self._files:
            self._files[name] = TensorFile(self.path / name, self._records[name])
        return self._files[name]

    def _rank0_tensor(self, key: str) -> torch.Tensor:
        return self.file(rank_file(0)).read(key)

    def rank_record(self, rank: int) -> dict:
        """Rank ``rank``'s JSON record (its RNG state), checked against the index."""
        name = rank_json(rank)
        raw = (self.path / name).read_bytes()
        rec = self._records[name]
        crc = _Checksum(rec.block)
        crc.update(memoryview(raw))
        if len(raw) != rec.bytes or crc.finish() != rec.crc32:
            raise CheckpointError(f"{self.path / name}: size or checksum differs from the index: the "
                                  "file is corrupted")
        return json.loads(raw)

    def read(self, reads: list[Read]) -> None:
        per_file: dict[str, list] = {}
        split = []
        for rd in reads:
            info = self.params.get(rd.name)
            if info is None:
                raise CheckpointError(f"{self.path}: no parameter {rd.name!r}")
            if rd.kind != VALUE and rd.kind not in info.state_keys:
                raise CheckpointError(f"{self.path}: parameter {rd.name!r} has no optimizer state {rd.kind!r}")
            if "tp" in self.index["params"][rd.name]:
                split.append(rd)
                continue
            self._requests(rd.name, rd.kind, rd.lo, rd.hi, rd.out, per_file)
        for name, requests in sorted(per_file.items()):
            self.file(name).read_ranges(requests)
        for rd in split:
            rd.out.copy_(self._whole_split(rd.name, rd.kind, rd.out.dtype).reshape(-1)[rd.lo:rd.hi])

    def _requests(self, name: str, kind: str, lo: int, hi: int, out: torch.Tensor, per_file: dict,
                  tp_rank: Optional[int] = None) -> None:
        """Add the file reads that fill ``out`` with elements ``[lo, hi)`` of parameter ``name``
        (of tensor rank ``tp_rank``'s slice of it, for a split parameter)."""
        suffix = "value" if kind == VALUE else f"state.{kind}"
        for pc in self.index["params"][name]["pieces"]:
            if pc.get("tp") != tp_rank:
                continue
            a, b = max(lo, pc["start"]), min(hi, pc["stop"])
            if a >= b:
                continue
            at = pc["at"] + a - pc["start"]
            per_file.setdefault(rank_file(pc["rank"]), []).append(
                (f"{pc['prefix']}.{suffix}", at, at + b - a, out[a - lo:b - lo]))

    def _whole_split(self, name: str, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """The whole of a parameter split over tensor ranks (or of one of its optimizer states):
        every tensor rank's slice read and put in its place. The last one is kept, so reads of
        one parameter in several ranges read it once."""
        key = (name, kind, dtype)
        if self._split_cache is not None and self._split_cache[0] == key:
            return self._split_cache[1]
        from ..parallel.tensor import TPSlice
        tp = self.index["params"][name]["tp"]
        shape = tuple(self.params[name].shape)
        whole = torch.empty(shape, dtype=dtype)
        for t in range(tp["size"]):
            piece = TPSlice(tp["dim"], tp["size"], t, shape, tp["blocks"])
            local = torch.empty(piece.local_shape(), dtype=dtype)
            per_file: dict[str, list] = {}
            self._requests(name, kind, 0, local.numel(), local.view(-1), per_file, tp_rank=t)
            for fname, requests in sorted(per_file.items()):
                self.file(fname).read_ranges(requests)
            piece.place(whole, local, t)
        self._split_cache = (key, whole)
        return whole

    def scalar_state(self, name: str) -> Optional[dict[str, float]]:
        return self.index["params"][name].get("scalars")

    def scalar_types(self, name: str) -> dict[str, str]:
        return self.index["params"][name].get("scalar_types") or {}

    def read_buffers(self) -> dict[str, torch.Tensor]:
        buffers = self.index.get("buffers", {})  # each in its pipeline stage's first file (rank 0's)
        return {name: self.file(rank_file(buffers[name].get("rank", 0))).read(f"buffer.{name}")
                for name in self.buffer_names}

    def read_packed_states(self) -> dict[str, torch.Tensor]:
        packed = self.index.get("packed", {})  # in the pipeline stage's first file, as buffers
        return {name: self.file(rank_file(e.get("rank", 0))).read(f"packed.{name}")
                for states in packed.values() for name, e in states.items()}

    @property
    def rng_states(self) -> None:  # per rank, read on demand by rank_record()
        return None

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


# -- resharding into an engine ------------------------------------------------------------------

_ADAM_FAMILY = {"adam", "adamw", "fusedadam", "deepspeedcpuadam", "cpuadam", "adamwschedulefree"}


def _family(name: str) -> str:
    key = name.lower().replace("_", "")
    if key in ("muon", "muonwithauxadam"):  # DeepSpeed's config type, the class both name
        return "muon"
    return "adam" if key in _ADAM_FAMILY else key


class _Plan:
    """What one rank reads and where it goes (phase 1 of ``load_into_engine``)."""

    def __init__(self) -> None:
        self.values: list[tuple[Any, Any, torch.Tensor]] = []      # (group, piece, tensor)
        self.states: dict[int, dict[str, Any]] = {}                 # id(piece param) -> state
        self.piece_params: dict[int, torch.nn.Parameter] = {}
        self.loose: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.packed_states: dict[str, torch.Tensor] = {}


def _match_names(view: CheckpointView, src: Source, strict: bool) -> dict[str, str]:
    """Model parameter name -> the checkpoint's name for it; raises on mismatch (strict)."""
    module = view.module
    model_alias = model_aliases(module)
    names = [n for n, _ in module.named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    for g in view.flat_groups:  # stage 3: the module's parameters are empty views; split ones, slices
        for s in g.slots:
            shapes[s.name] = tuple(s.tp.shape if s.tp is not None else s.shape)
    others: dict[str, list[str]] = {}
    for alias, canon in model_alias.items():
        others.setdefault(canon, []).append(alias)
    experts = view.experts
    own = experts.names_on(experts.ep_rank) if experts is not None else {}  # experts by their unsplit names
    mapping, missing, wrong = {}, [], []
    for n in names:
        found = None
        for cand in [own.get(n, n), *others.get(n, [])]:
            if cand in src.params:
                found = cand
                break
            if cand in src.aliases and src.aliases[cand] in src.params:
                found = src.aliases[cand]
                break
        if found is None:
            missing.append(n)
            continue
        if tuple(src.params[found].shape) != shapes[n]:
            wrong.append(f"{n}: checkpoint {tuple(src.params[found].shape)}, model {shapes[n]}")
            continue
        mapping[n] = found
    used = set(mapping.values())
    if view.ranks.pipe_size > 1:  # the other pipeline stages load the rest
        used = {n for stage in view.ranks.pipe_comm.all_gather_objects(sorted(used)) for n in stage}
    if experts is not None:  # the other expert-parallel ranks load their experts
        used = {n for rank in view.ranks.coord_comm.all_gather_objects(sorted(used)) for n in rank}
    unexpected = [n for n in src.params if n not in used]
    if wrong or (strict and (missing or unexpected)):
        parts = []
        if wrong:
            parts.append(f"shapes differ for {len(wrong)}: " + "; ".join(wrong[:10]))
        if strict and missing:
            parts.append(f"{len(missing)} model parameters are not in the checkpoint: " + ", ".join(missing[:10])
                         + (" ..." if len(missing) > 10 else ""))
        if strict and unexpected:
            parts.append(f"{len(unexpected)} checkpoint parameters are not in the model: "
                         + ", ".join(unexpected[:10]) + (" ..." if len(unexpected) > 10 else ""))
        raise CheckpointError(f"{src.describe()} does not fit this model: " + "; ".join(parts)
                              + ("" if wrong else " (load_module_strict=False loads the parameters both have)"))
    return mapping


def _check_optimizer(view: CheckpointView, src: Source) -> None:
    if src.optimizer is None:
        raise CheckpointError(f"{src.describe()} holds no optimizer state; pass load_optimizer_states=False")
    mine, theirs = type(view.optimizer).__name__, src.optimizer.type
    if _family(mine) != _family(theirs):
        keys = src.optimizer.elementwise_keys + src.optimizer.scalar_keys
        raise CheckpointError(f"{src.describe()} holds the state of a {theirs} optimizer "
                              f"(state: {', '.join(keys) or 'none'}); "
                              f"this run's optimizer is {mine}. Use the same optimizer type, or pass "
                              "load_optimizer_states=False to load the weights only")
    n_mine, n_theirs = len(view.optimizer.param_groups), len(src.optimizer.param_groups)
    if n_mine != n_theirs:
        raise CheckpointError(f"{src.describe()} has {n_theirs} optimizer param groups, this run has "
                              f"{n_mine}; build the optimizer with the same param groups")


def _read_plan(view: CheckpointView, src: Source, mapping: dict[str, str], with_optimizer: bool) -> _Plan:
    plan, reads, split_reads = _Plan(), [], []
    for g in view.flat_groups:
        value_dtype = values_of(g).dtype
        for pc, pp in zip(g.pieces, leaves_of(g)):
            slot = g.slots[pc.slot]
            if slot.name not in mapping:
                continue
            cname, n = mapping[slot.name], pc.shard_hi - pc.shard_lo
            # a slice of a split parameter: read the whole (any layout the checkpoint has) and cut it
            do = reads.append if slot.tp is None else (lambda rd, tp=slot.tp: split_reads.append((tp, rd)))
            out = torch.empty(n, dtype=value_dtype, device=g.device)
            do(Read(cname, VALUE, pc.param_lo, pc.param_lo + n, out))
            plan.values.append((g, pc, out))
            info = src.params[cname]
            if not (with_optimizer and pp is not None and info.state_keys):
                continue
            state: dict[str, Any] = {}
            for key in info.state_keys:
                buf = torch.empty(n, dtype=pp.dtype, device=pp.device)
                do(Read(cname, key, pc.param_lo, pc.param_lo + n, buf))
                state[key] = buf
            scalars = src.scalar_state(cname) or {}
            types = src.scalar_types(cname) if hasattr(src, "scalar_types") else {}
            for key, v in scalars.items():
                kind = types.get(key, "float32")
                state[key] = (int(v) if kind == "int" else float(v)) if kind in ("int", "float") \
                    else torch.tensor(v, dtype=dtype_from_name(kind))
            plan.states[id(pp)] = state
            plan.piece_params[id(pp)] = pp
    for name, p in loose_parameters(view).items():
        cname = mapping.get(name)
        if cname is not None:
            out = torch.empty(p.numel(), dtype=src.params[cname].dtype)
            reads.append(Read(cname, VALUE, 0, p.numel(), out))
            plan.loose[name] = out
    src.read(reads)
    for tp, rd in split_reads:  # one parameter at a time: its whole, then this rank's slice of it
        whole = torch.empty(math.prod(tp.shape), dtype=rd.out.dtype)
        src.read([Read(rd.name, rd.kind, 0, whole.numel(), whole)])
        rd.out.copy_(tp.take(whole.view(tp.shape)).reshape(-1)[rd.lo:rd.hi])
    wanted = persistent_buffers(view.module)
    if src.buffer_names:
        got = src.read_buffers()
        for name, buf in wanted.items():
            if name in got:
                if tuple(got[name].shape) != tuple(buf.shape):
                    raise CheckpointError(f"{src.describe()}: buffer {name} has shape {tuple(got[name].shape)}, "
                                          f"the model's {tuple(buf.shape)}")
                plan.buffers[name] = got[name]
    plan.packed_states = src.read_packed_states()
    return plan


def _load_lr_scheduler(view: CheckpointView, src: Source) -> None:
    """Load the scheduler's state; DeepSpeed's schedulers save ``{"last_batch_iteration": i}``,
    zerodp's (DeepSpeed's schedules as torch schedulers) take torch's format. When the
    checkpoint's param groups carry no learning rate, the schedule sets it."""
    sched, state = view.lr_scheduler, src.lr_scheduler
    if "last_batch_iteration" in state and "last_epoch" not in state:
        if not hasattr(sched, "lr_at"):
            raise CheckpointError(f"{src.describe()} holds a DeepSpeed learning-rate schedule, and this "
                                  f"run's scheduler ({type(sched).__name__}) is not one of zerodp's "
                                  "DeepSpeed schedules (the config's 'scheduler' block); pass "
                                  "load_lr_scheduler_states=False")
        iteration = int(state["last_batch_iteration"])
        state = dict(sched.state_dict(), last_epoch=iteration + 1, _step_count=iteration + 2,
                     _last_lr=sched.lr_at(iteration))
    sched.load_state_dict(state)
    groups = src.optimizer.param_groups if src.optimizer is not None else []
    if not any("lr" in g for g in groups):
        for group, lr in zip(view.optimizer.param_groups, sched.get_last_lr()):
            group["lr"] = lr


def load_into_engine(view: CheckpointView, src: Source, *, strict: bool = True,
                     load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                     load_module_only: bool = False) -> dict:
    """Fill the engine behind ``view`` from ``src`` (see module docstring); returns the client state."""
    coord = Coordinator(view.ranks.coord_comm)
    with_optimizer = load_optimizer_states and not load_module_only
    err, plan = None, None
    try:
        mapping = _match_names(view, src, strict)
        if with_optimizer:
            _check_optimizer(view, src)
        plan = _read_plan(view, src, mapping, with_optimizer)
        rng = None
        if not load_module_only and isinstance(src, ZerodpSource) and src.world_size == view.ranks.writer_count:
            rng = src.rank_record(view.ranks.writer_rank).get("rng")
    except Exception as e:  # noqa: BLE001 - reported to every rank
        err = e
    coord.agree(err, f"loading {src.describe()}")

    view.release_units()
    with torch.no_grad():
        if with_optimizer:
            _load_optimizer(view, src, plan)
        values: dict[int, list] = {}
        for g, pc, value in plan.values:
            values.setdefault(g.index, []).append((pc, value))
        for g in view.flat_groups:
            with g.swapped_in():  # disk offload: one read and write of the tile
                target = values_of(g)
                for pc, value in values.get(g.index, ()):
                    target[pc.shard_lo:pc.shard_hi].copy_(value)
                if g.optim is not None:
                    g.optim.write_back()
                if with_optimizer and g.optim is not None and g.optim.page is not None:  # states to the file
                    view.offload.adopt_states(g, view.optimizer)
            if not g.shards_parameters and g.partitions > 1:
                view.shard_axes.of(g).all_gather(g.full)
        params = dict(view.module.named_parameters())
        for name, value in plan.loose.items():
            params[name].copy_(value.view_as(params[name]))
        buffers = persistent_buffers(view.module)
        for name, value in plan.buffers.items():
            buffers[name].copy_(value)
    view.restore_packed_states(plan.packed_states)  # the codes loaded above are read with these
    view.zero_grad()
    if not load_module_only:
        if load_lr_scheduler_states and view.lr_scheduler is not None and src.lr_scheduler is not None:
            _load_lr_scheduler(view, src)
        if view.loss_scaler is not None and src.loss_scaler is not None:
            view.loss_scaler.load_state_dict(src.loss_scaler)
        st = src.engine_state
        # a checkpoint is taken at an accumulation boundary; this run's accumulation may differ
        view.restore_step_counters(st.global_steps, st.global_steps * view.gradient_accumulation_steps,
                                   st.skipped_steps)
        if rng is not None:
            restore_rng(rng, lambda key: src.file(rank_file(view.ranks.writer_rank)).read(key))
        elif view.ranks.writer_rank == 0 and isinstance(src, ZerodpSource):
            logger.info("RNG states not restored: the checkpoint was written by %d ranks, this run has %d",
                        src.world_size, view.ranks.writer_count)
        loader = view.training_dataloader
        if src.data_loader is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(src.data_loader)
    return src.client_state


def _load_optimizer(view: CheckpointView, src: Source, plan: _Plan) -> None:
    opt = view.optimizer
    current = opt.state_dict()
    index_of = {}
    k = 0
    for group in opt.param_groups:
        for p in group["params"]:
            index_of[id(p)] = k
            k += 1
    state = {index_of[pid]: st for pid, st in plan.states.items()}
    groups = []
    for mine, theirs in zip(current["param_groups"], src.optimizer.param_groups):
        g = dict(mine)
        for key, value in theirs.items():
            if key in mine or key == "initial_lr":
                old = mine.get(key)
                if isinstance(old, tuple) and isinstance(value, list):
                    value = tuple(value)
                if isinstance(old, torch.Tensor) and not isinstance(value, torch.Tensor):
                    value = torch.tensor(value, dtype=old.dtype)
                g[key] = value
        groups.append(g)
    opt.load_state_dict({"state": state, "param_groups": groups})

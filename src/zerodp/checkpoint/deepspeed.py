"""Checkpoints written by DeepSpeed 0.19's ``engine.save_checkpoint`` at ZeRO stages 1, 2 and
3 (fp32, bf16 and fp16), read through the :class:`~zerodp.checkpoint.source.Source` view.

A tag directory (``ckpt/global_step4/``) holds:

* the model states: ``mp_rank_00_model_states.pt`` at stages 1 and 2, one
  ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank at stage 3 (rank 0's holds the
  metadata). They carry the module state dict (stage 3: empty placeholders for the partitioned
  parameters), ``buffer_names``, ``param_shapes`` (one ordered name -> shape map per flat
  group, in flat order), ``frozen_param_shapes``/``frozen_param_fragments`` (stages 2 and 3),
  ``shared_params`` (tied name -> stored name), the scheduler state, the engine counters, the
  ``ds_config`` and the user's ``client_state`` keys merged in at the top level;
* one optimizer file per data-parallel rank, ``zero_pp_rank_R_mp_rank_00_optim_states.pt``
  (``bf16_zero_pp_rank_R_...`` for bf16 runs), whose ``optimizer_state_dict`` holds that
  rank's fp32 partitions and the base optimizer's state of them.

DeepSpeed writes pickles. They are read only with ``torch.load(weights_only=True,
mmap=True)``, with stand-in classes registered under the names of the few DeepSpeed types
they hold (``pickles.ALLOWED_GLOBALS``); a file naming any other non-torch global is refused
before it is unpickled. Every file is opened at most once, when first needed, and its tensors
stay memory-mapped.

The files are found and checked in ``deepspeed_files.py``, and the partition layout of stages
1, 2 and 3 is worked out in ``deepspeed_layout.py``; this module opens the files and reads the
metadata and the values through the Source view.
"""
from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Optional, Union

import torch

from .deepspeed_files import (
    _OPTIM_RE,
    _STAGE3_MODEL_RE,
    MODEL_FILE,
    OPTIM_FILE,
    STAGE3_MODEL_FILE,
    _DeepSpeedFiles,
    _files,
    is_deepspeed_checkpoint,
)
from .deepspeed_layout import _DeepSpeedLayout, _Piece
from .pickles import load_pickle
from .source import VALUE, CheckpointError, EngineState, OptimizerInfo, ParamInfo, Read, Source

#: Top-level keys DeepSpeed itself writes into the model states file; the rest is client_state.
_ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
    "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info", "num_experts",
})


def _json(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _is_elementwise(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1


def _scalar(value: Any) -> Optional[float]:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


class DeepSpeedSource(_DeepSpeedFiles, _DeepSpeedLayout, Source):
    """A DeepSpeed ZeRO 1/2/3 checkpoint (see the docstrings of this module and of
    ``deepspeed_layout``), opened from its tag
    directory (or from the directory above it, through its ``latest`` file).

    Values of trainable parameters are the fp32 master partitions; frozen parameters come in
    their stored dtype. Optimizer state is the base optimizer's, per flat group; its ``step``
    is reported for every parameter of the group. An ``elastic_checkpoint`` stores no param
    group hyperparameters, and then ``optimizer.param_groups`` holds empty dicts.
    """

    kind = "deepspeed"

    def __init__(self, tag_dir: Union[str, Path]) -> None:
        path = Path(tag_dir)
        if not path.is_dir():
            raise CheckpointError(f"{path} is not a directory")
        if not is_deepspeed_checkpoint(path) and (path / "latest").is_file():
            path = path / (path / "latest").read_text().strip()
        if not is_deepspeed_checkpoint(path):
            raise CheckpointError(f"{path} is not a DeepSpeed checkpoint tag directory (no "
                                  f"{MODEL_FILE} and no zero_pp_rank_*_model_states.pt/_optim_states.pt files)")
        self.path, self.tag = path, path.name
        self._cache: dict[Path, Any] = {}
        names = _files(path)
        self._refuse_unsupported_files(names)

        stage3_files = sorted(int(m.group(1)) for n in names if (m := _STAGE3_MODEL_RE.match(n)))
        self._stage3_files = bool(stage3_files)
        model_name = STAGE3_MODEL_FILE.format(rank=0) if stage3_files else MODEL_FILE
        if not (path / model_name).is_file():
            raise CheckpointError(f"{path / model_name} is missing: the checkpoint was written by "
                                  f"{self._world_hint(names)}, and this file holds its model states and metadata")
        model = self._load(path / model_name)
        if not isinstance(model, dict):
            raise CheckpointError(f"{path / model_name} does not hold a DeepSpeed model states dict")
        self._model0 = model
        self._ds_config = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else {}
        self._check_parallelism(model, path / model_name)

        self.compute_dtype = self._find_compute_dtype(names)
        optim_ranks = {int(m.group(2)): n for n in names if (m := _OPTIM_RE.match(n))}
        if not optim_ranks:
            zero = self._ds_config.get("zero_optimization")
            stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
            if isinstance(stage, int) and stage >= 1:
                raise CheckpointError(
                    f"{path} holds no zero_pp_rank_*_optim_states.pt files although its ds_config says ZeRO "
                    f"stage {stage} and {model.get('dp_world_size')} ranks: the optimizer files are missing")
            raise CheckpointError(
                f"{path} holds no zero_pp_rank_*_optim_states.pt files: a checkpoint without ZeRO optimizer "
                f"partitions (ZeRO stage {stage}, optimizer state inside {model_name}) is not supported; "
                "only ZeRO stages 1, 2 and 3 are")
        prefixes = {n.startswith("bf16_") for n in optim_ranks.values()}
        both = len(prefixes) == 2
        self._optim_prefix = "bf16_" if prefixes == {True} or (both and self.compute_dtype == "bf16") else ""

        dp_world = model.get("dp_world_size")
        rank0 = path / OPTIM_FILE.format(prefix=self._optim_prefix, rank=0)
        if not rank0.is_file():
            raise CheckpointError(f"{rank0} is missing: the checkpoint was written by "
                                  f"{dp_world if dp_world is not None else 'an unknown number of'} ranks")
        opt0 = self._optim_dict(rank0)
        counts = opt0.get("partition_count")
        counts = counts if isinstance(counts, list) else [counts]
        if not counts or any(not isinstance(c, int) for c in counts):
            raise CheckpointError(f"{rank0} has no partition_count: not a ZeRO optimizer states file")
        if len(set(counts)) != 1:
            raise CheckpointError(f"{rank0}: param groups are partitioned over different numbers of ranks "
                                  f"({counts}, expert-parallel MoE groups); such checkpoints are not supported")
        self.world_size = counts[0]
        self._check_rank_files(names, optim_ranks)

        stage = opt0.get("zero_stage")
        if stage is None:  # BF16_Optimizer writes no zero_stage
            stage = self._ds_config.get("zero_optimization", {}).get("stage")
            self._padded_partitions = True
        else:
            self._padded_partitions = False
        try:
            stage = int(stage)
        except (TypeError, ValueError):
            raise CheckpointError(f"{rank0}: cannot tell the ZeRO stage (zero_stage {stage!r})") from None
        if stage not in (1, 2, 3):
            raise CheckpointError(f"{rank0}: ZeRO stage {stage} is not supported; only stages 1, 2 and 3 are")
        if (stage == 3) != self._stage3_files:
            raise CheckpointError(f"{path}: the optimizer files say ZeRO stage {stage} but the model states "
                                  f"are laid out for stage {'3' if self._stage3_files else '1 or 2'}")
        self.zero_stage = stage
        if stage == 3 and opt0.get("ds_zero_partition_groups") is not None:
            raise CheckpointError(f"{rank0}: ZeRO-3 sub groups partitioned over expert-parallel groups "
                                  "(AutoEP) are not supported")

        param_shapes = model.get("param_shapes")
        if not isinstance(param_shapes, list):
            raise CheckpointError(f"{path / model_name} has no param_shapes: not a ZeRO checkpoint")
        self._pieces: dict[str, list[_Piece]] = {}
        self._group_of: dict[str, int] = {}
        self._flat_of: dict[str, int] = {}
        self._shapes: dict[str, tuple] = {}
        self._expected_len: list[Union[int, list[int]]] = []
        self._whole_offsets: Optional[dict] = None
        if stage == 3:
            self._layout_stage3(param_shapes, opt0, rank0)
        else:
            self._layout_stage12(param_shapes, opt0, rank0)
        self._frozen_shapes, self._frozen_dtypes = self._layout_frozen(model)
        self._check_rank_layout(0, opt0, rank0)

        self.aliases = {str(k): str(v) for k, v in (model.get("shared_params") or {}).items()}
        self._fill_params(model)
        self.optimizer = self._optimizer_info(opt0)
        self.engine_state = self._engine_state(model)
        self.lr_scheduler = model.get("lr_scheduler")
        self.loss_scaler = self._loss_scaler(opt0)
        self.client_state = {k: v for k, v in model.items() if k not in _ENGINE_KEYS}
        self.rng_states = None
        self.data_loader = None
        self.buffer_names = tuple(model.get("buffer_names") or ())

    # ------------------------------------------------------------------ files

    def _load(self, path: Path) -> Any:
        if path not in self._cache:
            self._cache[path] = load_pickle(path)
        return self._cache[path]

    # ------------------------------------------------------------------ metadata

    def _group_states(self, opt: dict) -> list[dict]:
        """The base optimizer's state of every flat group (stage 1/2: param group; stage 3: sub group)."""
        if self.zero_stage == 3:
            base = opt["optimizer_state_dict"]
            return [base.get("state", {}).get(s, {}) for s in range(len(self._expected_len))]
        base = opt.get("base_optimizer_state")
        if isinstance(base, list):
            return [dict(s) for s in base]
        if isinstance(base, dict):
            groups = base.get("param_groups", [])
            out = []
            for g in range(len(self._expected_len)):
                idx = groups[g]["params"][0] if g < len(groups) and groups[g].get("params") else None
                out.append(base.get("state", {}).get(idx, {}))
            return out
        raise CheckpointError(f"{self._optim_file(0)}: no base optimizer state")

    def _base_param_groups(self, opt: dict) -> Optional[list[dict]]:
        base = opt.get("optimizer_state_dict") if self.zero_stage == 3 else opt.get("base_optimizer_state")
        if isinstance(base, dict) and isinstance(base.get("param_groups"), list):
            return base["param_groups"]
        return None

    def _fill_params(self, model: dict) -> None:
        module = model.get("module") or {}
        buffers = set(model.get("buffer_names") or ())
        order = [n for n in module if n not in buffers and n not in self.aliases and n in self._pieces]
        order += [n for n in self._pieces if n not in order]
        opt0 = self._rank_optim(0)
        states = self._group_states(opt0)
        flat_dtypes = [t.dtype for t in (opt0.get("fp32_flat_groups") if self.zero_stage == 3
                                         else opt0.get("single_partition_of_fp32_groups"))]
        self.params = {}
        for name in order:
            if name in self._flat_of:
                flat = self._flat_of[name]
                keys = tuple(k for k, v in states[flat].items() if _is_elementwise(v))
                self.params[name] = ParamInfo(name, self._shapes[name], flat_dtypes[flat], self._group_of[name], keys)
            else:
                self.params[name] = ParamInfo(name, self._frozen_shapes[name], self._frozen_dtypes[name], None, ())
        self.aliases = {a: c for a, c in self.aliases.items() if c in self.params}

    def _optimizer_info(self, opt0: dict) -> OptimizerInfo:
        states = self._group_states(opt0)
        groups = self._base_param_groups(opt0)
        elementwise: list[str] = []
        scalar: list[str] = []
        for state in states:
            for k, v in state.items():
                target = elementwise if _is_elementwise(v) else scalar if _scalar(v) is not None else None
                if target is not None and k not in target:
                    target.append(k)
        if "step" not in scalar and (opt0.get("base_optimizer_state_step") is not None
                                     or any("step" in g for g in groups or [])):
            scalar.append("step")
        n_groups = len(groups) if groups is not None else (1 + max(self._group_of.values(), default=-1))
        hyper = [{k: _json(v) for k, v in g.items() if k not in ("params", "step")} for g in groups] \
            if groups is not None else [{} for _ in range(n_groups)]
        return OptimizerInfo(type=self._optimizer_type(groups), param_groups=hyper,
                             elementwise_keys=tuple(elementwise), scalar_keys=tuple(scalar))

    def _optimizer_type(self, groups: Optional[list[dict]]) -> str:
        block = self._ds_config.get("optimizer")
        if isinstance(block, dict) and isinstance(block.get("type"), str):
            name, params = block["type"], block.get("params") or {}
            if name.lower() in ("adam", "adamw"):
                adamw = name.lower() == "adamw" or bool(params.get("adam_w_mode", True))
                if params.get("torch_adam"):
                    return "AdamW" if adamw else "Adam"
                zero = self._ds_config.get("zero_optimization") or {}
                offload = (zero.get("offload_optimizer") or {}).get("device") if isinstance(zero, dict) else None
                if zero.get("cpu_offload") or offload in ("cpu", "nvme"):
                    return "DeepSpeedCPUAdam"
                return "FusedAdam"
            return name
        keys = set(groups[0]) if groups else set()
        if "decoupled_weight_decay" in keys:
            return "AdamW" if groups[0]["decoupled_weight_decay"] else "Adam"
        if "betas" in keys:
            return "Adam"
        if "momentum" in keys and "dampening" in keys:
            return "SGD"
        return "unknown"

    def _engine_state(self, model: dict) -> EngineState:
        steps = int(model.get("global_steps") or 0)
        cfg = self._ds_config
        gas = cfg.get("gradient_accumulation_steps")
        if not isinstance(gas, int):
            tbs, mbs = cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu")
            gas = tbs // (mbs * self.world_size) if isinstance(tbs, int) and isinstance(mbs, int) and mbs else 1
        return EngineState(global_steps=steps, micro_steps=steps * max(int(gas), 1),
                           skipped_steps=int(model.get("skipped_steps") or 0),
                           global_samples=int(model.get("global_samples") or 0))

    def _loss_scaler(self, opt0: dict) -> Optional[dict]:
        if self.compute_dtype != "fp16":
            return None
        scaler = opt0.get("loss_scaler")
        skipped = self.engine_state.skipped_steps
        fp16 = self._ds_config.get("fp16") or {}
        scale = float(getattr(scaler, "cur_scale", fp16.get("loss_scale") or 1.0))
        if getattr(scaler, "dynamic", False):
            hysteresis = int(getattr(scaler, "cur_hysteresis", fp16.get("hysteresis", 2)))
            good = int(getattr(scaler, "cur_iter", 0)) - int(getattr(scaler, "last_overflow_iter", -1)) - 1
        else:
            hysteresis = int(fp16.get("hysteresis", 2))
            good = self.engine_state.global_steps - skipped
        return {"scale": scale, "hysteresis_left": hysteresis, "good_steps": max(good, 0), "overflows": skipped}

    # ------------------------------------------------------------------ reads

    def _resolve(self, name: str) -> str:
        name = self.aliases.get(name, name)
        if name not in self.params:
            raise CheckpointError(f"{self.describe()} has no parameter {name!r}")
        return name

    def _frozen_tensor(self, name: str, rank: int) -> torch.Tensor:
        model = self._load(self._model_file(rank))
        fragments = model.get("frozen_param_fragments") or {}
        t = fragments.get(name)
        if t is None and self.zero_stage < 3:
            t = (model.get("module") or {}).get(name)
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{self._model_file(rank)} holds no value of frozen parameter {name}")
        return t

    def _flat_tensor(self, name: str, kind: str, piece: _Piece) -> torch.Tensor:
        if piece.where is None:
            return self._frozen_tensor(name, piece.rank)
        opt = self._rank_optim(piece.rank)
        if kind == VALUE:
            key = "fp32_flat_groups" if self.zero_stage == 3 else "single_partition_of_fp32_groups"
            return opt[key][piece.where]
        t = self._group_states(opt)[piece.where].get(kind)
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{self._optim_file(piece.rank)} holds no {kind!r} state for the flat group "
                                  f"of parameter {name}")
        return t

    def read(self, reads: list[Read]) -> None:
        plan = []
        for rd in reads:
            name = self._resolve(rd.name)
            info = self.params[name]
            if rd.kind != VALUE and rd.kind not in info.state_keys:
                raise CheckpointError(f"{self.describe()}: parameter {name} has no {rd.kind!r} "
                                      f"(stored: {', '.join((VALUE,) + info.state_keys)})")
            if not 0 <= rd.lo <= rd.hi <= info.numel:
                raise CheckpointError(f"read of elements [{rd.lo}, {rd.hi}) of {name}, which has {info.numel}")
            if rd.out.dim() != 1 or rd.out.numel() != rd.hi - rd.lo:
                raise CheckpointError(f"read of {name}[{rd.lo}:{rd.hi}] into a tensor of shape {tuple(rd.out.shape)}")
            for p in self._pieces[name]:
                lo, hi = max(rd.lo, p.elem), min(rd.hi, p.elem + p.length)
                if lo < hi:
                    plan.append((p.rank, p.where is None, name, rd, p, lo, hi))
        plan.sort(key=lambda item: (item[0], item[1]))
        for _, _, name, rd, p, lo, hi in plan:
            flat = self._flat_tensor(name, rd.kind, p).reshape(-1)
            start = p.local + lo - p.elem
            whole = self._whole_params_offset(name, p, flat.numel()) if rd.kind != VALUE else None
            if whole is not None:  # kept per whole parameter (Muon's momentum at stages 1-2)
                start = whole + lo
            if start + hi - lo > flat.numel():
                raise CheckpointError(f"{self.describe()}: the stored {rd.kind} of {name} ends before element "
                                      f"{hi} (rank {p.rank} holds {flat.numel()} elements)")
            rd.out[lo - rd.lo:hi - rd.lo].copy_(flat[start:start + hi - lo])

    def _whole_params_offset(self, name: str, piece: _Piece, stored: int) -> Optional[int]:
        """Where parameter ``name`` starts in a state that rank ``piece.rank`` keeps per *whole*
        parameter rather than per partition: at stages 1-2 DeepSpeed's Muon keeps the momentum of
        every parameter overlapping a rank's partition, whole and back to back in partition order
        (so a parameter split over two ranks has its momentum on both). ``None`` when ``stored``
        (the state's length) is the partition's, as every other state is."""
        if self.zero_stage == 3 or piece.where is None:
            return None
        if self._whole_offsets is None:
            self._whole_offsets = {}
            overlapping: dict[tuple[int, int], list[tuple[int, str]]] = {}
            for other, pieces in self._pieces.items():
                for q in pieces:
                    if q.where is not None:
                        overlapping.setdefault((q.rank, q.where), []).append((q.local, other))
            for key, names in overlapping.items():
                at = 0
                for _, other in sorted(names):
                    self._whole_offsets[(*key, other)] = at
                    at += self.params[other].numel
                self._whole_offsets[key] = at  # type: ignore[index]
        total = self._whole_offsets.get((piece.rank, piece.where))
        partition = self._expected_len[piece.where]
        partition = partition[piece.rank] if isinstance(partition, list) else partition
        if total is None or stored != total or stored == partition:
            return None
        return self._whole_offsets[(piece.rank, piece.where, name)]

    def scalar_state(self, name: str) -> Optional[dict[str, float]]:
        name = self._resolve(name)
        if name not in self._flat_of:
            return None
        opt0 = self._rank_optim(0)
        state = self._group_states(opt0)[self._flat_of[name]]
        if not state:
            return None
        out = {k: s for k, v in state.items() if not _is_elementwise(v) and (s := _scalar(v)) is not None}
        if "step" not in out:
            groups = self._base_param_groups(opt0)
            step = opt0.get("base_optimizer_state_step")
            if step is None and groups is not None:
                step = groups[self._group_of[name]].get("step")
            if _scalar(step) is not None:
                out["step"] = _scalar(step)
        return out

    def read_buffers(self) -> dict[str, torch.Tensor]:
        module = self._model0.get("module") or {}
        missing = [n for n in self.buffer_names if n not in module]
        if missing:
            raise CheckpointError(f"{self._model_file(0)} lists buffers {missing} but holds no value for them")
        return {n: module[n].clone() for n in self.buffer_names}

    def close(self) -> None:
        self._cache.clear()

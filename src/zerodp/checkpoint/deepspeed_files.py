"""The files of a DeepSpeed checkpoint: their names, recognising a tag directory, refusing
the kinds of checkpoints this reader does not support, checking every rank's files are there,
and telling the compute dtype. :class:`_DeepSpeedFiles` is the part of
:class:`~zerodp.checkpoint.deepspeed.DeepSpeedSource` that does this.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Union

import torch

from .source import CheckpointError

MODEL_FILE = "mp_rank_00_model_states.pt"
STAGE3_MODEL_FILE = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
OPTIM_FILE = "{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"

_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_STAGE3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def _files(tag_dir: Path) -> list[str]:
    try:
        return [p.name for p in tag_dir.iterdir() if p.is_file()]
    except OSError:
        return []


def is_deepspeed_checkpoint(tag_dir: Union[str, Path]) -> bool:
    """Whether ``tag_dir`` is a tag directory written by DeepSpeed's ``save_checkpoint``: it
    holds ``mp_rank_00_model_states.pt`` or per-rank ``zero_pp_rank_*`` model or optimizer
    state files."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        return False
    return any(n == MODEL_FILE or _OPTIM_RE.match(n) or _STAGE3_MODEL_RE.match(n) for n in _files(tag_dir))


def _enabled(cfg: dict, *keys: str) -> bool:
    return any(isinstance(cfg.get(k), dict) and bool(cfg[k].get("enabled", False)) for k in keys)


class _DeepSpeedFiles:
    """The files of the checkpoint: per-rank file names and the checks on them. Uses ``path``,
    ``world_size``, ``zero_stage``, ``_optim_prefix``, ``_stage3_files``, ``_ds_config``,
    ``_model0`` and ``_load`` as :class:`DeepSpeedSource` sets them."""

    def _optim_dict(self, path: Path) -> dict:
        sd = self._load(path)
        if not isinstance(sd, dict) or not isinstance(sd.get("optimizer_state_dict"), dict):
            raise CheckpointError(f"{path} does not hold a DeepSpeed optimizer_state_dict")
        return sd["optimizer_state_dict"]

    def _optim_file(self, rank: int) -> Path:
        return self.path / OPTIM_FILE.format(prefix=self._optim_prefix, rank=rank)

    def _model_file(self, rank: int) -> Path:
        return self.path / (STAGE3_MODEL_FILE.format(rank=rank) if self.zero_stage == 3 else MODEL_FILE)

    def _rank_optim(self, rank: int) -> dict:
        path = self._optim_file(rank)
        fresh = path not in self._cache
        opt = self._optim_dict(path)
        if fresh and rank != 0:
            try:
                self._check_rank_layout(rank, opt, path)
            except CheckpointError:
                del self._cache[path]
                raise
        return opt

    def _refuse_unsupported_files(self, names: list[str]) -> None:
        for n in names:
            if n.startswith("layer_") and n.endswith("model_states.pt"):
                raise CheckpointError(f"{self.path / n}: pipeline-parallel checkpoints (per-layer files) "
                                      "are not supported")
            if n.startswith(("expert_", "expp_rank_")):
                raise CheckpointError(f"{self.path / n}: checkpoints of MoE expert parameters are not supported")
            m = _OPTIM_RE.match(n) or _STAGE3_MODEL_RE.match(n)
            if (m and int(m.groups()[-1]) != 0) or re.match(r"^mp_rank_(?!00_)\d+_model_states\.pt$", n):
                raise CheckpointError(f"{self.path / n}: tensor/model-parallel checkpoints (mp_rank > 0) "
                                      "are not supported")
        if (self.path / "offloaded_tensors").exists():
            raise CheckpointError(f"{self.path}: checkpoints with NVMe-offloaded optimizer state "
                                  "(offloaded_tensors/) are not supported")

    def _world_hint(self, names: list[str]) -> str:
        """How many ranks wrote the checkpoint, as far as the files that are there tell."""
        for n in sorted(names):
            try:
                if _OPTIM_RE.match(n):
                    counts = self._optim_dict(self.path / n).get("partition_count")
                    counts = counts if isinstance(counts, list) else [counts]
                    return f"{max(counts)} ranks"
                if _STAGE3_MODEL_RE.match(n):
                    return f"{self._load(self.path / n)['dp_world_size']} ranks"
            except (CheckpointError, KeyError, TypeError, ValueError):
                continue
        return "an unknown number of ranks"

    def _check_parallelism(self, model: dict, file: Path) -> None:
        mp = model.get("mp_world_size", 1)
        dims = model.get("checkpoint_parallel_dimensions") or {}
        degrees = {"model parallel": mp, "tensor parallel": dims.get("tp_degree", 1),
                   "pipeline parallel": dims.get("pp_degree", 1)}
        for what, degree in degrees.items():
            if isinstance(degree, int) and degree > 1:
                raise CheckpointError(f"{file}: written with {what} degree {degree}; only pure data-parallel "
                                      "ZeRO checkpoints are supported")

    def _check_rank_files(self, names: list[str], optim_ranks: dict[int, str]) -> None:
        ws = self.world_size
        for r in range(ws):
            f = self._optim_file(r)
            if not f.is_file():
                raise CheckpointError(f"{f} is missing: the checkpoint was written by {ws} ranks and every "
                                      "rank's optimizer file is needed")
            if self._stage3_files:
                f = self.path / STAGE3_MODEL_FILE.format(rank=r)
                if not f.is_file():
                    raise CheckpointError(f"{f} is missing: the checkpoint was written by {ws} ranks and every "
                                          "rank's model states file is needed at ZeRO stage 3")
        beyond = sorted(r for r, n in optim_ranks.items() if r >= ws and n.startswith(self._optim_prefix))
        if beyond:
            raise CheckpointError(f"{self.path} holds optimizer files of ranks {beyond}, but the checkpoint was "
                                  f"written by {ws} ranks: files left from another checkpoint are mixed in")

    def _find_compute_dtype(self, names: list[str]) -> str:
        cfg = self._ds_config
        if _enabled(cfg, "bf16", "bfloat16"):
            return "bf16"
        if _enabled(cfg, "fp16"):
            return "fp16"
        if cfg:
            return "fp32"
        if any(n.startswith("bf16_zero_pp_rank_") for n in names):
            return "bf16"
        module = self._model0.get("module") or {}
        dtypes = {v.dtype for v in module.values() if isinstance(v, torch.Tensor) and v.is_floating_point()}
        return "fp16" if torch.float16 in dtypes else "fp32"

"""Where every parameter's elements lie in a DeepSpeed checkpoint: in which rank's flat
partition, at which offset. :class:`_DeepSpeedLayout` is the part of
:class:`~zerodp.checkpoint.deepspeed.DeepSpeedSource` that works it out from rank 0's files
and checks every other rank's against it.

Stages 1 and 2 (``single_partition_of_fp32_groups``): per param group, the trainable
parameters are concatenated in ``param_shapes`` order (with ``param_alignment_paddings``
after each) and padded to a multiple of ``2 * world_size``; rank R owns the slice
``[R * P, (R + 1) * P)`` of that flat vector. The ZeRO optimizer saves it without the
trailing padding (``group_paddings`` says how much, so ``P`` is rank 0's length plus its
padding); DeepSpeed's ``BF16_Optimizer`` (bf16 with fp32 gradient accumulation at stage 1,
recognisable by the missing ``zero_stage`` key) saves full slices. The base optimizer's state
tensors (``base_optimizer_state``: a torch ``state_dict`` with one flat parameter per group,
or with ``elastic_checkpoint`` a list of per-group state dicts) are laid out like the slice.

Stage 3 (``fp32_flat_groups``): every parameter is partitioned on its own into
``ceil(numel / world_size)`` elements per rank (the last rank's part padded), and each rank
concatenates its parts of the parameters of a sub group (``param_shapes`` has one map per sub
group). The base optimizer holds one flat tensor per sub group; its param groups list the
sub groups they own. Frozen parameters are partitioned the same way, one fragment per rank
in that rank's model states file.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .source import CheckpointError


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


@dataclass(frozen=True)
class _Piece:
    """Elements ``[elem, elem + length)`` of a parameter stored at ``[local, local + length)``
    of a flat tensor: flat group ``where`` of rank ``rank``'s optimizer file (trainable), or
    the frozen fragment of that parameter in rank ``rank``'s model states (``where`` None)."""

    rank: int
    where: Optional[int]
    local: int
    elem: int
    length: int


class _DeepSpeedLayout:
    """The pieces of every parameter (``_pieces``), its param group, flat group and shape, and
    the partition sizes each rank's file must hold (``_expected_len``). Uses ``path``,
    ``world_size``, ``zero_stage`` and ``_padded_partitions`` as :class:`DeepSpeedSource` sets
    them."""

    def _layout_stage12(self, param_shapes: list, opt0: dict, rank0: Path) -> None:
        flats = opt0.get("single_partition_of_fp32_groups")
        if not isinstance(flats, list) or len(flats) != len(param_shapes):
            raise CheckpointError(f"{rank0}: single_partition_of_fp32_groups does not match the "
                                  f"{len(param_shapes)} param groups of param_shapes")
        paddings = opt0.get("group_paddings") or [0] * len(flats)
        align = opt0.get("param_alignment_paddings")
        ws = self.world_size
        for g, shapes in enumerate(param_shapes):
            part = flats[g].numel() + (0 if self._padded_partitions else int(paddings[g]))
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = _numel(shape)
                pieces = []
                for r in (range(offset // part, (offset + n - 1) // part + 1) if n else ()):
                    lo, hi = max(offset, r * part), min(offset + n, (r + 1) * part)
                    pieces.append(_Piece(r, g, lo - r * part, lo - offset, hi - lo))
                self._add_trainable(str(name), pieces, g, g, tuple(int(s) for s in shape))
                offset += n + (int(align[g][i]) if align else 0)
            if part * ws < offset:
                raise CheckpointError(f"{rank0}: param group {g} holds {offset} elements but {ws} partitions "
                                      f"of {part}: a stage-{self.zero_stage} layout this reader does not know")
            if self._padded_partitions:
                self._expected_len.append([part] * ws)
            else:
                self._expected_len.append([min(part, max(0, offset - r * part)) for r in range(ws)])

    def _layout_stage3(self, param_shapes: list, opt0: dict, rank0: Path) -> None:
        flats = opt0.get("fp32_flat_groups")
        base = opt0.get("optimizer_state_dict")
        if not isinstance(flats, list) or len(flats) != len(param_shapes) or not isinstance(base, dict):
            raise CheckpointError(f"{rank0}: fp32_flat_groups does not match the {len(param_shapes)} sub "
                                  "groups of param_shapes")
        owner: dict[int, int] = {}
        for g, group in enumerate(base.get("param_groups", [])):
            for idx in group.get("params", []):
                owner[int(idx)] = g
        if sorted(owner) != list(range(len(flats))):
            raise CheckpointError(f"{rank0}: the optimizer's param groups own sub groups {sorted(owner)}, "
                                  f"not the {len(flats)} sub groups saved; a layout this reader does not know")
        ws = self.world_size
        for s, shapes in enumerate(param_shapes):
            local = 0
            for name, shape in shapes.items():
                n = _numel(shape)
                part = math.ceil(n / ws)
                pieces = [_Piece(r, s, local, r * part, min(part, n - r * part))
                          for r in range(ws) if n - r * part > 0]
                self._add_trainable(str(name), pieces, owner[s], s, tuple(int(x) for x in shape))
                local += part
            self._expected_len.append([local] * ws)

    def _add_trainable(self, name: str, pieces: list[_Piece], group: int, flat: int, shape: tuple) -> None:
        if name in self._pieces:
            raise CheckpointError(f"{self.path}: parameter {name} appears twice in param_shapes")
        self._pieces[name] = pieces
        self._group_of[name] = group
        self._flat_of[name] = flat
        self._shapes[name] = shape

    def _layout_frozen(self, model: dict) -> tuple[dict[str, tuple], dict[str, torch.dtype]]:
        """Shapes and dtypes of the parameters outside the optimizer, and their pieces: at stage 3
        one fragment per rank, below stage 3 the whole tensor (``frozen_param_fragments`` or the
        module state dict) in the rank-0 model states."""
        shapes: dict[str, tuple] = {}
        dtypes: dict[str, torch.dtype] = {}
        frozen = model.get("frozen_param_shapes")
        fragments = model.get("frozen_param_fragments") or {}
        module = model.get("module") or {}
        buffers = set(model.get("buffer_names") or ())
        aliases = set((model.get("shared_params") or {}).keys())
        if frozen is None and self.zero_stage < 3:
            frozen = {n: t.shape for n, t in module.items() if isinstance(t, torch.Tensor)
                      and n not in buffers and n not in aliases and n not in self._pieces}
        for name, shape in (frozen or {}).items():
            name, shape = str(name), tuple(int(s) for s in shape)
            n = _numel(shape)
            stored = fragments.get(name, module.get(name))
            if n and not isinstance(stored, torch.Tensor):
                raise CheckpointError(f"{self._model_file(0)}: frozen parameter {name} has no stored value")
            shapes[name] = shape
            dtypes[name] = stored.dtype if isinstance(stored, torch.Tensor) else torch.float32
            if self.zero_stage == 3:
                part = math.ceil(n / self.world_size)
                self._pieces[name] = [_Piece(r, None, 0, r * part, min(part, n - r * part))
                                      for r in range(self.world_size) if n - r * part > 0]
            else:
                self._pieces[name] = [_Piece(0, None, 0, 0, n)] if n else []
        return shapes, dtypes

    def _check_rank_layout(self, rank: int, opt: dict, path: Path) -> None:
        """A rank's file must hold the partition sizes its rank 0 layout implies."""
        key = "fp32_flat_groups" if self.zero_stage == 3 else "single_partition_of_fp32_groups"
        flats = opt.get(key)
        want = [lens[rank] for lens in self._expected_len]
        got = [t.numel() for t in flats] if isinstance(flats, list) else None
        if got != want:
            raise CheckpointError(f"{path}: {key} holds partitions of {got} elements where the layout of the "
                                  f"checkpoint (rank 0, param_shapes, {self.world_size} ranks) implies {want}")
        counts = opt.get("partition_count")
        counts = counts if isinstance(counts, list) else [counts]
        if any(c != self.world_size for c in counts):
            raise CheckpointError(f"{path}: partition_count {opt.get('partition_count')} differs from rank 0's "
                                  f"{self.world_size}")

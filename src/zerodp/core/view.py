"""What a checkpoint reads and writes of an engine: ``CheckpointView``.

``checkpoint/`` (save, load, consolidate, the layout) sees an engine only through this view,
so everything a checkpoint depends on is declared here, one member a line, and the engine's
other attributes can change without breaking checkpoints. ``engine.checkpoint_view()`` gives
one. It is a window onto the live engine, not a copy: a counter read through it is the
engine's counter now, and the few writes a load makes go through its methods
(:meth:`CheckpointView.restore_step_counters`, :meth:`~CheckpointView.release_units`,
:meth:`~CheckpointView.zero_grad`); tensors, optimizer state, the scheduler, the loss scale
and the data position are changed through the objects the view hands out.

RNG states are not here: they belong to the process (Python's, NumPy's and torch's global
generators), and ``checkpoint/state.py`` captures and restores them directly.

This module does not import the engine (``engine/engine.py``, ``engine/engine_api.py``): the
engine imports ``checkpoint/`` to save and load, and ``checkpoint/`` imports this view.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from .layout import Layout
from .optim_shard import HostOptimizer
from .packed import packed_states, restore_packed_states

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .axes import ShardAxes
    from .collectives import Comm
    from .flat import FlatGroup
    from .precision import LossScaler, PrecisionPolicy


@dataclass(frozen=True)
class ExpertRanks:
    """This rank among expert-parallel ranks (``CheckpointView.experts``): rank ``ep_rank`` of an
    expert-parallel group of ``ep_size`` consecutive ranks, rank ``edp_rank`` of the ``edp_size``
    ranks holding the same experts (the shard axis of expert parameters); ``names_on(t)`` maps this
    rank's expert parameter names to the names the same places have on expert-parallel rank ``t``
    in the model without expert parallelism (its own ones for ``t = ep_rank``); ``comm`` gathers over
    the expert-parallel group."""

    ep_size: int
    ep_rank: int
    edp_rank: int
    edp_size: int
    names_on: "Callable[[int], dict[str, str]]"
    comm: "Comm"

    def file_rank(self, edp_rank: int, ep_rank: int) -> int:
        """The rank (and checkpoint file) of expert-data rank ``edp_rank`` in expert-parallel rank ``ep_rank``."""
        return edp_rank * self.ep_size + ep_rank


@dataclass(frozen=True)
class CheckpointRanks:
    """Where this rank stands among the ranks that save and load a checkpoint (``CheckpointView.ranks``).

    ``dp_rank`` of ``dp_world_size`` data-parallel ranks, ``tp_rank`` of ``tp_size`` tensor-parallel
    ranks (0 of 1 without tensor parallelism), ``pipe_rank`` of ``pipe_size`` pipeline stages (0 of 1
    without a pipeline). ``coord_comm``: every rank that takes part in a save or load (the whole
    process grid; the data-parallel group without other axes), what the checkpoint's coordinator
    agrees over; ``tensor_comm`` gathers a split parameter's slices; ``pipe_comm`` brings the
    stages' parts of the index to rank 0."""

    dp_rank: int
    dp_world_size: int
    tp_rank: int
    tp_size: int
    pipe_rank: int
    pipe_size: int
    coord_comm: "Comm"
    tensor_comm: "Comm"
    pipe_comm: "Comm"

    @property
    def stage_first(self) -> bool:
        """Whether this rank is its pipeline stage's first (data rank 0, tensor rank 0; rank 0 without
        a pipeline): it writes the stage's unsplit tensors and puts the stage's parts together."""
        return self.dp_rank == 0 and self.tp_rank == 0

    @property
    def files_layout(self) -> Layout:
        """How a checkpoint of this engine numbers its files: one per rank of the layout pipeline
        stages x data ranks x tensor ranks (``core/layout.py``), the grid's own order."""
        return Layout.of(pipe=self.pipe_size, shard=self.dp_world_size, tensor=self.tp_size)

    @property
    def writer_rank(self) -> int:
        """Which of the checkpoint's files this rank writes: its rank in :attr:`files_layout`."""
        return self.files_layout.rank_of({"pipe": self.pipe_rank, "shard": self.dp_rank, "tensor": self.tp_rank})

    @property
    def writer_count(self) -> int:
        """How many files a checkpoint of this engine has: pipeline stages x data ranks x tensor ranks."""
        return self.files_layout.world


class CheckpointView:
    """What ``checkpoint/`` may read and write of one engine (see module docstring).

    ``engine`` is a ``ZeroEngine``; only its public members are read.
    """

    __slots__ = ("_engine", "_ranks")

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._ranks: Optional[CheckpointRanks] = None

    # -- the model and its training state --------------------------------------------------

    @property
    def module(self) -> "nn.Module":
        """The model as built (inside a ``torch.compile`` wrapper): parameter and buffer names."""
        return self._engine.base_module

    @property
    def flat_groups(self) -> "list[FlatGroup]":
        """Every flat group, in order: parameters, their shards and pieces, fp32 masters."""
        return self._engine.flat_groups

    @property
    def optimizer(self) -> "torch.optim.Optimizer":
        """The optimizer over this rank's pieces (the ``optim.leaves`` of the trainable groups)."""
        return self._engine.optimizer

    @property
    def lr_scheduler(self) -> Optional[Any]:
        """The learning-rate scheduler (a torch ``LRScheduler``), or None."""
        return self._engine.lr_scheduler

    @property
    def loss_scaler(self) -> "Optional[LossScaler]":
        """The fp16 loss scaler, or None without fp16."""
        return self._engine.loss_scaler

    @property
    def offload(self) -> "Optional[HostOptimizer]":
        """The optimizer offload (masters and states on the host or on disk), or None."""
        return self._engine.offload

    @property
    def training_dataloader(self) -> Optional[Any]:
        """The training data loader whose position checkpoints keep (``state_dict``), or None."""
        return self._engine.training_dataloader

    # -- how the state is laid out ---------------------------------------------------------

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage, 0 to 3."""
        return self._engine.zero_stage

    @property
    def precision(self) -> "PrecisionPolicy":
        """The precision policy: which groups keep fp32 masters (``keeps_master(dtype)``)."""
        return self._engine.precision

    @property
    def compute_dtype(self) -> str:
        """The training dtype as the config names it: ``"fp32"``, ``"bf16"`` or ``"fp16"``."""
        return self._engine.config.compute_dtype

    @property
    def device(self) -> "torch.device":
        """The device the engine's tensors live on."""
        return self._engine.device

    # -- where this rank stands -----------------------------------------------------------

    @property
    def shard_axes(self) -> "ShardAxes":
        """The collectives of the axes the flat groups shard over (each group's ``axis``, ``axes.py``)."""
        return self._engine.shard_axes

    @property
    def experts(self) -> "Optional[ExpertRanks]":
        """Where this rank stands among expert-parallel ranks, or None without expert parallelism."""
        handle = next((p for p in self._engine.parallelisms if p.name == "expert"), None)
        if handle is None:
            return None
        axes, module = handle.axes, self.module
        return ExpertRanks(axes.size, axes.expert.rank, axes.expert_data.rank, axes.expert_data.size,
                           lambda ep_rank: handle.names_on(module, ep_rank), handle.expert_comm)

    @property
    def ranks(self) -> "CheckpointRanks":
        """This rank among the ranks that save and load a checkpoint, and their collectives (made
        once per view: the grid does not change in an engine's life)."""
        if self._ranks is None:
            self._ranks = self._make_ranks()
        return self._ranks

    def _make_ranks(self) -> "CheckpointRanks":
        engine = self._engine
        grid = engine.grid
        return CheckpointRanks(
            dp_rank=grid.data.rank, dp_world_size=grid.data.size,  # ZeRO's ranks (sequence ranks included)
            tp_rank=grid.tensor.rank, tp_size=grid.tensor.size, pipe_rank=grid.pipe.rank, pipe_size=grid.pipe.size,
            coord_comm=engine.comm if grid.only_data else engine.grid_comm,
            tensor_comm=grid.tensor.comm(), pipe_comm=grid.pipe.comm())

    # -- counters and batch sizes ----------------------------------------------------------

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (skipped fp16 steps included)."""
        return self._engine.global_steps

    @property
    def micro_steps(self) -> int:
        """Micro-batches stepped."""
        return self._engine.micro_steps

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed."""
        return self._engine.skipped_steps

    def restore_step_counters(self, global_steps: int, micro_steps: int, skipped_steps: int) -> None:
        """Set the three counters above (a load, from the checkpoint's)."""
        engine = self._engine
        engine.global_steps = global_steps
        engine.micro_steps = micro_steps
        engine.skipped_steps = skipped_steps

    @property
    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self._engine.train_batch_size()

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch on one rank."""
        return self._engine.train_micro_batch_size_per_gpu()

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self._engine.gradient_accumulation_steps()

    # -- packed 4-bit weights: the quantization state beside the codes ---------------------

    def packed_states(self) -> "dict[str, dict[str, torch.Tensor]]":
        """Each packed 4-bit parameter's quantization state, by parameter name: the tensors
        ``state_dict()`` writes beside the weight, by their state-dict names (``core/packed.py``)."""
        return packed_states(self._engine.base_module)

    def restore_packed_states(self, tensors: "dict[str, torch.Tensor]") -> list:
        """Give the packed parameters the quantization state in ``tensors`` (a load); returns
        the names of the parameters restored."""
        return restore_packed_states(self._engine.base_module, tensors)

    # -- what a load does to the engine besides filling tensors ----------------------------

    def release_units(self) -> None:
        """Stage 3: release every gathered unit, so a load writes into the shards alone (and drop
        hpZ's secondary copies, which the loaded values make stale)."""
        if self._engine.sharded is not None:
            self._engine.sharded.release_all()
        for g in self._engine.flat_groups:
            g.drop_secondary()

    def zero_grad(self) -> None:
        """Clear every gradient (after a load, none belongs to the loaded state)."""
        self._engine.zero_grad()

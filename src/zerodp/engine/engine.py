"""The training-loop verbs: forward, backward, step — one engine for every ZeRO stage.

A gradient's journey (stage policy in ``stages.py``, reduction in ``reduce.py``, collectives
in ``collectives.py``):

1. ``backward(loss)`` scales the loss by 1/gradient_accumulation_steps, tells the
   ``GradReducer`` whether this backward reduces (every one at stages 2-3, the accumulation
   boundary's at stages 0-1, never inside ``no_sync()``) and runs autograd.
2. As autograd finishes each parameter, its post-accumulate-grad hook hands the gradient to
   the reducer (``GradReducer.on_grad``), which moves it into its flat group's gradient
   buffer: at stages 0-1 ``p.grad`` already *is* a view of the group's full gradient buffer;
   at stages 2-3 it is copied into a temporary bucket buffer and dropped.
3. In a backward that reduces, a group whose parameters all have gradients is *ready* (at
   stage 3: a group whose unit backward has gone through, ``GradReducer.on_unit_done``);
   ready groups are launched in group order (the same order on every rank) — all-reduce at
   stage 0, reduce-scatter at stages 1-3 — asynchronously when ``overlap_comm`` is on, so
   communication runs while backward goes on.
4. When autograd returns, ``GradReducer.finish`` launches the groups that never became ready
   (parameters unused in this step) and awaits all handles; at stages 2-3 each reduced
   bucket's shard is added into the persistent gradient shard and the bucket freed.
5. ``step()`` at the boundary divides by the data-parallel size (and the fp16 loss scale),
   all-reduces (one small vector) the squared gradient norm and which parameters got a
   gradient on any rank, skips the step on every rank if fp16 gradients overflowed on any,
   clips, runs the optimizer on this rank's pieces, writes fp32 masters back into 16-bit
   parameters, and all-gathers the updated shards (stages 1-2).

Under mixed precision (``precision.py``) gradients are 16-bit in steps 1-4 (or fp32 with
``data_types.grad_accum_dtype``), reduced in ``communication_data_type``, and turned into
fp32 copies of this rank's shard only in step 5. With ``offload_optimizer`` (``offload/``) the
norm is taken on the device as is, and the rest of step 5 (divide, clip, update, write back)
walks the shard tile by tile on the host.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from collections import defaultdict
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import health
from ..config import Config, ConfigError, resolve_batch_sizes
from ..core import live
from ..core.access import released_parameters_named
from ..core.adapters import lora_initializer
from ..core.assemble import (
    adopt_replaced_params,
    broadcast_initial_state,
    build_flat_groups,
    build_lr_scheduler,
    build_optimizer,
    optimizer_param_groups,
    user_param_groups,
)
from ..core.axes import DATA, ShardAxes
from ..core.backward import Backward
from ..core.collectives import SCRATCH, CommCounter
from ..core.device import default_device, select, synchronize
from ..core.gather import Unit, plan_units, register_params
from ..core.init_shards import has_no_values, init_shard, prepare_for_sharding
from ..core.leaves import apply_leaf_config
from ..core.norm import global_norm_and_usage
from ..core.optim_shard import OptimizerShard, needs_whole_matrices
from ..core.packed import held_whole_by_bitsandbytes
from ..core.plain_loop import PlainLoop
from ..core.precision import LossScaler, PrecisionPolicy
from ..core.reduce import GradReducer
from ..core.sharded import ShardedParams
from ..core.stages import StagePolicy, policy_for
from ..offload import OptimizerOffload, ParamOffload, group_cap
from ..offload.activations import ActivationOffload
from ..parallel import Parallelism, parallelisms_for, replaced_parameters
from ..parallel import base as parallel
from ..parallel.grid import Grid, build_grid
from .checkpoint_api import CheckpointAPI
from .engine_api import EngineAPI

logger = logging.getLogger("zerodp")

def _grad_hook(engine: "ZeroEngine", t: int, i: int) -> Callable[[nn.Parameter], None]:
    """The post-accumulate-grad hook of parameter ``i`` of trainable group ``t``. It holds
    the engine weakly, so a model outliving its engine does not keep the engine alive."""
    ref = weakref.ref(engine)

    def hook(param: nn.Parameter) -> None:
        live = ref()
        if live is not None:
            live._backward.on_grad(t, i, param)
    return hook


def _unit_done_hook(engine: "ZeroEngine") -> Callable[[Unit], None]:
    """Called by ``ShardedParams`` once backward has gone through a unit and it released the unit:
    the engine's backward reduces its gradients (holds the engine weakly)."""
    ref = weakref.ref(engine)

    def done(unit: Unit) -> None:
        live = ref()
        if live is not None:
            live._backward.on_unit_done(unit)
    return done


class ZeroEngine(EngineAPI, CheckpointAPI, nn.Module):
    """Wraps a model for ZeRO data-parallel training (see ``zerodp.initialize``)."""

    def __init__(self, model: nn.Module, config: Config, *, model_parameters=None,
                 optimizer=None, lr_scheduler=None,
                 process_group: Optional[dist.ProcessGroup] = None,
                 unit_classes: Iterable[type] = (),
                 param_init_fn: Optional[Callable[[nn.Module], None]] = None,
                 grid: Optional[Grid] = None, separate_params: Iterable[nn.Parameter] = (),
                 counted_elsewhere: Iterable[nn.Parameter] = ()) -> None:
        super().__init__()
        self.config = config
        # the process grid (parallel/grid.py): ZeRO shards over its shard axis (the data-parallel
        # group, or a slice of it with hybrid sharding); gradients average over its data axis
        self.grid = grid if grid is not None else build_grid(data_group=process_group)
        counter = CommCounter()  # every group's bytes, for comm_stats()
        self.comm = self.grid.shard.comm(counter, "data")
        self.replica_comm = self.grid.replica.comm(counter)
        self.grid_comm = self.grid.everyone.comm(counter, "grid")
        self.data_comm = self.grid.data.comm(counter)  # this pipeline stage's data-parallel ranks
        # the parallelisms beside ZeRO (parallel/base.py): tensor parallelism when the grid has a tensor axis
        self.parallelisms: list[Parallelism] = parallelisms_for(self.grid, model, counter)
        # what each flat group shards and reduces over (core/axes.py): the data axis, and a parallelism's own
        self.shard_axes = ShardAxes({DATA: self.comm, **{n: c for p in self.parallelisms
                                                         for n, c in p.shard_axes().items()}})
        self.health = health.Monitor(config.comms_timeout_s)  # a rank that stops answering is named
        for c in (self.replica_comm, self.grid_comm, self.data_comm,
                  *(self.shard_axes.comm(n) for n in self.shard_axes.names)):
            c.watched = self.health.on and c.backend == "gloo"
        # batch ranks: the ranks of a sequence-parallel group run one batch (parallel/sequence.py)
        self.dp_world_size, self.dp_rank = self.grid.dp_size, self.grid.dp_rank
        # the ranks whose gradients one update averages (DeepSpeed's name): data x sequence
        self.seq_dp_world_size = self.grid.data.size
        self.policy: StagePolicy = policy_for(config.zero_optimization.stage)
        self.zero_config = config.zero_optimization
        self.overlap_comm = config.zero_optimization.overlap_comm_effective
        (self._train_batch_size, self._micro_batch_size,
         self._gas) = resolve_batch_sizes(config, self.dp_world_size, self.grid.deepspeed_batch_ranks)
        self.device = default_device()
        select(self.device)
        self.precision = PrecisionPolicy.from_config(config)
        self.precision.cast_model(model)
        # activation_checkpointing.cpu_checkpointing: checkpointed layers' inputs wait in host memory
        self.activation_offload: Optional[ActivationOffload] = (
            ActivationOffload() if config.activation_checkpointing.cpu_checkpointing else None)
        self.loss_scaler: Optional[LossScaler] = (LossScaler.from_config(config.fp16)
                                                  if config.fp16.enabled else None)
        self._skipped_steps = 0
        # parameters built in zero.Init keep slices of their values; at stages 0-2 they get them back
        prepare_for_sharding(model, self.comm, self.policy.shard_parameters)
        meta = any(has_no_values(p) for p in model.parameters())
        if meta and not self.policy.shard_parameters:
            raise ValueError("the model has parameters on the meta device; stages 0-2 keep full "
                             "parameters on every rank, so materialize the model first, or use "
                             "stage 3, which initializes each unit's shards directly")
        if meta:
            if any(b.is_meta for b in model.buffers()):
                raise ValueError("the model has buffers on the meta device; build buffers with real "
                                 "values (only parameters may be on the meta device)")
            for mod in model.modules():
                for name, buf in mod._buffers.items():
                    if buf is not None:
                        mod._buffers[name] = buf.to(self.device)
            self.module = model
        else:
            self.module = model.to(self.device)

        # a model compiled with torch.compile runs compiled; names and units come from the model inside
        self.base_module: nn.Module = getattr(self.module, "_orig_mod", self.module)
        built_in_init = {id(p): p for p in self.base_module.parameters() if init_shard(p) is not None}
        groups = user_param_groups(self.base_module, model_parameters, optimizer,
                                   replaced_parameters(self.base_module))
        groups = optimizer_param_groups(config, self.base_module, groups, optimizer, report=self.comm.rank == 0)
        if self.policy.shard_parameters:  # the config's leaf modules, each one unit (core/leaves.py)
            apply_leaf_config(self.base_module, self.zero_config.leaf_module,
                              self.zero_config.stage3_module_granularity_threshold)
        unit_plan, self._unit_of = ([("", self.base_module)], {}) if not self.policy.shard_parameters \
            else plan_units(self.base_module, self.zero_config.stage3_param_persistence_threshold,
                            tuple(unit_classes))
        sharding = self.policy.shard_optimizer  # partitions: 1/N of each group per rank, or all of it
        self.flat_groups = build_flat_groups(
            self.base_module, groups, self._unit_of, group_cap(self.zero_config, self.comm.world_size),
            axes=self.shard_axes, sharding=sharding, device=self.device,
            tp_of=parallel.placement(self.parallelisms, self.base_module),
            axis_of=parallel.shard_axis_of(self.parallelisms, self.base_module),
            separate={id(p): f"separate{i}" for i, p in enumerate(separate_params)},
            counted_elsewhere=frozenset(id(p) for p in counted_elsewhere))  # norm and checkpoint: another rank's
        adopt_replaced_params(self.base_module, self.flat_groups)
        self.trainable = [g for g in self.flat_groups if g.trainable]
        broadcast_initial_state(self.data_comm, self.base_module, self.flat_groups, self.shard_axes)
        self.sharded: Optional[ShardedParams] = None  # stage 3: the units, their gathers and hooks
        self.param_offload: Optional[ParamOffload] = None
        if self.policy.shard_parameters:
            if meta and param_init_fn is None and callable(getattr(model, "_init_weights", None)):
                param_init_fn = model._init_weights  # a transformers model's own initialization
            replaced = {old: new for g in self.flat_groups for old, new in g.replaced.items()}
            loaded = {id(replaced[i]): p for i, p in built_in_init.items() if i in replaced}
            self._setup_units(unit_plan, meta, param_init_fn, loaded)
            # stage 3: every gather and reduction (the units', the reducer's, GatheredParameters',
            # a checkpoint's) takes turns for the stage-3 object's one scratch buffer
            self.shard_axes = self.sharded.axes
        register_params(self.flat_groups, self.shard_axes, sharded=self.policy.shard_parameters,
                        agreement=self.sharded.agreement if self.sharded is not None else None)
        for g in self.trainable:
            g.grads.allocate(keep_full=self.policy.full_gradient_buffer,
                             dtype=self.precision.grad_dtype(g.dtype))
        self.reducer = GradReducer(self.shard_axes, self.trainable, self.policy, self.precision,
                                   reduce_scatter=self.zero_config.reduce_scatter,
                                   overlap_comm=self.overlap_comm, replicas=self.replica_comm)

        # offload: fp32 masters and optimizer states on the host or disk, the step there (offload/)
        self.offload: Optional[OptimizerOffload] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None  # none: forward and evaluation only
        if optimizer is not None or config.optimizer is not None:
            self._build_optimizer(groups, optimizer)
        elif config.scheduler is not None or lr_scheduler is not None:
            raise ConfigError("scheduler: a learning-rate scheduler needs an optimizer; add an 'optimizer' "
                              "block to the config or pass optimizer=")
        self._plain = PlainLoop(self)  # before the scheduler, which wraps optimizer.step
        self._in_no_sync = False
        # a backward pass, the engine's or a plain loss.backward() (core/backward.py)
        me = weakref.ref(self)  # (no cycle through the engine: a model outliving it does not keep it)
        self._backward = Backward(self.reducer, self.sharded, self.policy, lambda: me()._in_no_sync, self._plain)
        live.track(self)  # for zerodp.comm.log_summary() and the teardown at exit
        self.lr_scheduler = build_lr_scheduler(config, self.optimizer, lr_scheduler)

        self._hooks = [p.register_post_accumulate_grad_hook(_grad_hook(self, t, i))
                       for t, g in enumerate(self.trainable) for i, p in enumerate(g.params)]
        self.global_steps = 0
        self.micro_steps = 0
        self._global_grad_norm: Optional[float] = None
        self._reduced_for_boundary = False
        self._timings: dict[str, list[float]] = defaultdict(list)
        self.monitor = None  # the metrics writer, set by zerodp.initialize (monitor.py)
        self.training_dataloader = None  # set by zerodp.initialize(training_data=...)
        self._boundary_override: Optional[bool] = None
        self._step_applied = False
        self._checkpointer = None

    # -- set-up -------------------------------------------------------------------------

    def _build_optimizer(self, groups: list[dict], optimizer) -> None:
        """The optimizer over this rank's pieces: fp32 masters of 16-bit parameters, on the
        device or offloaded (``offload/``)."""
        if self.zero_config.optimizer_offload != "none":
            self.offload = OptimizerOffload(self.zero_config, self.config.aio, self.trainable, self.device,
                                            self.grid.rank)
        pieces_by_group = [[] for _ in groups]
        for g in self.trainable:  # 16-bit parameters: the optimizer updates fp32 masters
            if self.offload is not None:
                pieces = self.offload.make_pieces(g)
            else:
                pieces = OptimizerShard.on_device(g, self.precision.keeps_master(g.dtype)).leaves
            pieces_by_group[g.param_group].extend(pieces)
        self.optimizer = build_optimizer(self.config, groups, pieces_by_group, optimizer)
        if needs_whole_matrices(self.optimizer):  # Muon: which rank orthogonalizes each matrix
            self.optimizer.plan_whole_matrices(self.trainable, self.shard_axes.of, self.device,
                                               self.grid.tensor.comm(self.comm.counter))
            self.comm.counter.declare(*self.optimizer.comm_kinds)
        self.optimizer.overflow = False  # DeepSpeed's flag, set by each update (fp16: the step was skipped)

    def _setup_units(self, unit_plan, meta: bool, param_init_fn, loaded: dict) -> None:
        """Stage 3: keep only shards, make the units and their hooks, and give a model built
        on the meta device its values (``loaded``: the slices of those built in ``zero.Init``,
        by parameter id)."""
        # built over the data-parallel ranks, or over the ranks its group shards over (the slices of split
        # experts: over the ranks holding those experts)
        over = {id(p): self.shard_axes.comm(g.axis).world_size for g in self.flat_groups for p in g.params}
        for pid, p in loaded.items():
            built_over, shards_over = init_shard(p).comm.world_size, over.get(pid, self.comm.world_size)
            if built_over not in (shards_over, self.comm.world_size):
                raise ValueError(f"the model was built in zero.Init over {built_over} ranks, but the engine "
                                 f"shards over {shards_over}; give Init and initialize the same group")
        for g in self.flat_groups:
            if not g.shards_parameters:
                g.shard_parameters()
        whole = held_whole_by_bitsandbytes(self.base_module)  # 8-bit bases: said, not sharded (core/packed.py)
        if whole is not None and self.comm.rank == 0:
            logger.warning(whole)
        zc = self.zero_config
        hpz = self.grid.secondary  # hpZ's secondary copies, gathered within these ranks (core/secondary.py)
        self.sharded = ShardedParams(self.base_module, unit_plan, self.flat_groups, self.shard_axes, zc,
                                     _unit_done_hook(self),
                                     secondary=hpz.comm(self.comm.counter, "secondary") if hpz is not None else None)
        self.param_offload = ParamOffload(zc, self.config.aio, self.device, self.grid.rank) \
            if zc.param_offload != "none" else None  # shards on the host or on disk (offload/params.py)
        park = self.param_offload.park if self.param_offload is not None else None
        if meta:
            self.sharded.initialize_meta(self.config.seed or 0, self.device, param_init_fn,
                                         after_group=park, loaded=loaded,
                                         after_unit=lora_initializer(self.base_module))
        if park is not None:
            for g in self.flat_groups:
                park(g)

    # -- forward / backward -------------------------------------------------------------

    @contextlib.contextmanager
    def _timed(self, name: str):
        """A phase of the step: where this rank is for the hang detection (``health``), and its
        wall time when ``wall_clock_breakdown`` is on."""
        timed = self.config.wall_clock_breakdown
        if timed:
            synchronize(self.device)
            t0 = time.perf_counter()
        with self.health.phase(name):
            yield
        if timed:
            synchronize(self.device)
            self._timings[name].append(time.perf_counter() - t0)

    def forward(self, *args, **kwargs):
        """The model's forward on inputs cast to the compute dtype; at stage 3 the model's own
        hooks gather its units (``ShardedParams``, ``core/sharded.py``), so a direct call of the model
        gathers the same way."""
        with self._timed("forward"):
            args, kwargs = parallel.prepare_inputs(self.parallelisms, args, kwargs)
            args, kwargs = self.precision.cast_inputs((args, kwargs))
            offload = (self.activation_offload.forward(self.module) if self.activation_offload is not None
                       else contextlib.nullcontext())
            eager = self.sharded.eager_while_recording() if self.sharded is not None else contextlib.nullcontext()
            with (released_parameters_named(self.read_watch), parallel.enter_regions(self.parallelisms), offload,
                  eager):
                out = self.module(*args, **kwargs)
            return out  # under loss parallelism the model's own hooks made the loss a plain tensor

    @property
    def read_watch(self):
        """Stage 3: what gathers a parameter read outside its unit's forward and names the parameters
        a failed forward could not reach (``core/access.py``); None below stage 3."""
        return self.sharded.watch if self.sharded is not None else None

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss`` (scaled by 1/gradient_accumulation_steps unless
        ``scale_wrt_gas=False``, and by the loss scale under fp16) and reduce gradients as the
        stage requires; returns ``loss``."""
        boundary = self.is_gradient_accumulation_boundary()
        if self.monitor is not None:
            self.monitor.on_backward(loss)
        scaled = loss / self._gas if self._gas > 1 and scale_wrt_gas else loss
        if self.loss_scaler is not None:  # in fp32, so a 16-bit loss times the scale cannot overflow
            scaled = scaled.float() * self.loss_scaler.scale
        with (self._timed("backward"), released_parameters_named(self.read_watch),
              parallel.enter_regions(self.parallelisms), self._backward.run(boundary) as reducing):
            scaled.backward(retain_graph=retain_graph)
        if reducing and boundary:
            self._reduced_for_boundary = True
        return loss

    @contextlib.contextmanager
    def parameters_held(self):
        """Stage 3: every unit gathered for the duration and released after (a pipeline step keeps
        its stage's parameters gathered through all its micro-batches, sharded at rest); the unit
        hooks' gathering, prefetching and checks stand by meanwhile. Nothing below stage 3."""
        if self.sharded is None:
            yield
            return
        with self.sharded.held():
            yield

    def reduce_accumulated(self) -> None:
        """Reduce, in one reduction, the gradients that backward passes accumulated locally
        (inside ``no_sync()``, or between a plain loop's updates), as the next reducing backward
        would; a pipeline step does this once after its last micro-batch."""
        self._plain.forget_local()
        self.reducer.begin(True)
        self.reducer.finish()
        self._reduced_for_boundary = True

    @property
    def in_no_sync(self) -> bool:
        """Whether backward passes run inside ``no_sync()`` now (they do not communicate)."""
        return self._in_no_sync

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this context do not communicate; gradients accumulate
        locally (at stage 2 in full-size ``p.grad``, which costs full gradient memory for
        the duration) and are reduced by the next backward outside it."""
        previous, self._in_no_sync = self._in_no_sync, True
        try:
            yield
        finally:
            self._in_no_sync = previous

    # -- step ---------------------------------------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` updates the parameters: as set by
        :meth:`set_gradient_accumulation_boundary`, or else every gradient_accumulation_steps-th
        micro-batch."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self._gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: Optional[bool]) -> None:
        """Say whether the coming micro-batch ends an accumulation (its backward reduces the
        gradients and ``step()`` then updates), for a loop that counts micro-batches itself
        (Accelerate calls ``step()`` only at its boundaries); ``None`` returns to counting."""
        self._boundary_override = None if is_boundary is None else bool(is_boundary)

    def step(self) -> None:
        """Count a micro-batch; at an accumulation boundary, update the parameters."""
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            self._step_applied = False
            return
        if not self._reduced_for_boundary:
            raise RuntimeError(
                "step() at a gradient-accumulation boundary, but that micro-batch's gradients were "
                "not reduced: its backward ran inside no_sync() or engine.backward was not called. "
                "Run the boundary micro-batch's backward outside no_sync().")
        self.update_parameters(count_micro_step=True)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """For a plain loop under fp16: ``engine.scale(loss).backward()`` (the loss times the
        current loss scale, in fp32; the loss itself without fp16). See ``plain_loop.py``."""
        return self._plain.scale(loss)

    def update_parameters(self, count_micro_step: bool) -> None:
        """The update and its bookkeeping, on gradients already reduced: called by ``step()`` at
        an accumulation boundary, and by ``optimizer.step()`` in a plain loop (which sets the
        micro-step count to match); scripts call those, not this."""
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer (the config has no 'optimizer' block and none "
                               "was passed to initialize): it runs forward and evaluation, not steps")
        with self._timed("step"):
            self._apply_update()
        self.global_steps += 1
        self.micro_steps = self.micro_steps + 1 if count_micro_step else self.global_steps * self._gas
        self.health.stepped(self.global_steps, self.micro_steps)
        self.comm.counter.close_step()
        self._reduced_for_boundary = False
        if self.monitor is not None:
            self.monitor.on_step(self)
        report = self.config.steps_per_print is not None and self.global_steps % self.config.steps_per_print == 0
        if report and self.comm.rank == 0:
            logger.info("step %d: lr=%s grad_norm=%.4g", self.global_steps,
                        [round(lr, 8) for lr in self.get_lr()], self._global_grad_norm)
            if self._timings:
                logger.info("step %d: mean ms %s", self.global_steps, ", ".join(
                    f"{k} {1e3 * sum(v) / len(v):.1f}" for k, v in self._timings.items()))
        if report:
            self._timings.clear()
        if self.loss_scaler is not None:  # an overflow at the minimum scale, raised once its step is skipped
            self.loss_scaler.raise_deferred()

    def _apply_update(self) -> None:
        if self._checkpointer is not None:  # an asynchronous save may still be copying the states
            self._checkpointer.before_update()
        self.reducer.sum_over_replicas()
        for g in self.trainable:  # stages 0-2: data a module assigned to a parameter joins the buffer
            if g.gathered:
                g.keep_assigned_data()
        divisor = self.seq_dp_world_size * (self.loss_scaler.scale if self.loss_scaler else 1.0)
        if self.offload is None:
            grads = self._unscaled_fp32_grads(divisor)
            norm, used = self._global_norm_and_usage(grads)
        else:  # the gradient shards go to the host as they are; divided there, tile by tile
            norm, used = self._global_norm_and_usage([g.grads.shard for g in self.trainable])
            norm /= divisor
        self._global_grad_norm = norm
        overflow = self.loss_scaler is not None and not math.isfinite(norm)
        self.optimizer.overflow = overflow  # DeepSpeed's flag: Accelerate reads it as "step skipped"
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow, defer=True)  # at the minimum scale: raised by update_parameters
            if overflow:  # every rank saw the same norm: all skip this step together
                self._skipped_steps += 1
                self._step_applied = False
                if self.comm.rank == 0:
                    logger.info("step %d: fp16 gradients overflowed; step skipped, loss scale now %g",
                                self.global_steps + 1, self.loss_scaler.scale)
                self.zero_grad()
                return
        self._step_applied = True
        clip = self.config.gradient_clipping
        coef = min(clip / (norm + 1e-6), 1.0) if clip > 0 else 1.0
        whole = self.optimizer.whole_matrix_update if needs_whole_matrices(self.optimizer) else None
        if self.offload is not None:
            self.offload.step(self.optimizer, used, divisor, coef, before_step=whole)
        else:
            for g, u, grad in zip(self.trainable, used, grads):
                if coef < 1.0:
                    grad.mul_(coef)
                g.optim.attach_grads(u, grad)
                if whole is not None:  # Muon: the gradient shard becomes the update (optim/muon.py)
                    whole(g, grad)
            # the class's step: the instance's is optimizer.step() of plain loops
            type(self.optimizer).step(self.optimizer)
            for g in self.trainable:
                g.optim.write_back()
        self.optimizer._opt_called = True  # what torch's scheduler checks (its wrapper is on the instance's step)
        for g in self.trainable:  # hpZ: the secondary copies of what changed are stale
            g.drop_secondary()
        if self.policy.gather_after_step:
            handles = [self.shard_axes.of(g).all_gather(g.full, async_op=True) for g in self.trainable]
            for h in handles:
                h.wait()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.zero_grad()

    def _unscaled_fp32_grads(self, divisor: float) -> list[torch.Tensor]:
        """Each group's reduced gradient shard divided by ``divisor`` (the data-parallel size
        times the loss scale): in place when the optimizer updates the parameter shard itself,
        else as an fp32 copy for the fp32 master (freed after the step)."""
        grads = []
        for g in self.trainable:
            grad = g.grads.shard
            if g.optim.master is not None and grad.dtype != torch.float32:
                grad = grad.to(torch.float32)
            if divisor != 1.0:
                grad.mul_(1.0 / divisor)
            grads.append(grad)
        return grads

    def _global_norm_and_usage(self, grads: list[torch.Tensor]) -> tuple[float, list[list[bool]]]:
        """The global gradient norm and which parameters got a gradient on any rank (``norm.py``)."""
        return global_norm_and_usage(grads, self.trainable, self.reducer.usage(), self.grid,
                                     whole_on_every_rank=not self.policy.shard_optimizer, axes=self.shard_axes,
                                     data_comm=self.data_comm, grid_comm=self.grid_comm, device=self.device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear all gradients (``step()`` does this itself after every update): ``.grad`` None, or with
        ``set_to_none=False`` at stages 0-1 zeros (views of the zeroed gradient buffer)."""
        for g in self.trainable:
            g.grads.zero(keep_views=not set_to_none)
            g.optim.clear_grads()
        self.reducer.clear_usage()

    def destroy(self) -> None:
        """Wait for an asynchronous save in flight, remove the gradient hooks and close the
        metrics files (the model stays usable as a plain module)."""
        self.health.close()
        if self._checkpointer is not None:
            self._checkpointer.release_staging()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.sharded is not None:
            self.sharded.remove_hooks()
        if self.monitor is not None:
            self.monitor.close()
        if self.offload is not None:
            self.offload.close()
        if self.param_offload is not None:
            self.param_offload.close()
        for p in self.parallelisms:
            p.close()
        SCRATCH.release()  # gloo's all-to-all buffers not in use

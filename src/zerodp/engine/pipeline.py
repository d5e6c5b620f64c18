"""Pipeline parallelism with ZeRO at every stage: DeepSpeed's pipeline engine on torch's schedules.

A :class:`~zerodp.pipe.PipelineModule` builds on each rank only its pipeline stage's layers; the
:class:`PipelineEngine` is a ``ZeroEngine`` over them (ZeRO over the data-parallel ranks of the
stage, with tensor parallelism inside if the grid has it) that runs a step with one of
``torch.distributed.pipelining``'s schedules:

* ``train_batch(data_iter)`` takes ``gradient_accumulation_steps`` micro-batches (``(inputs,
  labels)`` items; the first stage reads the inputs, the last the labels), runs them through the
  schedule (``"GPipe"``, ``"1F1B"`` or ``"Interleaved1F1B"``, the config's ``pipeline.schedule``)
  inside ``no_sync()`` so the gradients accumulate locally, then reduces them once over the
  data-parallel ranks (stage 2 has no per-micro-batch reduce-scatter; stage 3 keeps its stage's
  parameters gathered through the step and sharded at rest), sums the gradients of weights tied
  across stages over their stages, and takes one optimizer step whose gradient norm is one sum
  over every stage, tensor rank and data shard (a tied weight counted on its first stage);
* ``eval_batch(data_iter)`` runs the forward schedule only.

Each micro-batch's loss is ``loss_fn(outputs, labels) / micro-batches`` (times the fp16 loss scale),
so the gradients are those of the mean loss, as one process's.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Iterable, Iterator, Optional

import torch

from .. import health
from ..parallel.grid import Grid, new_axis
from .engine import ZeroEngine

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


class PipelineEngine(ZeroEngine):
    """A ``ZeroEngine`` over one pipeline stage of a ``PipelineModule`` (see the module docstring)."""

    def __init__(self, model, config, *, grid: Grid, **kwargs: Any) -> None:
        tied = model.tied_parameters()
        first_owner = {name: model.tie_owners(name.split(".", 1)[0])[0] for name, _ in tied}
        ties = _tie_axes(model, tied, grid)
        with torch.no_grad():  # every copy of a tied weight starts from its first stage's values
            for (_, param), axis in zip(tied, ties):
                if axis is not None:
                    axis.comm().broadcast(param.data, src_rank=0)
        super().__init__(model, config, grid=grid, separate_params=[p for _, p in tied],
                         counted_elsewhere=[p for name, p in tied if first_owner[name] != model.stage_id],
                         **kwargs)
        pc = config.pipeline
        self.schedule_name = pc.schedule
        self.stage_id, self.num_stages = model.stage_id, model.num_stages
        if model.virtual_stages > 1 and pc.schedule != "Interleaved1F1B":
            raise ValueError(f"pipeline.schedule: {pc.schedule!r} runs one chunk per stage, but the "
                             f"PipelineModule has virtual_stages={model.virtual_stages}; use "
                             "\"Interleaved1F1B\" or build it with virtual_stages=1")
        if pc.schedule == "Interleaved1F1B" and model.virtual_stages < 2:
            raise ValueError("pipeline.schedule: \"Interleaved1F1B\" needs a PipelineModule built with "
                             "virtual_stages=2 or more (chunks per stage)")
        self.comm.counter.declare("p2p")
        self.pipe_comm = grid.pipe.comm(self.comm.counter, "pipe")
        group_of = {id(p): g for g in self.flat_groups for p in g.params}
        self._ties = [(axis.comm(self.comm.counter, "pipe"),
                       [g] if (g := group_of.get(id(param))) is not None and g.trainable else [])
                      for (_, param), axis in zip(tied, ties) if axis is not None]
        self._count_hooks = [chunk.register_forward_hook(self._p2p_counter(c))
                             for chunk, c in zip(model.chunks, model.chunk_ids)]
        self._stages, self._schedule = self._build_schedule(model)
        self._data_iter: Optional[Iterator] = None
        self.agg_train_loss: Optional[torch.Tensor] = None
        self.activations_peak = 0  # measured in the first train_batch (the schedule's shape repeats)
        self.accumulated_gradients_peak = 0  # the stage's gradients held whole until the step's one reduction

    # -- set-up -----------------------------------------------------------------------------------

    def _build_schedule(self, model):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        if model.num_stages == 1:  # one stage: its micro-batches one after another (no schedule to run)
            return [], _OneStage(model, self._loss, self.gradient_accumulation_steps())
        total = model.num_stages * model.virtual_stages
        stages = [PipelineStage(chunk, c, total, self.device, group=self.grid.pipe.group)
                  for chunk, c in zip(model.chunks, model.chunk_ids)]
        n = self.gradient_accumulation_steps()
        if self.schedule_name == "GPipe":
            return stages, ScheduleGPipe(stages[0], n, loss_fn=self._loss, scale_grads=False)
        if self.schedule_name == "1F1B":
            return stages, Schedule1F1B(stages[0], n, loss_fn=self._loss, scale_grads=False)
        if n % model.num_stages:
            raise ValueError(f"gradient_accumulation_steps: the interleaved schedule needs the micro-batches "
                             f"({n}) to be a multiple of the pipeline stages ({model.num_stages})")
        return stages, ScheduleInterleaved1F1B(stages, n, loss_fn=self._loss, scale_grads=False)

    def _compile_model(self, kwargs: dict) -> None:
        """``engine.compile``: the schedule calls this stage's chunks, not the ``PipelineModule``, so each
        chunk is compiled in place (``nn.Module.compile``)."""
        for chunk in self.module.chunks:
            chunk.compile(**kwargs)

    @property
    def is_compiled(self) -> bool:
        return all(getattr(chunk, "_compiled_call_impl", None) is not None for chunk in self.module.chunks)

    def _loss(self, output, target) -> torch.Tensor:
        """One micro-batch's loss as backward sees it: its share of the mean over the step's
        micro-batches, times the fp16 loss scale (``_loss_factor``)."""
        return self.module.loss_fn(output, target).float() * self._loss_factor

    @property
    def _loss_factor(self) -> float:
        return (self.loss_scaler.scale if self.loss_scaler is not None else 1.0) / self.gradient_accumulation_steps()

    def _p2p_counter(self, chunk_id: int):
        """A forward hook counting the bytes this chunk sends: its output forward (but the last
        chunk's), its input's gradient backward (but the first chunk's)."""
        last = self.num_stages * self.module.virtual_stages - 1
        counter = self.comm.counter

        def nbytes(x) -> int:
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            if isinstance(x, (tuple, list)):
                return sum(nbytes(t) for t in x)
            return 0

        def hook(module, args, output):
            if self.num_stages == 1:
                return
            if chunk_id != last:
                counter.add("p2p", nbytes(output), "pipe")
            if chunk_id != 0 and torch.is_grad_enabled():
                counter.add("p2p", nbytes([a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]),
                            "pipe")
        return hook

    # -- what a script calls ----------------------------------------------------------------------

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    @property
    def bubble_fraction(self) -> float:
        """The share of a step each stage idles in the schedule's fill and drain (GPipe and 1F1B:
        (p - 1) / (m + p - 1); interleaved with v chunks per stage: (p - 1) / (v m + p - 1))."""
        p, m, v = self.num_stages, self.gradient_accumulation_steps(), self.module.virtual_stages
        return (p - 1) / (v * m + p - 1)

    def set_dataiterator(self, iterator: Iterator) -> None:
        """DeepSpeed's: the iterator ``train_batch()`` reads when given none."""
        self._data_iter = iterator

    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches (see the module
        docstring); returns their mean loss on every stage."""
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer: train_batch needs one (eval_batch does not)")
        args, target = self._next_batch(data_iter)
        losses: list[torch.Tensor] = []
        factor = self._loss_factor
        self.module.train()
        measure = _ActivationMeter() if self.global_steps == 0 else contextlib.nullcontext()
        with self.no_sync(), self.parameters_held(), measure, self.health.phase("pipeline"), \
                health.guard("the pipeline's sends and receives", self.grid_comm.global_ranks):
            if self.is_first_stage():
                self._schedule.step(*args, target=target, losses=losses)
            else:
                self._schedule.step(target=target, losses=losses)
        if isinstance(measure, _ActivationMeter):
            self.activations_peak = measure.peak
        self.agg_train_loss = self._mean_loss([loss.detach() / factor for loss in losses])
        if self.monitor is not None:  # the step's row gets its loss
            self.monitor.on_backward(self.agg_train_loss)
        if not self.policy.full_gradient_buffer:  # stages 2-3 (at 0-1 the gradients are the full buffer's views)
            held = sum(p.grad.numel() * p.grad.element_size() for p in self.module.parameters() if p.grad is not None)
            self.accumulated_gradients_peak = max(self.accumulated_gradients_peak, held)
        self.reduce_accumulated()
        self._sum_tied_gradients()
        self.update_parameters(count_micro_step=False)
        return self.agg_train_loss

    def eval_batch(self, data_iter: Optional[Iterator] = None, return_logits: bool = False,
                   compute_loss: bool = True, reduce_output: str = "avg", bcast_loss: bool = True,
                   num_micro_batches: Optional[int] = None):
        """The forward schedule over the micro-batches of one step, without gradients: their mean
        loss on every stage (with ``return_logits``, also the last stage's outputs there)."""
        args, target = self._next_batch(data_iter, num_micro_batches)
        losses: list[torch.Tensor] = []
        factor = self._loss_factor
        self.module.eval()
        try:
            with torch.no_grad(), self.parameters_held():
                if self.is_first_stage():
                    outputs = self._schedule.eval(*args, target=target, losses=losses)
                else:
                    outputs = self._schedule.eval(target=target, losses=losses)
        finally:
            self.module.train()
        loss = self._mean_loss([x / factor for x in losses]) if compute_loss else None
        return (loss, outputs if self.is_last_stage() else None) if return_logits else loss

    def memory_breakdown(self) -> dict[str, int]:
        """The engine's ledger (this stage's model states on this rank), plus ``activations_peak``:
        the most bytes of activations autograd kept at once for the schedule's micro-batches in
        flight, measured in the first ``train_batch`` (0 before it), and
        ``accumulated_gradients_peak``: at stages 2-3, the most bytes of the stage's gradients held
        whole (the micro-batches accumulate them locally and the step reduces them once) beyond the
        gradient shard counted under ``gradients`` (0 at stages 0-1, whose full gradient buffer that is)."""
        out = super().memory_breakdown()
        out["activations_peak"] = int(self.activations_peak)
        out["accumulated_gradients_peak"] = int(self.accumulated_gradients_peak)
        return out

    # -- a step's pieces ----------------------------------------------------------------------------

    def _next_batch(self, data_iter: Optional[Iterator], count: Optional[int] = None):
        """The step's inputs (first stage) and labels (last stage), each micro-batch's stacked."""
        count = count or self.gradient_accumulation_steps()
        if not (self.is_first_stage() or self.is_last_stage()):
            return (), None
        if data_iter is None:
            if self._data_iter is None:
                if self.training_dataloader is None:
                    raise ValueError("train_batch: pass data_iter= (an iterator of (inputs, labels)), or "
                                     "initialize(training_data=...)")
                self._data_iter = _repeating(self.training_dataloader)
            data_iter = self._data_iter
        items = list(itertools.islice(data_iter, count))
        if len(items) < count:
            raise ValueError(f"train_batch: the data iterator ended after {len(items)} of {count} micro-batches")
        inputs = [item[0] for item in items]
        labels = [item[1] for item in items]
        if isinstance(inputs[0], (tuple, list)):
            args = tuple(torch.cat([x[i] for x in inputs]).to(self.device) for i in range(len(inputs[0])))
        else:
            args = (torch.cat(inputs).to(self.device),)
        target = torch.cat(labels).to(self.device) if self.is_last_stage() else None
        return args, target

    def _sum_tied_gradients(self) -> None:
        """Weights tied across stages: add up their gradients (this rank's shard of each) over the
        stages that hold them, so every copy takes the same update."""
        for comm, groups in self._ties:
            for g in groups:
                if g.grads.shard is not None:
                    comm.all_reduce_sum(g.grads.shard)

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the last stage's micro-batch ``losses`` over the data-parallel ranks, on every stage."""
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage() and losses:
            loss = torch.stack([x.float().reshape(()) for x in losses]).mean()
            self.data_comm.all_reduce_sum(loss, kind="control")
            loss /= self.dp_world_size
        if self.num_stages > 1:
            self.pipe_comm.broadcast(loss, src_rank=self.num_stages - 1)
        return loss

    # -- what pipeline mode does not have --------------------------------------------------------------

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline engine runs its stage through train_batch() and eval_batch(), not "
                           "engine(...)")

    def backward(self, *args, **kwargs):
        raise RuntimeError("a pipeline engine's backward runs inside train_batch()")

    def step(self, *args, **kwargs):
        raise RuntimeError("a pipeline engine steps inside train_batch()")

    def destroy(self) -> None:
        for h in self._count_hooks:
            h.remove()
        self._count_hooks = []
        super().destroy()


class _Saved:
    """A tensor autograd saved for backward, as ``_ActivationMeter`` hands it to autograd."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _ActivationMeter:
    """While active, counts the bytes of the tensors autograd saves for backward (activations:
    parameters are not counted; a storage saved twice counts once) and the most alive at once."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage address -> [times saved, bytes]
        self.current = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if (t.is_leaf and t.requires_grad) or type(t) is not torch.Tensor:  # parameters, DTensors
            return t
        key = t.untyped_storage().data_ptr()
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [0, t.untyped_storage().nbytes()]
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        saved = _Saved(t)
        weakref.finalize(saved, self._release, key)
        return saved

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.current -= entry[1]
                del self.live[key]

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __enter__(self) -> "_ActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _OneStage:
    """The schedule of a pipeline of one stage: each micro-batch's forward through every chunk, its
    loss and (``step``) its backward, in turn. The same calls as torch's schedules."""

    def __init__(self, model, loss_fn, micro_batches: int) -> None:
        self.model, self.loss_fn, self.n = model, loss_fn, micro_batches

    def _run(self, args, target, losses: Optional[list], backward: bool):
        outputs = []
        pieces = [a.chunk(self.n) for a in args]
        targets = target.chunk(self.n) if target is not None else [None] * self.n
        for i in range(self.n):
            out = self.model(*(p[i] for p in pieces))
            if target is not None:
                loss = self.loss_fn(out, targets[i])
                if backward:
                    loss.backward()
                if losses is not None:
                    losses.append(loss.detach())
            outputs.append(out)
        return torch.cat(outputs) if isinstance(outputs[0], torch.Tensor) else outputs

    def step(self, *args, target=None, losses: Optional[list] = None):
        return self._run(args, target, losses, backward=True)

    def eval(self, *args, target=None, losses: Optional[list] = None):
        return self._run(args, target, losses, backward=False)


def _tie_axes(model, tied, grid: Grid) -> list:
    """For every tied weight of this stage, the axis of the stages that hold it (at this rank's
    data and tensor coordinates), or None when one stage holds it all. Every rank makes the groups
    of every tied module of the model, in key order, whether its stage holds one or not."""
    stages = grid.layout.groups(["pipe"])  # each: one data x tensor position's rank in every stage
    axes = {}
    for key in model.tie_keys():
        owners = model.tie_owners(key)
        if len(owners) > 1:
            axes[key] = new_axis("tie", [[g[s] for s in owners] for g in stages], grid.rank)
    return [axes.get(name.split(".", 1)[0]) for name, _ in tied]


def _repeating(loader: Iterable) -> Iterator:
    """``loader``'s items forever, epoch after epoch (DeepSpeed's ``RepeatingLoader``)."""
    while True:
        yield from loader

"""What a DeepSpeed script asks of its engine besides forward, backward and step: the queries
(learning rate, gradient norm, batch sizes, ranks, precision, stage) and the measured memory and
traffic. ``ZeroEngine`` inherits them, and the checkpoint verbs (``checkpoint_api.py``);
``engine.py`` keeps the training step.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..core import device
from ..core.collectives import SCRATCH
from ..core.memory import measure_model_states
from ..parallel.base import refuses_compile


class EngineAPI:
    """The query methods of ``ZeroEngine`` (DeepSpeed's names)."""

    def get_global_grad_norm(self) -> Optional[float]:
        """L2 norm over all gradients of the last update, before clipping (None before the first)."""
        return self._global_grad_norm

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without loss scaling)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed (a load sets it)."""
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_steps = value

    def get_lr(self) -> list[float]:
        return [] if self.optimizer is None else [g["lr"] for g in self.optimizer.param_groups]

    def train_batch_size(self) -> int:
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    @property
    def world_size(self) -> int:
        return self.dp_world_size

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if self.comm.distributed else 0

    @property
    def local_rank(self) -> int:
        return device.local_rank()

    @property
    def zero_stage(self) -> int:
        return self.policy.stage

    @property
    def gradients_reduced(self) -> bool:
        """Whether reduced gradients wait for the step: after the accumulation boundary's backward
        (at stages 2-3 after any backward that reduced), until the step applies or drops them."""
        return self._reduced_for_boundary or (not self.policy.full_gradient_buffer
                                              and any(g.grads.shard is not None for g in self.trainable))

    def empty_partition_cache(self) -> None:
        """Free what the engine holds beyond its shards (DeepSpeed's name): stage 3 releases every
        gathered unit (units kept gathered after a forward whose backward never came, by
        ``stage3_max_reuse_distance``, or the root unit after a forward with grad enabled), and at
        every stage the buffers kept for gloo's collectives and the device's cached memory are
        returned. Call it between steps, not between a forward and its backward."""
        if self.sharded is not None:
            self.sharded.release_all(forget_uses=True)
            self.sharded.scratch.release()
        SCRATCH.release()
        device.empty_cache(self.device)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of model state held on this rank, by category, measured from the real tensors
        (see ``zerodp.memory.measure_model_states``)."""
        return measure_model_states(self)

    def comm_stats(self, by_group: bool = False) -> dict:
        """Bytes this rank moved in the last optimizer step (its whole accumulation window), per
        collective kind, plus ``"total"``. Counted as ring-algorithm bytes sent per rank: an
        all-reduce of B bytes over N ranks counts 2B(N-1)/N, a reduce-scatter or all-gather of a
        B-byte buffer B(N-1)/N; ``"control"`` is the small norm/usage all-reduce.

        With ``by_group=True``: the same per process group, ``{group: {kind: bytes, "total": ...,
        "calls": collectives issued}}``, the groups being ``"data"`` (the data-parallel group, or
        the shard group of hybrid sharding), ``"replica"`` (across hybrid replicas), ``"tensor"``
        (the tensor-parallel activations' all-reduces and all-gathers) and ``"grid"`` (the
        gradient norm over the whole grid)."""
        counter = self.comm.counter
        if by_group:
            out = {}
            for group, kinds in counter.last_by_group.items():
                out[group] = dict(kinds, total=sum(kinds.values()), calls=counter.last_calls.get(group, 0))
            return out
        stats = dict(counter.last_step)
        stats["total"] = sum(stats.values())
        return stats

    def parameter_index(self) -> dict[str, dict]:
        """Parameter name -> flat group, offset, numel and shape."""
        index = {}
        for g in self.flat_groups:
            index.update(g.index_entries())
        return index

    # -- DeepSpeed's engine queries --------------------------------------------------------

    def fp16_enabled(self) -> bool:
        """Whether the config enables fp16 (inputs a script casts should be ``torch.half``)."""
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def compile(self, backend: Optional[str] = None, compile_kwargs: Optional[dict] = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False, **_deepspeed_only) -> None:
        """Run the model compiled by ``torch.compile`` from now on, at any stage (DeepSpeed's
        ``engine.compile``, which Accelerate calls when the script asks for compilation).

        ``backend`` defaults to torch's (inductor); ``compile_kwargs`` are ``torch.compile``'s (a
        ``backend`` among them gives way to the argument, as in DeepSpeed). At stage 3 the units'
        gather, release and prefetch run outside the compiled code (``core/sharded.py``), so each
        unit's forward compiles between them, and the forward that records the order of units
        (the first) runs uncompiled. DeepCompile's ``schedule`` and compiled autograd are not
        there: warned, and backward runs as autograd runs it. The config's ``compile`` block is
        read here (``config/compile.py``)."""
        why = refuses_compile(self.parallelisms)
        if why is not None:
            raise ValueError(f"engine.compile: {why}")
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs and backend is not None:
            warnings.warn("engine.compile: the backend in compile_kwargs gives way to the backend argument",
                          stacklevel=2)
        if backend is not None:
            kwargs["backend"] = backend
        if schedule is not None or compiled_autograd_enabled:
            warnings.warn("engine.compile: DeepCompile's schedule and compiled autograd are not in zerodp; "
                          "the forward is compiled, backward runs as autograd runs it", stacklevel=2)
        if self.config.compile.debug_log:
            torch._logging.set_logs(graph_breaks=True, recompiles=True)
        if not self.is_compiled:
            self._compile_model(kwargs)

    def _compile_model(self, kwargs: dict) -> None:
        # torch.compile's wrapper (nn.Module.compile in place leaves the forward uncompiled in
        # torch 2.13); engine.module is then the wrapper, whose _orig_mod is the model
        self.module = torch.compile(self.base_module, **kwargs)

    @property
    def is_compiled(self) -> bool:
        """Whether the engine runs the model compiled (``compile``, or a model compiled before, in
        ``torch.compile``'s wrapper or in place)."""
        return self.module is not self.base_module or getattr(self.module, "_compiled_call_impl", None) is not None

    def zero_optimization_stage(self) -> int:
        return self.policy.stage

    def zero_optimization(self) -> bool:
        return self.policy.stage > 0

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters (False between accumulation
        boundaries and when fp16 gradients overflowed)."""
        return self._step_applied

    @property
    def global_samples(self) -> int:
        return self.global_steps * self.train_batch_size()

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_world_size

"""The checkpoint verbs of DeepSpeed's engine (``save_checkpoint``, ``load_checkpoint``, the 16-bit
model saves Accelerate and the Trainer call). ``ZeroEngine`` inherits them; the work is in
``checkpoint/``, which is given the engine's ``CheckpointView`` (``core/view.py``), never the engine.
"""
from __future__ import annotations

from typing import Optional

from ..core.packed import undo_cpu_repacking
from ..core.param_api import GatheredParameters
from ..core.view import CheckpointView


class CheckpointAPI:
    """The checkpoint methods of ``ZeroEngine`` (DeepSpeed's names)."""

    def checkpoint_view(self) -> CheckpointView:
        """What checkpoints read and write of this engine (``core/view.py``): ``checkpoint/``
        is given this view, never the engine."""
        return CheckpointView(self)

    def _parameters_as_saved(self) -> None:
        """Before a save reads the parameters: data a module assigned to one (``p.data = t``) is in
        its flat group's buffer (``FlatGroup.keep_assigned_data``; at stage 3 a release did it), and
        4-bit weights that bitsandbytes repacked for its CPU kernels are back in the standard
        layout (``core/packed.py``). Every rank calls it (a save is collective)."""
        for g in self.flat_groups:
            if g.gathered:
                g.keep_assigned_data()
        undo_cpu_repacking(self.base_module, GatheredParameters)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False, async_save: Optional[bool] = None) -> bool:
        """Save to ``save_dir/tag`` (default tag ``global_step{N}``): every rank writes its shard
        in parallel, rank 0 the index, committed atomically; ``save_dir/latest`` then names
        the tag. ``client_state``: a dict of JSON values and tensors, returned by
        ``load_checkpoint``. ``async_save`` (default: the config's ``checkpoint.async_save``)
        returns once a host copy is staged and writes in the background. Every rank must call
        it. See ``zerodp/checkpoint/save.py``."""
        if self._checkpointer is None:
            from ..checkpoint.save import Checkpointer
            self._checkpointer = Checkpointer(self.checkpoint_view())
        if async_save is None:
            async_save = self.config.checkpoint.async_save
        self._parameters_as_saved()
        with self.health.phase("save_checkpoint", str(save_dir)):
            return self._checkpointer.save(save_dir, tag, client_state, save_latest,
                                           exclude_frozen_parameters, async_save)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        """Load ``load_dir/tag`` (default: the tag ``load_dir/latest`` names), written by zerodp
        at any world size and stage or by DeepSpeed; returns ``(path, client_state)``, or
        ``(None, None)`` when there is no ``latest`` to follow. Every rank must call it."""
        self.wait_for_checkpoint()
        from ..checkpoint import load_checkpoint
        with self.health.phase("load_checkpoint", str(load_dir)):
            return load_checkpoint(self.checkpoint_view(), load_dir, tag, load_module_strict=load_module_strict,
                                   load_optimizer_states=load_optimizer_states,
                                   load_lr_scheduler_states=load_lr_scheduler_states,
                                   load_module_only=load_module_only)

    def wait_for_checkpoint(self) -> None:
        """Wait for an asynchronous save in flight; raise its error if it failed."""
        if self._checkpointer is not None:
            self._checkpointer.wait()

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the full model's weights in the compute dtype (gathered at stage 3) to
        ``save_dir/save_filename`` from rank 0: safetensors for a ``.safetensors`` name,
        otherwise ``torch.save`` of the state dict. Every rank must call it."""
        from ..checkpoint.consolidate import save_16bit_model
        self._parameters_as_saved()
        return save_16bit_model(self.checkpoint_view(), save_dir, save_filename, exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's ``zero_optimization.stage3_gather_16bit_weights_on_model_save``: whether a
        model save (Accelerate's, the Trainer's ``save_model``) may gather the full weights."""
        return bool(self.zero_config.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The full model's state dict in the compute dtype, on rank 0 (an empty dict on the
        others), gathered group by group (DeepSpeed's name; Accelerate calls it to save a
        stage-3 model). Every rank must call it."""
        from ..checkpoint.consolidate import consolidated_16bit_state_dict
        self._parameters_as_saved()
        return consolidated_16bit_state_dict(self.checkpoint_view(), exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """DeepSpeed's name for the same, where parameters are split (stage 3 or tensor parallelism;
        Accelerate calls it to save a model split by AutoTP); refused otherwise, as DeepSpeed does.
        Every rank must call it."""
        if not (self.policy.shard_parameters or self.grid.tp_size > 1 or self.checkpoint_view().experts):
            raise ValueError("consolidated_16bit_state_dict is for split weights (stage 3, tensor or expert "
                             "parallelism); here every rank holds the whole model: use module.state_dict()")
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

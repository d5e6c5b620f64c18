"""``ZeroStrategy``: zerodp as a strategy of Lightning's ``Trainer``.

It is Lightning's own ``DeepSpeedStrategy`` (so every part of Lightning that treats DeepSpeed
specially, such as its precision plugin, gradient accumulation and checkpoint directories,
treats it the same way) with each call into DeepSpeed made to zerodp instead, no DeepSpeed
required, and on CPU (gloo) as well as CUDA (NCCL).
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Generator, Mapping, Optional

from torch import nn

from . import common
from .flavors import Flavor


def make_zero_strategy(flavor: Flavor) -> type:
    """``ZeroStrategy`` on ``flavor``'s ``DeepSpeedStrategy``, registered in its ``StrategyRegistry``."""
    strategies = flavor.trainer_module("strategies")
    DeepSpeedStrategy, StrategyRegistry = strategies.DeepSpeedStrategy, strategies.StrategyRegistry
    DDPStrategy = flavor.trainer_module("strategies.ddp").DDPStrategy
    reset_seed = flavor.fabric_module("utilities.seed").reset_seed

    class ZeroStrategy(common.ZerodpCalls, DeepSpeedStrategy):
        """ZeRO stages 1-3 with offload for ``lightning.Trainer``, by zerodp.

        Takes the arguments of Lightning's ``DeepSpeedStrategy`` (``stage``, ``offload_optimizer``,
        ``offload_parameters``, ``config`` as a dict or a JSON path, ``logging_batch_size_per_gpu``,
        ...) and is registered under DeepSpeed's names with ``zerodp`` in place of ``deepspeed``
        (``Trainer(strategy="zerodp_stage_3")``). ``Trainer(precision=...)``,
        ``accumulate_grad_batches`` and ``gradient_clip_val`` go into the config as with DeepSpeed.
        Checkpoints are directories written by ``engine.save_checkpoint``, loadable at any world
        size and stage; :func:`zerodp.lightning.convert_zero_checkpoint_to_fp32_state_dict` makes one
        file of them. zerodp's metrics (``zerodp/mem_*``, ``zerodp/comm_*``) go to the Trainer's
        loggers every ``log_every_n_steps`` optimizer steps.
        """

        strategy_name = "zerodp"
        _deepspeed, _ddp, _flavor = DeepSpeedStrategy, DDPStrategy, flavor

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            common.construct(self, DeepSpeedStrategy, DDPStrategy, args, kwargs)
            self._engine: Optional[nn.Module] = None
            self._logged_step = -1

        __init__.__signature__ = inspect.signature(DeepSpeedStrategy.__init__)  # type: ignore[attr-defined]

        # -- where Lightning's DeepSpeedStrategy calls DeepSpeed -----------------------------------

        def setup_distributed(self) -> None:
            common.check_device_indices(self)
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model: nn.Module, optimizer: Any, lr_scheduler: Any = None) -> tuple:
            engine, optimizer, _ = common.initialize(self, model, self.config, optimizer, lr_scheduler)
            self._engine = engine
            return engine, optimizer

        def _initialize_deepspeed_inference(self, model: nn.Module) -> None:
            """validate / test / predict: the engine that trained ``model`` when there is one, else
            an engine without an optimizer."""
            if self._engine is not None and getattr(self._engine, "module", None) is model:
                self.model = self._engine
                return
            config = common.inference_config(self.config, self.zero_stage_3)
            self._engine, _, _ = common.initialize(self, model, config, training=False)
            self.model = self._engine

        @contextmanager
        def model_sharded_context(self) -> Generator[None, None, None]:
            self._init_config_if_needed()
            with common.sharded_init(self):
                yield

        def _restore_zero_state(self, ckpt: Mapping[str, Any], strict: bool) -> None:
            common.load_full_state_dict(self.lightning_module, ckpt["state_dict"], strict)

        def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            """The engine's backward, without its own division by the accumulation steps: the
            Trainer has already divided the loss by ``accumulate_grad_batches``."""
            kwargs.setdefault("scale_wrt_gas", False)
            return super().backward(closure_loss, optimizer, *args, **kwargs)

        # -- zerodp's metrics ------------------------------------------------------------------------

        def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            self._log_engine_metrics()
            return out

        def _log_engine_metrics(self) -> None:
            trainer = getattr(self.lightning_module, "_trainer", None)
            engine = self.deepspeed_engine
            if trainer is None or not trainer.loggers or not self.is_global_zero or not hasattr(engine, "global_steps"):
                return
            step = engine.global_steps
            if step == self._logged_step or step % max(1, trainer.log_every_n_steps):
                return
            self._logged_step = step
            metrics = self.engine_metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    ZeroStrategy.__module__, ZeroStrategy.__qualname__ = flavor.face, "ZeroStrategy"
    ZeroStrategy.register_strategies(StrategyRegistry)
    return ZeroStrategy

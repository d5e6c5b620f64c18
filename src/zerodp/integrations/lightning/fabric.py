"""``ZeroFabricStrategy``: zerodp as a strategy of Lightning's ``Fabric``.

Lightning's Fabric ``DeepSpeedStrategy`` with each call into DeepSpeed made to zerodp instead,
as ``trainer.py`` does for the Trainer.
"""
from __future__ import annotations

import inspect
from itertools import chain
from typing import Any, Callable, Optional, Union

from torch import nn
from torch.optim import Optimizer

from zerodp.engine import ZeroEngine

from . import common
from .flavors import Flavor


def make_fabric_strategy(flavor: Flavor) -> type:
    """``ZeroFabricStrategy`` on ``flavor``'s Fabric ``DeepSpeedStrategy``, registered in its registry."""
    strategies = flavor.fabric_module("strategies")
    DeepSpeedStrategy, STRATEGY_REGISTRY = strategies.DeepSpeedStrategy, strategies.STRATEGY_REGISTRY
    DDPStrategy = flavor.fabric_module("strategies.ddp").DDPStrategy
    _validate_checkpoint_directory = flavor.fabric_module("strategies.deepspeed")._validate_checkpoint_directory
    reset_seed = flavor.fabric_module("utilities.seed").reset_seed

    class ZeroFabricStrategy(common.ZerodpCalls, DeepSpeedStrategy):
        """ZeRO stages 1-3 with offload for ``lightning.Fabric``, by zerodp.

        The arguments and registered names are those of :class:`zerodp.lightning.ZeroStrategy`
        (``Fabric(strategy="zerodp_stage_2_offload")``). ``fabric.init_module()`` builds the model
        sharded at stage 3; ``fabric.setup(model, optimizer)`` returns the engine and its optimizer;
        ``fabric.save`` / ``fabric.load`` write and read checkpoint directories (any world size and
        stage). Gradient accumulation is the config's ``gradient_accumulation_steps``: call
        ``optimizer.step()`` after every ``fabric.backward``, the engine steps at the boundary.
        ``fabric.log_dict(fabric.strategy.engine_metrics())`` logs zerodp's measurements.
        """

        strategy_name = "zerodp"
        _deepspeed, _ddp, _flavor = DeepSpeedStrategy, DDPStrategy, flavor

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            common.construct(self, DeepSpeedStrategy, DDPStrategy, args, kwargs)
            self._backward_sync_control = None  # the engine accumulates gradients itself
            self._deepspeed_engine = None

        __init__.__signature__ = inspect.signature(DeepSpeedStrategy.__init__)  # type: ignore[attr-defined]

        # -- where Lightning's DeepSpeedStrategy calls DeepSpeed -----------------------------------

        def _setup_distributed(self) -> None:
            common.check_device_indices(self)
            reset_seed()
            self._set_world_ranks()
            self._init_deepspeed_distributed()
            if not self._config_initialized:
                self._format_config()
                self._config_initialized = True

        def _initialize_engine(self, model: nn.Module, optimizer: Optional[Optimizer] = None,
                               scheduler: Any = None) -> tuple:
            return common.initialize(self, model, self.config, optimizer, scheduler, training=optimizer is not None)

        def module_sharded_context(self):
            assert self._config_initialized  # the config is complete once the processes are set up
            return common.sharded_init(self)

        def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
            """``optimizer.step()`` of the optimizer ``fabric.setup`` returned is the engine's step:
            it updates at the end of each ``gradient_accumulation_steps`` micro-batches, after
            clipping, as ``engine.step()`` does (Fabric would otherwise step the bare optimizer,
            which updates every time it is called)."""
            engine = self._deepspeed_engine
            if engine is not None and (optimizer is engine or optimizer is getattr(engine, "optimizer", None)):
                return engine.step()
            return super().optimizer_step(optimizer, **kwargs)

        def load_module_state_dict(self, module: nn.Module, state_dict: dict, strict: bool = True) -> None:
            """A whole state dict into a module that may be sharded (``load_full_weights``)."""
            common.load_full_state_dict(module, state_dict, strict)

        def save_checkpoint(self, path: Any, state: dict, storage_options: Optional[Any] = None,
                            filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
            """The engine's model and optimizer and the rest of ``state`` (as its client state) into the
            directory ``path``, written by every rank."""
            if storage_options is not None or filter is not None:
                raise TypeError(f"{type(self).__name__}.save_checkpoint takes neither storage_options nor filter: "
                                "the engine writes the checkpoint itself")
            engine = _one_engine(state, "save")
            path = self.broadcast(path)
            own = (engine, engine.optimizer)
            rest = {k: v for k, v in state.items() if not any(v is o for o in own)}
            rest = self._convert_stateful_objects_in_state(rest, filter={})
            engine.save_checkpoint(path, client_state=rest, tag="checkpoint",
                                   exclude_frozen_parameters=self.exclude_frozen_parameters)

        def load_checkpoint(self, path: Any, state: Optional[Union[nn.Module, Optimizer, dict]] = None,
                            strict: bool = True, weights_only: Optional[bool] = None) -> dict:
            """Restore ``state`` (which holds the engine) from a directory the strategy saved; the
            entries of ``state`` besides the engine and its optimizer are filled from the saved
            client state, and what is left of it is returned. A single file (``load_full_weights``
            at stage 3, or a module or optimizer alone) loads as with DDP."""
            if isinstance(state, (nn.Module, Optimizer)) or (self.load_full_weights and self.zero_stage_3):
                return DDPStrategy.load_checkpoint(self, path=self.broadcast(path), state=state, strict=strict,
                                                   weights_only=weights_only)
            if not state:
                raise ValueError(f"{type(self).__name__}.load_checkpoint needs the state to restore, holding the "
                                 "model set up by fabric.setup: state={'model': model, ...}")
            _validate_checkpoint_directory(path)
            engine = _one_engine(state, "load")
            wants_optimizer = any(isinstance(v, Optimizer) for v in state.values())
            _, client = engine.load_checkpoint(path, tag="checkpoint", load_optimizer_states=wants_optimizer,
                                               load_lr_scheduler_states=False, load_module_strict=strict)
            if client is None:
                raise RuntimeError(f"{path} holds no checkpoint written by {type(self).__name__} or DeepSpeed")
            for key in set(client) & set(state):
                target = state[key]
                if isinstance(target, (nn.Module, Optimizer)):
                    continue
                value = client.pop(key)
                if hasattr(target, "load_state_dict"):
                    target.load_state_dict(value)
                else:
                    state[key] = value
            return client

    ZeroFabricStrategy.__module__, ZeroFabricStrategy.__qualname__ = flavor.face, "ZeroFabricStrategy"
    ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)
    return ZeroFabricStrategy


def _one_engine(state: dict, verb: str) -> ZeroEngine:
    modules = chain(*(v.modules() for v in state.values() if isinstance(v, nn.Module)))
    engines = [m for m in modules if isinstance(m, ZeroEngine)]
    if len(engines) != 1:
        raise ValueError(f"to {verb} a checkpoint the state must hold exactly one model set up by fabric.setup "
                         f"(found {len(engines)}): state={{'model': model, 'optimizer': optimizer, ...}}")
    return engines[0]


"""What the Trainer and the Fabric strategy share: building the DeepSpeed-style config from
the constructor arguments Lightning's ``DeepSpeedStrategy`` takes, and each call that strategy
makes to DeepSpeed, made to zerodp instead."""
from __future__ import annotations

import argparse
import inspect
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

import zerodp

#: ``zero_optimization`` keys Lightning's ``DeepSpeedStrategy`` takes as constructor arguments
ZERO_KEYS = ("stage", "contiguous_gradients", "overlap_comm", "allgather_partitions", "reduce_scatter",
             "allgather_bucket_size", "reduce_bucket_size", "sub_group_size")
#: constructor arguments kept as attributes, as Lightning's strategy keeps them
KEPT = ("remote_device", "load_full_weights", "exclude_frozen_parameters", "loss_scale", "initial_scale_power",
        "loss_scale_window", "hysteresis", "min_loss_scale")
#: the devices zerodp runs on
DEVICES = ("cpu", "cuda")


def construct(strategy: Any, deepspeed_cls: type, ddp_cls: type, args: tuple, kwargs: dict) -> None:
    """Set ``strategy`` up from ``args``/``kwargs``, read as ``deepspeed_cls.__init__``'s arguments
    (same names, same defaults, same config), without requiring DeepSpeed."""
    try:
        bound = inspect.signature(deepspeed_cls.__init__).bind(strategy, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{type(strategy).__name__}: {e} (the arguments are those of Lightning's "
                        "DeepSpeedStrategy)") from None
    bound.apply_defaults()
    a = dict(bound.arguments)
    a.pop("self")
    ddp_params = inspect.signature(ddp_cls.__init__).parameters
    ddp_cls.__init__(strategy, **{k: v for k, v in a.items() if k in ddp_params and k != "self"})
    strategy._timeout = a["timeout"]
    strategy.config = strategy._load_config(a["config"])
    if strategy.config is None:  # no config given: built from the arguments, as DeepSpeedStrategy does
        named = inspect.signature(strategy._create_default_config).parameters
        strategy.config = strategy._create_default_config(
            **{k: a[k] for k in named if k in a}, **{k: a[k] for k in ZERO_KEYS if k in a})
    strategy._config_initialized = False
    logging.getLogger("zerodp").setLevel(a["logging_level"])
    for name in KEPT:
        setattr(strategy, name, a[name])


class ZerodpCalls:
    """The part of both strategies that is the same: a mixin placed before Lightning's
    ``DeepSpeedStrategy`` (the Trainer's or Fabric's, ``_deepspeed``), whose environment set-up is
    its base ``_ddp``'s on any accelerator zerodp runs on, and whose calls into DeepSpeed go to
    zerodp."""

    _deepspeed: type
    _ddp: type
    _flavor: Any  # flavors.Flavor: which Lightning the class was made for

    def setup_environment(self) -> None:
        check_device(self)
        self._ddp.setup_environment(self)  # DeepSpeedStrategy's own refuses all but CUDA

    def _init_deepspeed_distributed(self) -> None:
        init_distributed(self)

    def _set_deepspeed_activation_checkpointing(self) -> None:
        configure_activation_checkpointing(self.config)

    def engine_metrics(self) -> dict[str, float]:
        """This rank's model-state memory by category and bytes communicated in the last step."""
        return engine_metrics(self.model)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """DeepSpeed's strategy names with ``zerodp`` in place of ``deepspeed``, for this class."""
        for name, description, params in registry_entries(cls._deepspeed):
            strategy_registry.register(name, cls, description=description, override=True, **params)


def check_device(strategy: Any) -> None:
    """Refuse an accelerator zerodp does not run on (it runs on CPU with gloo and CUDA with NCCL)."""
    kinds = {d.type for d in (strategy.parallel_devices or [])}
    if kinds - set(DEVICES):
        raise RuntimeError(f"{type(strategy).__name__} runs on CPU (gloo) or CUDA (NCCL); the accelerator "
                           f"{type(strategy.accelerator).__name__} gives devices of type {sorted(kinds)}")


def check_device_indices(strategy: Any) -> None:
    """On CUDA, process ``i`` of a node must use device ``i`` (as with DeepSpeed); CPU devices have
    no index."""
    if strategy.parallel_devices and strategy.parallel_devices[0].type == "cuda":
        deepspeed = strategy._flavor.fabric_module("strategies.deepspeed")  # the strategy's own Lightning's
        deepspeed._validate_device_index_selection(strategy.parallel_devices)


def init_distributed(strategy: Any) -> None:
    """Join the process group (Lightning's environment variables, then ``zerodp.init_distributed``)."""
    strategy._set_node_environment_variables()
    strategy._process_group_backend = strategy._get_process_group_backend()
    zerodp.init_distributed(strategy._process_group_backend, distributed_port=strategy.cluster_environment.main_port,
                            timeout=strategy._timeout)


def initialize(strategy: Any, model: nn.Module, config: dict, optimizer: Any = None, lr_scheduler: Any = None,
               training: bool = True) -> tuple:
    """``zerodp.initialize`` as Lightning's strategy calls ``deepspeed.initialize``: returns
    ``(engine, optimizer, lr_scheduler)``."""
    params = [p for p in model.parameters() if p.requires_grad] if training else []
    engine, opt, _, sched = zerodp.initialize(
        args=argparse.Namespace(device_rank=strategy.root_device.index), config=config, model=model,
        model_parameters=params, optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False)
    return engine, opt, sched


def inference_config(config: dict, zero_stage_3: bool) -> dict:
    """The config of an engine built for validate / test / predict alone: the precision blocks and,
    at stage 3, the ZeRO block (parameters stay sharded)."""
    out: dict = {"train_micro_batch_size_per_gpu": 1}
    for key in ("fp16", "bf16"):
        if key in config:
            out[key] = config[key]
    if zero_stage_3:
        out["zero_optimization"] = config["zero_optimization"]
    return out


def sharded_init(strategy: Any):
    """The context that builds a module's parameters already sharded at stage 3 (``zero.Init``)."""
    return zerodp.zero.Init(enabled=strategy.zero_stage_3, remote_device=strategy.remote_device,
                            config_dict_or_path=strategy.config)


def configure_activation_checkpointing(config: dict) -> None:
    """The config's ``activation_checkpointing`` block, handed to ``zerodp.checkpointing``."""
    block = config.get("activation_checkpointing")
    if block:
        zerodp.checkpointing.configure(
            mpu_=None, partition_activations=block.get("partition_activations"),
            contiguous_checkpointing=block.get("contiguous_memory_optimization"),
            checkpoint_in_cpu=block.get("cpu_checkpointing"), profile=block.get("profile"))


def load_full_state_dict(root: nn.Module, state_dict: dict, strict: bool = True) -> None:
    """Load a whole (unsharded) state dict into a module whose parameters may be sharded
    (stage 3): module by module, each module's own parameters gathered, written, and sharded
    again. Every rank passes the same ``state_dict``."""
    params = [name for name, _ in root.named_parameters()]
    known = set(params) | {name for name, _ in root.named_buffers()}
    missing = [k for k in params if k not in state_dict]
    unexpected = [k for k in state_dict if k not in known]
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(root).__name__}: missing keys "
                           f"{missing}, unexpected keys {unexpected}")
    for prefix, module in root.named_modules():
        pre = f"{prefix}." if prefix else ""
        own = list(module.parameters(recurse=False))
        with zerodp.zero.GatheredParameters(own, modifier_rank=0):
            with torch.no_grad():
                for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                    if pre + name in state_dict:
                        t.copy_(state_dict[pre + name])


def engine_metrics(engine: Any) -> dict[str, float]:
    """What zerodp measures, for Lightning's loggers: this rank's model-state bytes by category
    (``zerodp/mem_<category>``) and the bytes it moved in the last optimizer step per collective
    kind (``zerodp/comm_<kind>``)."""
    out = {f"zerodp/mem_{k}": float(v) for k, v in engine.memory_breakdown().items()}
    out.update({f"zerodp/comm_{k}": float(v) for k, v in engine.comm_stats().items()})
    return out


def registry_entries(deepspeed_cls: type) -> list[tuple[str, str, dict]]:
    """DeepSpeed's strategy names, with ``zerodp`` in place of ``deepspeed``: ``(name,
    description, constructor arguments)`` read from ``deepspeed_cls.register_strategies``."""
    found: list[tuple[str, str, dict]] = []

    class _Recorder:
        def register(self, name, strategy, description=None, override=False, **init_params):
            found.append((name, description or "", init_params))

    deepspeed_cls.register_strategies.__func__(deepspeed_cls, _Recorder())
    return [("zerodp" + name[len("deepspeed"):], (desc or "").replace("DeepSpeed", "zerodp"), params)
            for name, desc, params in found if name.startswith("deepspeed")]


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag: Optional[str] = None) -> dict:
    """One file from a checkpoint the strategy saved (a directory): the full fp32 weights as
    ``state_dict`` with the rest of what Lightning saved (epoch, loops, callbacks, hyper-
    parameters), written with ``torch.save`` so that ``LightningModule.load_from_checkpoint``
    and ``Trainer(ckpt_path=...)`` with any strategy read it. Any world size and stage, and
    DeepSpeed's checkpoints too. Returns what it wrote."""
    from zerodp.checkpoint.consolidate import open_checkpoint
    from zerodp.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    checkpoint_dir = Path(checkpoint_dir)
    client = dict(open_checkpoint(checkpoint_dir, tag).client_state or {})
    weights = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    prefix = "_forward_module."  # Lightning < 2.1 saved the module inside a wrapper
    client["state_dict"] = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in weights.items()}
    os.makedirs(Path(output_file).parent or ".", exist_ok=True)
    torch.save(client, output_file)
    return client


def point_deepspeed_strategies_to_zerodp() -> None:
    """Under ``ZERODP_AS_DEEPSPEED=1``: Lightning's own ``DeepSpeedStrategy`` (Trainer and Fabric)
    refuses any accelerator but CUDA; its error then also names the ``zerodp_stage_*`` strategy that
    runs the same ZeRO stage there. Only the message changes."""
    import functools
    import sys
    for name in ("lightning.pytorch.strategies.deepspeed", "lightning.fabric.strategies.deepspeed",
                 "pytorch_lightning.strategies.deepspeed", "lightning_fabric.strategies.deepspeed"):
        module = sys.modules.get(name)
        cls = getattr(module, "DeepSpeedStrategy", None)
        if cls is None or getattr(cls.setup_environment, "_zerodp_hint", False):
            continue
        original = cls.setup_environment

        @functools.wraps(original)
        def setup_environment(self, _original=original):
            try:
                return _original(self)
            except RuntimeError as e:
                if "only supported on CUDA" not in str(e):
                    raise
                stage = ((self.config or {}).get("zero_optimization") or {}).get("stage", 2)
                raise RuntimeError(f"{e} zerodp runs the same ZeRO stage on this accelerator: "
                                   f'strategy="zerodp_stage_{stage}" (registered by `import zerodp.lightning`), or '
                                   "zerodp.lightning.ZeroStrategy / ZeroFabricStrategy with the same "
                                   "arguments.") from None
        setup_environment._zerodp_hint = True
        cls.setup_environment = setup_environment

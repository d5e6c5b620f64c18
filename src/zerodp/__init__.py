"""zerodp: ZeRO data-parallel training for PyTorch with DeepSpeed-compatible configs.

A DeepSpeed script ports by changing its imports (``import zerodp as deepspeed``, ``from
zerodp.X import Y`` for ``from deepspeed.X import Y``): the package has DeepSpeed's everyday names
(``initialize``, ``init_distributed``, ``add_config_arguments``, ``zero``, ``comm``,
``accelerator.get_accelerator``, ``checkpointing``, ``utils``, ``ops.adam``, ``moe``); the DeepSpeed
features it does not implement raise an error naming them (``unsupported.py``).

The API in brief::

    engine, optimizer, loader, scheduler = zerodp.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    for x, y in loader:
        loss = loss_fn(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
"""
from __future__ import annotations

import argparse
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import _moved, accelerator, checkpointing, comm, moe, ops, parallel, runtime, unsupported, utils, zero  # noqa: F401 (DeepSpeed's modules)
from ._version import __version__ as __version__
from .checkpoint import CheckpointError
from .comm import init_distributed
from .config import PRESETS, Config, ConfigError, load_config, resolve_batch_sizes
from .core import teardown
from .core.data import DataLoader
from .core.param_api import GatheredParameters, register_external_parameter
from .engine import PipelineEngine, ZeroEngine
from .estimator import estimate
from .monitor import monitor_from_config
from .parallel import tp_model_init
from .pipe import PipelineModule
from .runtime.zero import parameter_offload

__all__ = ["initialize", "init_distributed", "add_config_arguments", "CheckpointError", "GatheredParameters",
           "register_external_parameter", "ZeroEngine", "DeepSpeedEngine", "Config", "ConfigError",
           "load_config", "PRESETS", "resolve_batch_sizes", "estimate", "tp_model_init", "PipelineEngine"]

#: DeepSpeed's engine class name (for ``isinstance`` checks in ported scripts).
DeepSpeedEngine = ZeroEngine
unsupported.install()
_moved.install()

_log = logging.getLogger("zerodp")
if not _log.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[zerodp] %(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(logging.INFO)
    _log.propagate = False


def __getattr__(name: str):
    if name in unsupported.NOT_IMPLEMENTED:
        raise unsupported.error(name)
    raise AttributeError(f"module 'zerodp' has no attribute {name!r}")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line options (``--deepspeed``, ``--deepspeed_config``, and the
    older ``--deepscale``/``--deepscale_config``) and zerodp's (``--zerodp``, ``--zerodp_config``)
    to ``parser``; ``initialize(args=...)`` reads the config path from them."""
    group = parser.add_argument_group("zerodp", "zerodp (DeepSpeed-compatible) configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed-style training (a flag for the script; zerodp always runs)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    group.add_argument("--zerodp", default=False, action="store_true", help="the same as --deepspeed")
    group.add_argument("--zerodp_config", default=None, type=str, help="the same as --deepspeed_config")
    return parser


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: Optional[bool] = None,
               collate_fn: Any = None, config: Any = None, mesh_param: Any = None, config_params: Any = None,
               process_group: Optional[dist.ProcessGroup] = None,
               preset: Optional[str] = None, unit_classes: Any = (), param_init_fn: Any = None):
    """Wrap ``model`` for ZeRO training; DeepSpeed's ``deepspeed.initialize`` signature.

    Returns ``(engine, optimizer, dataloader, lr_scheduler)``; ``dataloader`` is ``None``
    unless ``training_data`` (a ``torch.utils.data.Dataset``) is given, and then yields
    ``train_micro_batch_size_per_gpu`` samples per rank (``zerodp.data.DataLoader``: a shuffled
    order split over the ranks, reshuffled every epoch, whose position checkpoints keep).

    The batch size comes from the config, as in DeepSpeed: ``train_batch_size`` or
    ``train_micro_batch_size_per_gpu`` must be an integer (``"auto"`` is a placeholder for a
    launcher to fill in), else :class:`ConfigError`. The one other source is ``training_data``
    given as a ``torch.utils.data.DataLoader`` with a ``batch_size``: it is returned as it is
    (its own sampler splits the data, or not, over the ranks), its ``batch_size`` is the
    micro-batch size when the config gives neither key, and must equal the config's otherwise.

    * ``config``: a dict, a path to a JSON file, or a ``zerodp.Config`` (``config_params`` is
      DeepSpeed's older name for it; ``args.deepspeed_config`` is read too).
    * ``optimizer``: an optimizer instance built on the model's parameters (zerodp re-points
      its param groups at this rank's shards, so a scheduler built on it stays valid), or a
      callable taking a list of param groups; otherwise the config's ``optimizer`` block.
    * ``model_parameters``: parameters or param-group dicts with their own hyperparameters.
    * ``process_group``: the data-parallel group (default: the whole world).
    * ``mpu``, ``mesh_param``: the process grid of tensor parallelism: DeepSpeed's ``mpu`` contract
      (a model the script split itself, Megatron-style) or a ``DeviceMesh`` with dims named
      ``dp`` and ``tp``; the config's ``tensor_parallel.autotp_size`` builds one too, and splits
      the model by its plan (docs/parallel.md).
    * ``preset``: one of ``zero0``..``zero3``, with ``config`` merged over it.
    * ``unit_classes``: stage 3: module classes whose instances are gathered and released as
      units (e.g. the transformer block class); by default units are chosen by size
      (``stage3_param_persistence_threshold``).
    * A model built on the meta device (``with torch.device("meta"): model = Net()``) is
      accepted at stage 3: each unit is materialized in turn, initialized by its modules'
      ``reset_parameters()`` and then ``param_init_fn(module)`` if given, and only this rank's
      shard is kept, so no rank ever holds the whole model.
    """
    if model is None:
        raise ValueError("initialize needs model=")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = (getattr(args, "deepspeed_config", None) or getattr(args, "zerodp_config", None)
                  or getattr(args, "deepscale_config", None))
    if config is None and preset is None:
        raise ConfigError("no config: pass config= (a dict or a JSON path) or preset=")
    cfg = load_config(config, preset=preset)
    user_loader = isinstance(training_data, torch.utils.data.DataLoader)
    if user_loader:
        cfg = _micro_batch_from_loader(cfg, training_data, collate_fn)
    if dist_init_required is not False:  # from a launcher's environment; alone, no group is needed
        accelerator.init_distributed()
    pipelined = isinstance(model, PipelineModule)
    grid = parallel.grid_for(model, cfg, mpu=mpu, mesh_param=mesh_param, process_group=process_group,
                             pp=model.num_stages if pipelined else 1)
    if pipelined and grid.pipe.rank != model.stage_id:
        raise parallel.GridError(
            f"the PipelineModule built stage {model.stage_id}'s layers on rank {grid.rank}, but the grid "
            f"({grid.source}) puts this rank in pipeline stage {grid.pipe.rank}: the pipeline axis must be "
            "the outermost (stage s = global ranks s x world / stages onwards)")
    if user_loader and training_data.batch_size is not None:  # its batches are the engine's micro-batches
        world = grid.dp_size
        micro = resolve_batch_sizes(cfg, world, grid.deepspeed_batch_ranks)[1]
        if micro != training_data.batch_size:
            raise ConfigError(
                f"train_micro_batch_size_per_gpu: the config gives {micro} (world size {world}), but the "
                f"DataLoader passed as training_data yields batches of {training_data.batch_size}; make "
                "them agree, or leave train_batch_size and train_micro_batch_size_per_gpu out of the config")
    teardown.install()
    engine_class = PipelineEngine if pipelined else ZeroEngine
    engine = engine_class(model, cfg, model_parameters=model_parameters, optimizer=optimizer,
                          lr_scheduler=lr_scheduler, unit_classes=unit_classes,
                          param_init_fn=param_init_fn, grid=grid)
    engine.monitor = monitor_from_config(cfg, engine)
    if engine.policy.shard_parameters:
        parameter_offload.attach(engine)  # what TRL's generation helpers touch
    loader = None
    if user_loader:
        loader = training_data
    elif training_data is not None:
        loader = DataLoader(training_data, batch_size=engine.train_micro_batch_size_per_gpu(),
                            num_replicas=engine.dp_world_size, rank=engine.dp_rank,
                            collate_fn=collate_fn)
    engine.training_dataloader = loader
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _micro_batch_from_loader(cfg: Config, loader: torch.utils.data.DataLoader, collate_fn: Any) -> Config:
    """``cfg`` with ``train_micro_batch_size_per_gpu`` taken from ``loader``'s batch size when the
    config fixes no batch size (neither it nor ``train_batch_size`` is an integer)."""
    if collate_fn is not None:
        raise ValueError("collate_fn: training_data is a DataLoader, which collates with its own "
                         "collate_fn; pass collate_fn to the DataLoader, or pass a Dataset")
    given = [v for v in (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) if v not in (None, "auto")]
    if given or loader.batch_size is None:  # (a batch_sampler's loader has no batch size to offer)
        return cfg
    return cfg.model_copy(update={"train_micro_batch_size_per_gpu": loader.batch_size})

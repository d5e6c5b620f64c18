"""The options of ``zerodp train`` and the engine config they build: the command line (shared
by the launcher and the worker, and passed from one to the other by :func:`to_argv`), the checks
run before any process starts (:func:`check_args`, :func:`check_config`), and the config from
``--preset`` and/or ``--config`` with the command line's overrides (:func:`build_config`)."""
from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path
from typing import Any, Optional

from ..config import PRESETS, Config, ConfigError, load_config, resolve_batch_sizes
from ..core.stages import policy_for
from ..examples.gpt import GPT_PRESETS, ByteCorpus
from ..optim import build_scheduler
from ..optim.build import optimizer_from_config
from . import monitor as monitor_module

DEFAULT_PRESET = "zero2"
DEFAULT_MODEL = "small"
DEFAULT_STEPS = 600
DEFAULT_MICRO_BATCH = 16
DEFAULT_GRAD_ACCUM = 1
DEFAULT_LR = 1e-3
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
DEFAULT_EVAL_EVERY = 100
DEFAULT_OUT = "runs/train"
DEFAULT_SAVE_INTERVAL = 100
MODELS = tuple(GPT_PRESETS)


class UsageError(ValueError):
    """Command-line options that cannot work together (reported without a traceback)."""


def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``zerodp train`` (shared by the launcher and the worker)."""
    run = parser.add_argument_group("processes")
    run.add_argument("--nproc", type=_positive_int, default=2, metavar="N",
                     help="number of data-parallel processes (ranks) to launch with torchrun; "
                          "1 runs in this process (default: %(default)s)")
    cfg = parser.add_argument_group("configuration")
    cfg.add_argument("--preset", choices=list(PRESETS), default=None,
                     help=f"built-in ZeRO config: stage 0-3 with AdamW and gradient clipping; "
                          f"zero2_offload and zero3_offload also keep the optimizer (at stage 3 also "
                          f"the parameter shards) in pinned host memory "
                          f"(default: {DEFAULT_PRESET}, or none when --config is given)")
    cfg.add_argument("--nvme-path", metavar="DIR", default=None,
                     help="offload the fp32 master weights and optimizer states to files under DIR "
                          "(offload_optimizer.device \"nvme\"; stage 1-3), read and written a tile "
                          "of sub_group_size elements at a time during the step")
    cfg.add_argument("--tp", type=_positive_int, default=None, metavar="N",
                     help="tensor parallelism: split each layer over N adjacent ranks (heads, MLP and "
                          "vocabulary; tensor_parallel.autotp_size), ZeRO sharding over the --nproc / N "
                          "data-parallel ranks, which see different batches (default: the config's, else 1)")
    cfg.add_argument("--loss-parallel", action="store_true",
                     help="with --tp: keep the logits split over the vocabulary and compute the cross entropy "
                          "on the slices (tensor_parallel.loss_parallel)")
    cfg.add_argument("--sequence-parallel", action="store_true",
                     help="with --tp: norms, dropout and residuals on sequence slices "
                          "(tensor_parallel.sequence_parallel)")
    cfg.add_argument("--config", metavar="PATH", default=None,
                     help="DeepSpeed-style JSON config; with --preset it is merged over the preset. "
                          "It must have an 'optimizer' block unless a preset supplies one")
    cfg.add_argument("--micro-batch", type=_positive_int, default=None, metavar="B",
                     help="sequences per rank per forward/backward (train_micro_batch_size_per_gpu; "
                          f"default: the config's value, else {DEFAULT_MICRO_BATCH})")
    cfg.add_argument("--grad-accum", type=_positive_int, default=None, metavar="K",
                     help="micro-batches per optimizer step (gradient_accumulation_steps; default: "
                          f"the config's value, else {DEFAULT_GRAD_ACCUM}). train_batch_size = "
                          "micro x accum x nproc; a train_batch_size in --config is honoured, "
                          "the missing factor derived from it")
    cfg.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                     help="compute dtype: bf16 or fp16 run forward, backward and gradient "
                          "communication in 16 bits with fp32 master weights (fp16 with dynamic "
                          "loss scaling); sets the config's bf16/fp16 blocks (default: the "
                          "config's, else fp32). On CPUs without 16-bit matrix units, 16-bit "
                          "matmuls are much slower than fp32")
    cfg.add_argument("--lr", type=_positive_float, default=None,
                     help="learning rate (optimizer.params.lr; default: the lr set in --config, "
                          f"else {DEFAULT_LR:g})")
    job = parser.add_argument_group("model and data")
    job.add_argument("--model", choices=MODELS, default=DEFAULT_MODEL,
                     help="example byte-level GPT: " + ", ".join(
                         f"{name} ({c.n_layer} layers x {c.n_embd}, context {c.block_size})"
                         for name, c in GPT_PRESETS.items()) + " (default: %(default)s)")
    job.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS,
                     help="optimizer steps to train (default: %(default)s)")
    job.add_argument("--seed", type=int, default=0,
                     help="seed for the model's initialization and the data sampling "
                          "(default: %(default)s)")
    job.add_argument("--eval-every", type=_non_negative_int, default=DEFAULT_EVAL_EVERY, metavar="N",
                     help="evaluate the mean validation loss over a few fixed batches every N "
                          "steps and at the end; 0 disables evaluation (default: %(default)s)")
    job.add_argument("--max-bytes", type=_positive_int, default=DEFAULT_MAX_BYTES, metavar="BYTES",
                     help="corpus size: bytes of Python standard-library source to read, the last "
                          "5%% held out for validation (default: %(default)s)")
    job.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                     help="directory for what the run produces: model.safetensors (the trained "
                          "weights, consolidated from the last checkpoint), samples.txt (text the "
                          "trained model writes) and summary.json (losses, memory and "
                          "communication tables); created if missing (default: %(default)s)")
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--save-dir", metavar="DIR", default=None,
                      help="checkpoint directory (default: OUT/checkpoints); a checkpoint is saved "
                           "every --save-interval steps and at the end")
    ckpt.add_argument("--save-interval", type=_non_negative_int, default=DEFAULT_SAVE_INTERVAL,
                      metavar="N", help="save a checkpoint every N steps; 0 saves only at the end "
                                        "(default: %(default)s)")
    ckpt.add_argument("--resume", action="store_true",
                      help="continue from the newest checkpoint in the save directory (its 'latest' "
                           "file), at any --nproc and --preset; starts from scratch when there is "
                           "none. Under torchrun --max-restarts this makes a restarted run go on")
    ckpt.add_argument("--async-save", action="store_true",
                      help="save checkpoints in the background (the config's checkpoint.async_save): "
                           "training goes on while a host copy of each rank's shard is written")
    ckpt.add_argument("--max-restarts", type=_non_negative_int, default=0, metavar="N",
                      help="restart all ranks up to N times when one fails (torchrun's option of that "
                           "name); implies --resume, so a restarted run continues from its last "
                           "checkpoint (default: %(default)s)")
    metrics = parser.add_argument_group("metrics")
    metrics.add_argument("--metrics-dir", metavar="DIR", default=None,
                         help="write one row of metrics per optimizer step (loss, learning rate, "
                              "gradient norm, step time, samples/s and tokens/s, memory by "
                              "category, bytes communicated) to DIR/metrics.csv on rank 0, for "
                              "'zerodp plot DIR'; this enables the config's csv_monitor block with "
                              "output_path = DIR's parent and job_name = DIR's name")
    metrics.add_argument("--tensorboard", action="store_true",
                         help="also write those metrics as TensorBoard scalars to the --metrics-dir "
                              "directory (the config's tensorboard block; needs the tensorboard "
                              "package: pip install tensorboard)")


def to_argv(args: argparse.Namespace) -> list[str]:
    """The worker's command line for ``args`` (``--nproc`` left out: torchrun's option
    parser would take it for an abbreviation of its own ``--nproc-per-node``; ``--max-restarts``
    is the launcher's)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "nproc":
            continue
        value = getattr(args, action.dest, None)
        if value is None or value is False or action.dest == "max_restarts":
            continue
        if value is True:  # a flag
            argv.append(action.option_strings[0])
            continue
        argv += [action.option_strings[0], repr(value) if isinstance(value, float) else str(value)]
    return argv


def check_args(args: argparse.Namespace, corpus: Optional[ByteCorpus] = None) -> None:
    """Check that the corpus is long enough for the model's context; without ``corpus``,
    from ``--max-bytes`` alone (the corpus holds at most that many bytes, 5% of them held out)."""
    block = GPT_PRESETS[args.model].block_size
    if corpus is not None:
        train_len, val_len = len(corpus.train), len(corpus.val)
    else:
        val_len = math.ceil(args.max_bytes * 0.05)
        train_len = args.max_bytes - val_len
    need = 20 * (block + 1)
    if getattr(args, "tensorboard", False) and not getattr(args, "metrics_dir", None):
        raise UsageError("--tensorboard needs --metrics-dir DIR (the directory to write to)")
    if train_len <= block or (args.eval_every and val_len <= block):
        raise UsageError(f"--max-bytes {args.max_bytes} is too small for the {args.model} model's "
                         f"context of {block} bytes (each split must be longer than that); "
                         f"use --max-bytes {need} or more")


def _concrete(value: Any) -> bool:
    return value is not None and value != "auto"


def build_config(args: argparse.Namespace) -> Config:
    """The engine config: preset and/or file, with the command line's overrides.

    Raises :class:`ConfigError` with the offending key for anything invalid.
    """
    preset = args.preset or (None if args.config else DEFAULT_PRESET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unknown keys are reported once, by the final load
        base = load_config(args.config, preset=preset)
    data = base.model_dump(exclude_unset=True)
    has_tbs = _concrete(base.train_batch_size)
    micro, gas = args.micro_batch, args.grad_accum
    if micro is None and not has_tbs and not _concrete(base.train_micro_batch_size_per_gpu):
        micro = DEFAULT_MICRO_BATCH
    if gas is None and not has_tbs and not _concrete(base.gradient_accumulation_steps):
        gas = DEFAULT_GRAD_ACCUM
    if micro is not None:
        data["train_micro_batch_size_per_gpu"] = micro
    if gas is not None:
        data["gradient_accumulation_steps"] = gas
    lr = args.lr
    if lr is None and not (args.config and _file_sets_lr(args.config)):
        lr = DEFAULT_LR
    if lr is not None and base.optimizer is not None:
        data["optimizer"] = dict(data.get("optimizer") or {})
        data["optimizer"]["params"] = dict(data["optimizer"].get("params") or {}, lr=lr)
    precision = getattr(args, "precision", None)
    if precision is not None:
        data["bf16"] = dict(data.get("bf16") or {}, enabled=precision == "bf16")
        data["fp16"] = dict(data.get("fp16") or {}, enabled=precision == "fp16")
    tp = getattr(args, "tp", None)
    if tp is not None:
        data["tensor_parallel"] = dict(data.get("tensor_parallel") or {}, autotp_size=tp)
    for option in ("loss_parallel", "sequence_parallel"):
        if getattr(args, option, False):
            data["tensor_parallel"] = dict(data.get("tensor_parallel") or {}, **{option: True})
    nvme = getattr(args, "nvme_path", None)
    if nvme:
        zero = data["zero_optimization"] = dict(data.get("zero_optimization") or {})
        zero["offload_optimizer"] = dict(zero.get("offload_optimizer") or {}, device="nvme", nvme_path=nvme)
    if getattr(args, "async_save", False):
        data["checkpoint"] = dict(data.get("checkpoint") or {}, async_save=True)
    metrics_dir = getattr(args, "metrics_dir", None)
    if metrics_dir:  # DeepSpeed's run directory is output_path/job_name: make it DIR itself
        where = Path(metrics_dir)
        block = {"enabled": True, "output_path": str(where.parent), "job_name": where.name}
        data["csv_monitor"] = dict(block)
        if getattr(args, "tensorboard", False):
            data["tensorboard"] = dict(block)
    return load_config(data)


def _file_sets_lr(path: str) -> bool:
    """Whether the JSON config at ``path`` (already read once and valid) sets optimizer.params.lr."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    optimizer = data.get("optimizer")
    params = optimizer.get("params") if isinstance(optimizer, dict) else None
    return isinstance(params, dict) and "lr" in params


def check_config(cfg: Config, world_size: int) -> tuple[int, int, int]:
    """Check what the engine would reject at start-up (the batch arithmetic for ``world_size``
    ranks, of which ``world_size / tensor_parallel size`` are data-parallel, the ZeRO stage, the
    optimizer and scheduler blocks), raising :class:`ConfigError`. Returns ``(train_batch_size,
    micro_batch, accumulation_steps)``."""
    tp = cfg.tensor_parallel.size
    if world_size % tp:
        raise ConfigError(f"tensor_parallel.autotp_size: {tp} does not divide the {world_size} processes; "
                          "give --nproc a multiple of --tp")
    sizes = resolve_batch_sizes(cfg, world_size // tp)
    if cfg.tensorboard.enabled:
        try:
            monitor_module.require_tensorboard()
        except ImportError as e:
            raise ConfigError(str(e)) from None
    try:
        policy_for(cfg.zero_optimization.stage)
    except NotImplementedError as e:
        raise ConfigError(f"zero_optimization.stage: {e}") from None
    if cfg.optimizer is None:
        raise ConfigError("optimizer: missing; zerodp train builds the optimizer from the config, so "
                          "add an 'optimizer' block (e.g. {\"type\": \"AdamW\", \"params\": "
                          "{\"lr\": 1e-3}}) or use --preset")
    # both built on a stand-in parameter, so that mistakes surface before any process starts
    optimizer = optimizer_from_config(cfg.optimizer.type, cfg.optimizer.params)
    if cfg.scheduler is not None:
        try:
            build_scheduler(optimizer, cfg.scheduler.type, dict(cfg.scheduler.params))
        except ValueError as e:
            raise ConfigError(f"scheduler: {e}") from None
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"scheduler.params: {cfg.scheduler.type} rejects "
                              f"{json.dumps(cfg.scheduler.params)}: {type(e).__name__}: {e}") from None
    return sizes

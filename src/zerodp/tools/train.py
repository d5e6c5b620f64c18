"""The ``zerodp train`` job: train the example byte-level GPT with a ZeRO engine.

This module is the worker: every rank runs :func:`main` (``python -m zerodp.tools.train``, normally
started by ``zerodp train``, which launches ``torch.distributed.run`` underneath). It

1. builds the config from ``--preset`` and/or ``--config`` plus the command-line overrides
   (micro-batch, gradient accumulation, learning rate; ``train_batch_size`` follows from
   ``micro x accum x world``);
2. builds the GPT under ``torch.manual_seed(seed)``, so every rank starts from the same
   weights, and wraps it with :func:`zerodp.initialize`;
3. trains ``--steps`` optimizer steps; each rank samples its own micro-batches from the
   training split with a generator seeded by ``(seed, rank)``;
4. evaluates the mean validation loss over a few fixed batches every ``--eval-every`` steps;
5. gathers every rank's model-state memory and per-step communication and prints them as
   tables (rank 0), optionally writing ``summary.json``.

With ``--metrics-dir DIR`` rank 0 also writes one row of metrics per step to
``DIR/metrics.csv`` (the ``csv_monitor`` config block; ``--tensorboard`` adds TensorBoard
scalars), with tokens per second counted from the model's context length;
``zerodp plot DIR`` draws them.

Rank 0 shows a progress bar (smoothed loss, learning rate, gradient norm, global tokens/s);
the other ranks print nothing.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import initialize
from ..core.device import init_distributed, synchronize
from . import monitor as monitor_module
from ..core.collectives import all_gather_numbers
from ..config import PRESETS, Config, ConfigError, load_config, resolve_batch_sizes
from .memory_check import compare_with_engine
from ..examples.gpt import GPT_PRESETS, Block, ByteCorpus, build_gpt
from ..optim import build_scheduler
from ..optim.build import optimizer_from_config
from ..core.stages import policy_for

__all__ = ["add_arguments", "to_argv", "check_args", "build_config", "check_config", "format_table",
           "run", "main", "UsageError", "WORKER_ENV"]

#: Environment variable set by ``zerodp train`` for the processes it launches.
WORKER_ENV = "ZERODP_TRAIN_WORKER"

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
SAMPLE_PROMPTS = ("def ", "import ", "class ")
SAMPLE_BYTES = 120
EVAL_BATCHES_PER_RANK = 4
LOSS_WINDOW = 10
MODELS = tuple(GPT_PRESETS)
MIB = 1024.0 * 1024.0


class UsageError(ValueError):
    """Command-line options that cannot work together (reported without a traceback)."""


# -- arguments ------------------------------------------------------------------------------

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


# -- config ---------------------------------------------------------------------------------

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
    ranks, the ZeRO stage, the optimizer and scheduler blocks), raising :class:`ConfigError`.
    Returns ``(train_batch_size, micro_batch, accumulation_steps)``."""
    sizes = resolve_batch_sizes(cfg, world_size)
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


# -- formatting -----------------------------------------------------------------------------

MEMORY_COLUMNS = ("parameters", "gradients", "master_weights", "optimizer_states", "model_states")
COMM_COLUMNS = ("all_reduce", "reduce_scatter", "all_gather", "control", "total")


def format_table(title: str, columns: tuple[str, ...], rows: list[dict], scale: float = MIB,
                 digits: int = 3) -> str:
    """A plain-text table: one line per rank, one column per key (values divided by ``scale``)."""
    header = ["rank", *columns]
    body = [[str(rank), *(f"{row.get(c, 0) / scale:.{digits}f}" for c in columns)]
            for rank, row in enumerate(rows)]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


# -- training -------------------------------------------------------------------------------

def _mean_over_ranks(value: float, device: torch.device, world: int) -> float:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / world


def run(args: argparse.Namespace) -> int:
    """Train on this rank (inside torchrun, or alone); return the exit code."""
    distributed = init_distributed()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    log = logging.getLogger("zerodp")
    level = log.level
    log.setLevel(logging.WARNING)  # the progress bar shows what the engine's periodic line would
    try:
        return _train(args, rank, world)
    finally:
        log.setLevel(level)
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def _train(args: argparse.Namespace, rank: int, world: int) -> int:
    main_rank = rank == 0
    say = print if main_rank else (lambda *a, **k: None)
    if not main_rank:
        warnings.simplefilter("ignore")
    cfg = build_config(args)
    check_config(cfg, world)

    torch.manual_seed(args.seed)
    model = build_gpt(args.model)
    n_params = model.num_parameters()
    block = model.config.block_size
    corpus = ByteCorpus(max_bytes=args.max_bytes)
    check_args(args, corpus)
    engine, *_ = initialize(model=model, config=cfg, unit_classes=(Block,))  # stage-3 units
    if engine.monitor is not None:
        engine.monitor.tokens_per_sample = block  # every sample is one context of block bytes
    device = engine.device
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    seqs_per_step = micro * gas * world
    tokens_per_step = seqs_per_step * block
    backend = dist.get_backend() if dist.is_initialized() else "none (single process)"

    say(f"zerodp train: GPT {args.model} ({_fmt_params(n_params)} parameters, "
        f"block {block}), ZeRO stage {engine.zero_stage}, world size {world}")
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    say(f"  batch: {micro} micro x {gas} accum x {ranks} = {seqs_per_step} sequences "
        f"= {tokens_per_step} tokens per step; {args.steps} steps")
    say(f"  optimizer: {cfg.optimizer.type} lr {engine.get_lr()[0]:g}"
        f"{', scheduler ' + cfg.scheduler.type if cfg.scheduler else ''}"
        f"{f', clip {cfg.gradient_clipping:g}' if cfg.gradient_clipping else ''}")
    say(f"  precision: {cfg.compute_dtype}" + ("" if cfg.compute_dtype == "fp32" else
        " compute and communication, fp32 master weights"
        + (" and dynamic loss scaling" if cfg.fp16.enabled and cfg.fp16.loss_scale == 0 else "")))
    say(f"  device: {device}, backend {backend}, {torch.get_num_threads()} threads per rank; "
        f"corpus {len(corpus) / MIB:.1f} MiB of Python source ({corpus.num_files} files)")
    sys.stdout.flush()

    save_dir = Path(args.save_dir) if args.save_dir else Path(args.out) / "checkpoints"
    start_step = 0
    losses: list[float] = []
    val_losses: list[tuple[int, float]] = []
    if args.resume:
        path, client = engine.load_checkpoint(save_dir)
        if path is None:
            say(f"  resume: no checkpoint in {save_dir} yet; starting from step 0")
        else:
            start_step = engine.global_steps
            losses = [float(x) for x in client.get("losses", [])][:start_step]
            val_losses = [(int(a), float(b)) for a, b in client.get("val_losses", []) if a <= start_step]
            say(f"  resume: continuing from {path} at step {start_step}")
    sys.stdout.flush()

    def save(step: int) -> None:
        engine.save_checkpoint(save_dir, client_state={"losses": losses, "val_losses": val_losses,
                                                       "args": {"model": args.model, "seed": args.seed}})

    val_gen = torch.Generator().manual_seed(1_000_003 * args.seed + 500_000 + rank)
    val_batches = ([corpus.batch("val", micro, block, val_gen) for _ in range(EVAL_BATCHES_PER_RANK)]
                   if args.eval_every > 0 else [])

    def evaluate() -> float:
        engine.eval()
        with torch.no_grad():
            total = sum(engine(x.to(device), y.to(device))[1].item() for x, y in val_batches)
        engine.train()
        return _mean_over_ranks(total / len(val_batches), device, world)

    bar = None
    if main_rank:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                   file=sys.stderr)
    smoothed = step_time = None
    start = time.perf_counter()
    engine.train()
    try:
        for step in range(start_step + 1, args.steps + 1):
            t0 = time.perf_counter()
            step_loss = 0.0
            gen = step_generator(args.seed, rank, step)
            for _ in range(gas):
                x, y = corpus.batch("train", micro, block, gen)
                _, loss = engine(x.to(device), y.to(device))
                engine.backward(loss)
                engine.step()
                step_loss += loss.item()
            step_loss = _mean_over_ranks(step_loss / gas, device, world)
            synchronize(device)
            dt = time.perf_counter() - t0
            losses.append(step_loss)
            smoothed = step_loss if smoothed is None else 0.9 * smoothed + 0.1 * step_loss
            step_time = dt if step_time is None or step == 2 else 0.9 * step_time + 0.1 * dt
            if args.eval_every and step % args.eval_every == 0 and step != args.steps:
                val_losses.append((step, evaluate()))
                if bar is not None:
                    bar.write(f"step {step}: val loss {val_losses[-1][1]:.4f}")
            if bar is not None:
                norm = engine.get_global_grad_norm()
                bar.set_postfix_str(f"loss={smoothed:.3f} lr={engine.get_lr()[0]:.2e} "
                                    f"gnorm={norm if norm is not None else float('nan'):.3f} "
                                    f"tok/s={tokens_per_step / step_time:,.0f}", refresh=False)
                bar.update(1)
            if args.save_interval and step % args.save_interval == 0 and step != args.steps:
                save(step)
        if args.eval_every and start_step < args.steps:
            val_losses.append((args.steps, evaluate()))
        if start_step < args.steps:
            save(args.steps)
        engine.wait_for_checkpoint()
    finally:
        if bar is not None:
            bar.close()
        if engine.monitor is not None:
            engine.monitor.close()
    elapsed = time.perf_counter() - start

    memory = [{k: int(v) for k, v in row.items()}
              for row in all_gather_numbers(engine.memory_breakdown(), device=engine.device)]
    estimated = {c.category: c.estimated for c in compare_with_engine(engine)}  # rank 0's share
    comm = [{k: int(v) for k, v in row.items()}
            for row in all_gather_numbers(engine.comm_stats(), device=engine.device)]
    if not main_rank:
        return 0

    window = max(1, min(LOSS_WINDOW, len(losses) // 2))
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    final_val = val_losses[-1][1] if val_losses else None
    print()
    print(format_table("Model-state memory per rank (MiB)", MEMORY_COLUMNS, memory))
    print("estimate for rank 0 (zerodp estimate's ZeRO accounting, no padding): " + ", ".join(
        f"{c} {estimated[c] / MIB:.3f}" for c in MEMORY_COLUMNS if estimated.get(c) is not None))
    print()
    print(format_table(f"Communication per optimizer step, bytes sent per rank (MiB; "
                       f"ring-algorithm count, {gas} micro-batch{'es' if gas > 1 else ''})",
                       COMM_COLUMNS, comm))
    print()
    print(f"train loss: {first:.4f} (mean of first {window} steps) -> {last:.4f} "
          f"(mean of last {window} steps)")
    print(f"val loss:   {final_val:.4f}" if final_val is not None else
          "val loss:   not evaluated (--eval-every 0)")
    ran = args.steps - start_step
    print(f"time: {elapsed:.1f} s for {ran} steps{f' (resumed at step {start_step})' if start_step else ''}, "
          f"{tokens_per_step * ran / max(elapsed, 1e-9):,.0f} tokens/s overall")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"checkpoint: {save_dir / ('global_step' + str(args.steps))}")
    weights, samples = write_weights_and_samples(args.model, args.seed, save_dir, out)
    print(f"weights: {weights} (load with GPT.load_state_dict; zerodp consolidate writes the same "
          "from any checkpoint)")
    print(f"samples from the trained model ({out / 'samples.txt'}):")
    for text in samples:
        print("  | " + text.replace("\n", "\n  | "))
    summary = {
        "model": args.model, "parameters": n_params, "world_size": world,
        "zero_stage": engine.zero_stage, "device": str(device), "backend": backend,
        "micro_batch": micro, "grad_accum": gas, "train_batch_size": engine.train_batch_size(),
        "block_size": block, "steps": args.steps, "seed": args.seed,
        "config": cfg.model_dump(mode="json"),
        "losses": losses, "first_loss": first, "last_loss": last,
        "val_losses": [{"step": s, "loss": v} for s, v in val_losses], "final_val_loss": final_val,
        "elapsed_s": elapsed, "tokens_per_s": tokens_per_step * ran / max(elapsed, 1e-9),
        "resumed_at_step": start_step, "samples": samples,
        "memory_bytes": memory, "comm_bytes_per_step": comm,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"summary: {out / 'summary.json'}")
    if engine.monitor is not None and engine.monitor.csv_path is not None:
        print(f"metrics: {engine.monitor.csv_path} (draw charts with: zerodp plot "
              f"{engine.monitor.csv_path.parent})")
    return 0


def write_weights_and_samples(model_name: str, seed: int, save_dir: Path, out: Path) -> tuple[Path, list[str]]:
    """Consolidate the newest checkpoint into ``out/model.safetensors``, load it into a plain GPT
    (``strict=True``) and sample a line of text from each of a few prompts into
    ``out/samples.txt``; returns the weights' path and the samples."""
    from ..checkpoint import consolidate
    from ..checkpoint.tensorfile import load_file
    consolidate(save_dir, out)
    weights = out / "model.safetensors"
    model = build_gpt(model_name)
    model.load_state_dict(load_file(weights), strict=True)
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for prompt in SAMPLE_PROMPTS:
        idx = torch.tensor([list(prompt.encode())], dtype=torch.long)
        seq = model.generate(idx, SAMPLE_BYTES, generator=gen)[0].tolist()
        text = bytes(seq).decode("utf-8", errors="replace")
        samples.append("\n".join(text.splitlines()[:3]))
    (out / "samples.txt").write_text("\n\n".join(samples) + "\n", encoding="utf-8")
    return weights, samples


def step_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """The generator of rank ``rank``'s training batches in step ``step``: a function of the
    three alone, so a resumed run draws the batches the interrupted one would have."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{rank}/{step}".encode()))


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``python -m zerodp.tools.train`` (one rank; see ``zerodp train``)."""
    parser = argparse.ArgumentParser(
        prog="python -m zerodp.tools.train",
        description="One rank of `zerodp train` (run it under torchrun, or use `zerodp train`).")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ConfigError, UsageError) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"zerodp train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0" and os.environ.get(WORKER_ENV) != "1":
            print("zerodp train: interrupted", file=sys.stderr)  # (the launcher says it otherwise)
        return 130


if __name__ == "__main__":
    code = main()
    if os.environ.get(WORKER_ENV) == "1":
        # A launched rank: its work is done and reported, the process group destroyed;
        # skip the interpreter's slow teardown of torch's modules.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

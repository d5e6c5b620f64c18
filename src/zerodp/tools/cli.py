"""The ``zerodp`` command line.

``zerodp <command> [options]``; each command is an entry of :data:`COMMANDS`: a help line,
a function that adds its options to an ``argparse`` sub-parser, and a function that runs it
and returns the exit code.

``zerodp train`` launches ``python -m torch.distributed.run --standalone --nproc-per-node N
-m zerodp.tools.train ...`` underneath (``zerodp.tools.train`` is the per-rank worker) and returns its
exit code; with ``--nproc 1`` it trains in this process. ``zerodp launch`` runs any training
script the way DeepSpeed's ``deepspeed`` launcher does, on torchrun (``zerodp.tools.launch``).

Exit codes: 0 success, 2 usage or configuration error (message, no traceback), 130
interrupted, otherwise the failing training run's code.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

from . import generate, launch
from .launch import PROG

__all__ = ["main", "build_parser", "COMMANDS", "Command"]


@dataclass(frozen=True)
class Command:
    """One ``zerodp`` subcommand."""

    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _error(message: str, command: str = "train") -> None:
    launch.error(message, command)


# -- zerodp train ---------------------------------------------------------------------------

def _train_add_arguments(parser: argparse.ArgumentParser) -> None:
    from . import train
    train.add_arguments(parser)


def _worker_env(nproc: int) -> dict[str, str]:
    from . import train
    return {**launch.torchrun_env(nproc), train.WORKER_ENV: "1"}


def _run_train(args: argparse.Namespace) -> int:
    from ..config import ConfigError
    from . import train

    if os.environ.get(train.WORKER_ENV) == "1":  # already one of the launched ranks
        return train.main(train.to_argv(args))
    if args.max_restarts:
        args.resume = True  # a restart goes on from the last checkpoint
    try:
        train.check_args(args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rank 0 reports unknown keys once
            train.check_config(train.build_config(args), args.nproc)
    except (ConfigError, train.UsageError) as e:
        _error(str(e))
        return 2
    if args.out:
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as e:
            _error(f"--out: cannot create directory {args.out!r}: {e.strerror or e}")
            return 2
    if args.nproc == 1 and not args.max_restarts:
        return train.main(train.to_argv(args))

    restarts = ["--max-restarts", str(args.max_restarts)] if args.max_restarts else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *restarts,
           "--nproc-per-node", str(args.nproc), "-m", "zerodp.tools.train", *train.to_argv(args)]
    return launch.run_torchrun(cmd, _worker_env(args.nproc), "train", "training")


# -- zerodp plot ----------------------------------------------------------------------------

def _plot_add_arguments(parser: argparse.ArgumentParser) -> None:
    from . import plot
    plot.add_arguments(parser)


def _run_plot(args: argparse.Namespace) -> int:
    from . import plot
    return plot.run(args)


# -- zerodp estimate ------------------------------------------------------------------------

def _estimate_add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``zerodp estimate``; values are checked by ``zerodp.estimator`` so that bad
    input gets a one-line message and exit code 2."""
    from ..estimator import ACCOUNTINGS, OPTIMIZERS, PRECISIONS
    add = parser.add_argument
    add("--model", required=True, help="a parameter count (8B, 7.5B, 350M, 125K), a transformers "
        "config (config.json or its directory), or a factory 'module:function' (built on the meta "
        "device, e.g. zerodp.examples.gpt:build_gpt)")
    add("--model-kwargs", default=None, metavar="JSON",
        help='keyword arguments for a factory, a JSON object (e.g. \'{"preset": "small"}\')')
    add("--nodes", default="1", help="number of nodes (default 1)")
    add("--ranks-per-node", "--gpus-per-node", dest="ranks_per_node", default=None,
        help="ranks (devices) per node (default 1; with --search, the cluster's devices per node)")
    add("--tp", default="1", help="tensor-parallel size: each layer split over this many ranks, ZeRO "
        "sharding over the rest (default 1)")
    add("--pp", default="1", help="pipeline stages: each holds its share of the layers (an even split), ZeRO "
        "sharding over the data-parallel ranks of the stage (default 1)")
    add("--virtual-stages", default="1", metavar="V", help="the interleaved 1F1B schedule: V chunks of layers "
        "per pipeline stage (pipeline.schedule Interleaved1F1B, PipelineModule(virtual_stages=V)): a bubble "
        "of (pp-1)/V micro-batches, V times the point-to-point sends (default 1: 1F1B)")
    add("--hybrid-shard", default=None, metavar="N", help="hybrid sharding (MiCS): ZeRO shards every state over "
        "groups of N data-parallel ranks and replicates across them (mics_shard_size)")
    add("--hpz", default=None, metavar="K", help="ZeRO++ hpZ at stage 3 (zero_hpz_partition_size): states over every "
        "data-parallel rank, plus a 16-bit secondary copy of the parameters over groups of K ranks (a node) that "
        "backward's and later micro-batches' gathers read")
    add("--device-memory", default=None, help="memory per device, e.g. 80GB or 24GiB; without it "
        "nothing is checked for fit")
    add("--cpu-memory", default=None, help="CPU memory per node for the offload rows, e.g. 512GB "
        "(default: not checked)")
    add("--precision", default="bf16", help=f"{', '.join(PRECISIONS)} (default bf16)")
    add("--optimizer", default="adamw", help=f"{', '.join(OPTIMIZERS)} (default adamw)")
    add("--accounting", default=None, help=f"{', '.join(ACCOUNTINGS)}: mixed = 16-bit params and "
        "grads + fp32 master + fp32 optimizer states (the ZeRO paper's); no-master = without the "
        "fp32 master copy; fp32 = fp32 training (default: mixed for bf16/fp16, fp32 for fp32)")
    add("--micro-batch", default=None, help="micro-batch per rank for activations (default 1)")
    add("--seq-len", "--seq", dest="seq_len", default=None, help="sequence length (default: the model's "
        "context length)")
    add("--checkpointing", action="store_true",
        help="activation checkpointing: keep each layer's input, recompute one layer at a time")
    add("--sp", default="1", metavar="N", help="Ulysses sequence parallelism (sequence_parallel_size): groups of "
        "N ranks share each sequence, each holding seq/N tokens of activations; ZeRO shards over all the "
        "data-parallel ranks, these included (default 1)")
    add("--ep", default="1", metavar="N", help="expert parallelism (expert_parallel.autoep_size): each rank of a group "
        "of N holds 1/N of a mixture-of-experts model's experts whole; expert states shard over the ranks holding "
        "the same experts (default 1)")
    add("--tiled", action="store_true", help="ALST's tiled MLP and tiled logits-and-loss: the MLP keeps its input "
        "and one tile's intermediates, the loss one tile's logits")
    add("--offload-activations", action="store_true", help="with --checkpointing: the layers' inputs wait in host "
        "memory (activation_checkpointing.cpu_checkpointing)")
    add("--fused-attention", action="store_true", help="activations without the attention scores, as with "
        "flash attention or scaled_dot_product_attention (default: counted, an upper bound)")
    add("--reduce-bucket-size", default=None, help="zero_optimization.reduce_bucket_size in "
        "elements (default as in the config schema)")
    add("--max-live-parameters", default=None, help="zero_optimization.stage3_max_live_parameters "
        "in elements (default as in the config schema)")
    add("--time", action="store_true", help="also predict each configuration's step time on --cluster and "
        "recommend the fastest that fits (docs/estimate.md)")
    add("--cluster", default=None, metavar="NAME|FILE.json", help="the machines for --time: a preset "
        "(v100-dgx2, a100-80gb-8x, h100-8x, h200-8x), 'local' (this machine, probed in seconds, cached) or a "
        "JSON file of the same fields; sets --device-memory and --cpu-memory unless given")
    add("--recalibrate", action="store_true", help="with --cluster local: probe again instead of the cache")
    add("--gradient-accumulation", "--gas", dest="gradient_accumulation", default="1",
        help="micro-batches per optimizer step, for --time (default 1)")
    add("--search", action="store_true", help="with --time: try every tensor x pipeline x data-parallel split, "
        "micro-batch (1-16) and activation checkpointing for --global-batch, and rank the layouts that fit")
    add("--global-batch", default=None, help="sequences per optimizer step, for --search")
    add("--json", action="store_true", help="print a JSON document instead of the table")


def _run_estimate(args: argparse.Namespace) -> int:
    import json

    from .. import estimator
    defaults = {}
    if args.reduce_bucket_size is not None:
        defaults["reduce_bucket_size"] = args.reduce_bucket_size
    if args.max_live_parameters is not None:
        defaults["max_live_parameters"] = args.max_live_parameters
    if args.time and args.cluster is None:
        _error("--time needs --cluster (a preset, 'local' or a JSON file)", "estimate")
        return 2
    if args.cluster is not None and not args.time:
        _error("--cluster is for --time: add --time", "estimate")
        return 2
    if args.search:
        return _run_search(args, defaults)
    if args.time:
        defaults.update(cluster=args.cluster, gradient_accumulation=args.gradient_accumulation,
                        recalibrate=args.recalibrate)
    try:
        result = estimator.estimate(
            args.model, model_kwargs=args.model_kwargs, nodes=args.nodes,
            ranks_per_node=args.ranks_per_node or "1", device_memory=args.device_memory,
            cpu_memory=args.cpu_memory, precision=args.precision, optimizer=args.optimizer,
            accounting=args.accounting, micro_batch=args.micro_batch, seq_len=args.seq_len,
            checkpointing=args.checkpointing, fused_attention=args.fused_attention, tp=args.tp, pp=args.pp,
            virtual_stages=args.virtual_stages,
            shard_size=None if args.hybrid_shard is None else args.hybrid_shard, hpz=args.hpz, sp=args.sp,
            tiled=args.tiled, offload_activations=args.offload_activations, ep=args.ep, **defaults)
    except estimator.EstimateError as e:
        _error(f"--{e.name.replace('_', '-')}: {e.detail}", "estimate")
        return 2
    try:
        print(json.dumps(result.to_dict(), indent=2) if args.json else result.format(), flush=True)
    except BrokenPipeError:  # the reader stopped early (e.g. piped into head): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _run_search(args: argparse.Namespace, defaults: dict) -> int:
    import json

    from .. import estimator
    from ..estimator.search import rank_layouts
    if args.global_batch is None or args.seq_len is None:
        _error("--search needs --global-batch and --seq", "estimate")
        return 2
    try:
        found = rank_layouts(args.model, model_kwargs=args.model_kwargs, cluster=args.cluster, nodes=args.nodes,
                             ranks_per_node=args.ranks_per_node, global_batch=args.global_batch, seq_len=args.seq_len,
                             recalibrate=args.recalibrate, device_memory=args.device_memory,
                             cpu_memory=args.cpu_memory, precision=args.precision, optimizer=args.optimizer,
                             accounting=args.accounting, fused_attention=args.fused_attention, **defaults)
    except estimator.EstimateError as e:
        _error(f"--{e.name.replace('_', '-')}: {e.detail}", "estimate")
        return 2
    print(json.dumps(found.to_dict(), indent=2) if args.json else found.format(), flush=True)
    return 0


# -- zerodp consolidate ---------------------------------------------------------------------

def _consolidate_add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("checkpoint", metavar="CKPT_DIR",
        help="a checkpoint directory (its 'latest' file names the tag) or a tag directory; "
             "written by zerodp or by DeepSpeed, at any world size and stage")
    add("output", metavar="OUT", help="directory to write the weights to (created if missing)")
    add("--tag", default=None, help="the tag to consolidate (default: the one 'latest' names)")
    add("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
        help="dtype of the floating-point tensors written (default: as stored, fp32 for trained "
             "parameters)")
    add("--max-shard-size", default="5GB", metavar="SIZE",
        help="largest file; above it the weights are split into model-0000k-of-0000n.safetensors "
             "files with a model.safetensors.index.json, as transformers writes them "
             "(default: %(default)s)")
    add("--exclude-frozen", action="store_true", help="leave out parameters the optimizer did not train")


def _run_consolidate(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError, consolidate
    from ..checkpoint.consolidate import parse_size
    try:
        parse_size(args.max_shard_size)
    except ValueError as e:
        _error(f"--max-shard-size: {e}", "consolidate")
        return 2
    try:
        files = consolidate(args.checkpoint, args.output, tag=args.tag, dtype=args.dtype,
                            max_shard_size=args.max_shard_size, progress=True,
                            exclude_frozen_parameters=args.exclude_frozen)
    except (CheckpointError, OSError) as e:
        _error(str(e), "consolidate")
        return 1
    for f in files:
        print(f)
    return 0


# -- zerodp generate ------------------------------------------------------------------------

COMMANDS: dict[str, Command] = {
    "train": Command(
        help="train the example GPT with a ZeRO stage on N local processes",
        description=(
            "Train the example byte-level GPT on Python standard-library source with a ZeRO "
            "data-parallel engine on N local processes (torchrun underneath; CUDA + NCCL when "
            "GPUs are present, else CPU + gloo). Rank 0 shows a progress bar (smoothed loss, "
            "learning rate, gradient norm, global tokens/s), then per-rank model-state memory "
            "and per-step communication tables and the first/last train loss and final "
            "validation loss."),
        add_arguments=_train_add_arguments,
        run=_run_train,
    ),
    "launch": Command(
        help="run a training script on N local processes, as DeepSpeed's 'deepspeed' launcher does",
        description=(
            "Run a training script on N processes of this node with DeepSpeed's launcher options: "
            "'zerodp launch --num_gpus 2 train.py --deepspeed ds_config.json' is 'deepspeed "
            "--num_gpus 2 train.py --deepspeed ds_config.json'. torchrun underneath sets RANK, "
            "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; each process runs the script as "
            "__main__ with --local_rank=<local rank> right after the script name, where DeepSpeed "
            "puts it. The exit code is torchrun's (130 on Ctrl-C). Multi-node runs are started "
            "with torchrun."),
        add_arguments=launch.add_arguments,
        run=launch.run,
    ),
    "consolidate": Command(
        help="write a checkpoint's full weights as safetensors (zerodp or DeepSpeed checkpoints)",
        description=(
            "Write the full weights of a sharded checkpoint (zerodp's, at any world size and "
            "stage, or DeepSpeed's ZeRO 1-3) as safetensors files that load with "
            "load_state_dict(strict=True) or transformers' from_pretrained. Tensors are streamed "
            "a few MB at a time, so memory stays flat whatever the model size."),
        add_arguments=_consolidate_add_arguments,
        run=_run_consolidate,
    ),
    "generate": Command(
        help="continue a prompt with the example GPT, its weights streamed from disk (ZeRO-Inference)",
        description=(
            "Generate text with the example GPT from a checkpoint or safetensors weights, keeping the "
            "weights in the files: each large module's weights come to the device just before it runs "
            "(the next one read ahead) and leave after, so at most two modules' weights are in memory "
            "at once. The Python API, zerodp.inference.stream, does the same for any model built in "
            "zerodp.zero.Init(meta=True), transformers causal LMs included."),
        add_arguments=generate.add_arguments,
        run=generate.run,
    ),
    "plot": Command(
        help="draw charts (loss, learning rate, memory per stage) from runs' metrics CSV files",
        description=(
            "Draw PNG charts from the metrics.csv that the csv_monitor config block (or zerodp "
            "train --metrics-dir) writes: loss and learning rate per step, memory by category "
            "over the steps, and one stacked bar per run of the parameters, gradients, "
            "optimizer states and master weights held per rank, labelled by ZeRO stage and "
            "world size (e.g. zerodp plot runs/zero0 runs/zero1 runs/zero2 runs/zero3). "
            "Needs matplotlib (pip install matplotlib)."),
        add_arguments=_plot_add_arguments,
        run=_run_plot,
    ),
    "estimate": Command(
        help="estimate per-rank memory of ZeRO stages 0-3 and recommend one",
        description=(
            "Estimate the memory every rank holds at ZeRO stages 0-3, without and with offload to "
            "CPU: parameters, gradients, fp32 master weights and optimizer states, gradient "
            "buckets, stage-3 gathered parameters and, for known transformer shapes, activations. "
            "Says which configurations fit the device memory and recommends the fastest that "
            "does. The model is a parameter count, a transformers config or a factory, built on "
            "the meta device (nothing is allocated)."),
        add_arguments=_estimate_add_arguments,
        run=_run_estimate,
    ),
    "simulate": Command(
        help="run one rank of an N-rank job in this process (a fake process group) and measure it",
        description=(
            "Play rank r of N with torch's fake process group: collectives return at once, every "
            "allocation is real. Builds the model as that rank would (stage 3: only its shard, one unit "
            "at a time), runs the engine for --steps optimizer steps on a tiny batch and prints the "
            "last one's memory by category, its peak, and the collectives and bytes per step, beside "
            "'zerodp estimate' for the same job."),
        add_arguments=lambda p: _simulate().add_arguments(p),
        run=lambda a: _simulate().run(a),
    ),
}


def _simulate():
    from .simulate import command
    return command


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="zerodp: ZeRO data-parallel training for PyTorch with DeepSpeed-compatible "
                    "configs.",
        epilog="Run 'zerodp <command> --help' for the options of a command.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>", title="commands")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.description)
        command.add_arguments(p)
        p.set_defaults(_run=command.run)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the ``zerodp`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args._run(args)
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

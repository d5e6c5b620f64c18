"""``zerodp simulate``'s options and what it prints (``tools/cli.py`` adds the command)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from ...estimator import EstimateError
from ...parallel import GridError, TensorParallelError
from .report import format_simulation
from .run import OFFLOADS, PRECISIONS, simulate

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", required=True, help="a transformers config (config.json or its directory) or a factory "
        "'module:function' (e.g. zerodp.examples.gpt:build_gpt); built so that this rank holds only its share")
    add("--model-kwargs", default=None, metavar="JSON", help="keyword arguments for a factory, a JSON object")
    add("--world", type=int, required=True, help="ranks in the simulated job (N)")
    add("--rank", type=int, default=0, help="the rank this process plays (default 0)")
    add("--stage", type=int, required=True, help="ZeRO stage, 0-3")
    add("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    add("--pp", type=int, default=1, help="pipeline stages (default 1); a transformers decoder-only config is "
        "split into stages by parameter counts and the rank's stage runs as a one-stage pipeline over its "
        "data x tensor ranks (docs/estimate.md)")
    add("--sp", type=int, default=1, help="Ulysses sequence parallelism: groups of N ranks share each sequence, "
        "the rank runs seq/N tokens (a transformers config; default 1)")
    add("--ep", type=int, default=1, help="expert parallelism: groups of N ranks each hold experts/N experts of "
        "every layer, whole (a transformers MoE config; every rank routes as the simulated one; default 1)")
    add("--precision", default="bf16", choices=list(PRECISIONS), help="default bf16")
    add("--offload", default="none", choices=list(OFFLOADS), help="what moves to CPU memory (default none)")
    add("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    add("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    add("--steps", type=int, default=2, help="optimizer steps run; the last is measured (default 2: the first "
        "creates the optimizer states and records the order stage 3 prefetches in)")
    add("--config", default=None, metavar="JSON_FILE", help="a DeepSpeed-style config to start from (bucket "
        "sizes, stage3_* keys, zero_hpz_partition_size); the options above override its stage, precision, "
        "offload and batch")
    add("--json", action="store_true", help="print a JSON document instead of the table")


def run(args: argparse.Namespace) -> int:
    from .. import launch
    try:
        kwargs = json.loads(args.model_kwargs) if args.model_kwargs else None
        config = None
        if args.config:
            with open(args.config) as f:
                config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        launch.error(f"{'--config' if args.config else '--model-kwargs'}: {e}", "simulate")
        return 2
    progress = None if args.json else (lambda m: print(f"[simulate] {m}", file=sys.stderr, flush=True))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            sim = simulate(args.model, world=args.world, rank=args.rank, stage=args.stage, tp=args.tp, pp=args.pp,
                           precision=args.precision, offload=args.offload, micro_batch=args.micro_batch,
                           seq=args.seq, steps=args.steps, model_kwargs=kwargs, config=config, sp=args.sp, ep=args.ep,
                           progress=progress)
    except EstimateError as e:
        launch.error(f"--{e.name.replace('_', '-')}: {e.detail}", "simulate")
        return 2
    except (TensorParallelError, GridError) as e:  # the grid or the split cannot be made as asked
        launch.error(f"--tp/--pp: {e}", "simulate")
        return 2
    try:
        print(json.dumps(sim.to_dict(), indent=2) if args.json else format_simulation(sim), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0

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

The options and the config are in ``train_options.py``; this module is the training loop and its
report.
"""
# ruff: noqa: F401 - the options' names stay importable from here
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .. import initialize
from ..config import ConfigError
from ..core.collectives import Comm, all_gather_numbers
from ..core.device import init_distributed, synchronize
from ..examples.gpt import Block, ByteCorpus, build_gpt
from .memory_check import compare_with_engine
from .train_options import (
    DEFAULT_EVAL_EVERY,
    DEFAULT_GRAD_ACCUM,
    DEFAULT_LR,
    DEFAULT_MAX_BYTES,
    DEFAULT_MICRO_BATCH,
    DEFAULT_MODEL,
    DEFAULT_OUT,
    DEFAULT_PRESET,
    DEFAULT_SAVE_INTERVAL,
    DEFAULT_STEPS,
    MODELS,
    UsageError,
    add_arguments,
    build_config,
    check_args,
    check_config,
    to_argv,
)

__all__ = ["add_arguments", "to_argv", "check_args", "build_config", "check_config", "format_table",
           "run", "main", "UsageError", "WORKER_ENV"]

#: Environment variable set by ``zerodp train`` for the processes it launches.
WORKER_ENV = "ZERODP_TRAIN_WORKER"

SAMPLE_PROMPTS = ("def ", "import ", "class ")
SAMPLE_BYTES = 120
EVAL_BATCHES_PER_RANK = 4
LOSS_WINDOW = 10
MIB = 1024.0 * 1024.0


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
    Comm(None, "train").all_reduce_sum(t)
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
    dp, dp_rank = engine.dp_world_size, engine.dp_rank  # tensor-parallel ranks of a group share batches
    seqs_per_step = micro * gas * dp
    tokens_per_step = seqs_per_step * block
    backend = dist.get_backend() if dist.is_initialized() else "none (single process)"

    say(f"zerodp train: GPT {args.model} ({_fmt_params(n_params)} parameters, "
        f"block {block}), ZeRO stage {engine.zero_stage}, world size {world}"
        + (f" ({engine.grid.describe()})" if not engine.grid.only_data else ""))
    ranks = f"{dp} {'data-parallel ' if dp != world else ''}rank{'s' if dp > 1 else ''}"
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

    val_gen = torch.Generator().manual_seed(1_000_003 * args.seed + 500_000 + dp_rank)
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
            gen = step_generator(args.seed, dp_rank, step)
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
    # the kinds every run has, then any other one this run used (Muon's exchange, all-to-alls), then the total
    more = tuple(k for k in comm[0] if k not in COMM_COLUMNS and any(row.get(k, 0) for row in comm))
    print(format_table(f"Communication per optimizer step, bytes sent per rank (MiB; "
                       f"ring-algorithm count, {gas} micro-batch{'es' if gas > 1 else ''})",
                       COMM_COLUMNS[:-1] + more + COMM_COLUMNS[-1:], comm))
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

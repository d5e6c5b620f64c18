"""``zerodp generate``: continue a prompt with the example GPT, its weights streamed from a
checkpoint or safetensors files (ZeRO-Inference, ``zerodp.inference``)."""
from __future__ import annotations

import argparse
import sys


def _error(message: str) -> None:
    print(f"zerodp generate: error: {message}", file=sys.stderr)



def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("weights", metavar="CKPT_OR_WEIGHTS",
        help="a checkpoint directory (zerodp's or DeepSpeed's; consolidated into a temporary "
             "directory first), or a .safetensors file or directory of them (zerodp consolidate)")
    add("--model", default="small", help="example GPT preset the weights belong to (default: %(default)s)")
    add("--model-kwargs", default=None, metavar="JSON", help="GPT config overrides, e.g. '{\"n_layer\": 12}'")
    add("--prompt", default="def ", help="text to continue (UTF-8 bytes; default: %(default)r)")
    add("--max-new-tokens", type=int, default=64, help="bytes to generate (default: %(default)s)")
    add("--temperature", type=float, default=0.8, help="sampling temperature (default: %(default)s)")
    add("--top-k", type=int, default=40, help="sample from the k most likely bytes (default: %(default)s)")
    add("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    add("--threshold", type=int, default=None,
        help="modules with at least this many parameter elements are streamed (default: 100000)")


def run(args: argparse.Namespace) -> int:
    import json
    import tempfile
    from pathlib import Path

    import torch

    from .. import inference, zero
    from ..examples.gpt import build_gpt
    try:
        kwargs = json.loads(args.model_kwargs) if args.model_kwargs else {}
        with zero.Init(meta=True):  # no weight held: they stay in the files
            model = build_gpt(args.model, **kwargs).eval()
    except (ValueError, TypeError) as e:
        _error(str(e))
        return 2
    src = Path(args.weights)
    with tempfile.TemporaryDirectory() as tmp:
        if src.is_dir() and not any(src.glob("*.safetensors")):  # a checkpoint: consolidate it first
            from ..checkpoint import CheckpointError, consolidate
            try:
                consolidate(src, tmp)
            except (CheckpointError, OSError) as e:
                _error(str(e))
                return 1
            src = Path(tmp)
        try:
            extra = {} if args.threshold is None else {"threshold": args.threshold}
            streamed = inference.stream(model, src, **extra)
        except (FileNotFoundError, KeyError, ValueError) as e:
            _error(str(e))
            return 1
        idx = torch.tensor([list(args.prompt.encode("utf-8")) or [10]], dtype=torch.long, device=streamed.device)
        out = streamed.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                generator=torch.Generator(device=streamed.device).manual_seed(args.seed))
    print(bytes(out[0].tolist()).decode("utf-8", errors="replace"))
    note = "" if streamed.streamed else " (no module reaches --threshold: every weight stays loaded)"
    print(f"[zerodp] streamed {len(streamed.streamed)} modules; at most {streamed.peak_streamed_bytes / 2**20:.2f} "
          f"MiB of their weights on the device at once, {streamed.resident_bytes / 2**20:.2f} MiB resident{note}",
          file=sys.stderr)
    return 0

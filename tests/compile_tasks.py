"""Worker tasks for ``test_compile.py``: the example GPT trained compiled and uncompiled at each
stage, with dynamo's counts of what it compiled in each step."""
from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn
from torch._dynamo.utils import counters

import zerodp
from zerodp.examples.gpt import Block, build_gpt

STEPS = 5


class Recomputed(nn.Module):
    """A block whose activations are recomputed in backward (torch's non-reentrant checkpoint)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def compile_counts() -> dict:
    """What dynamo compiled so far in this process: graphs, frames, and the graph breaks by reason
    (the first line of dynamo's explanation)."""
    breaks: dict[str, int] = {}
    for reason, n in counters["graph_break"].items():
        key = reason.strip().split("\n")[0][:100]
        breaks[key] = breaks.get(key, 0) + n
    return {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["total"], "breaks": breaks}


def gpt_run(group, stage: int, how: str, backend: str = "aot_eager", gas: int = 1, units: str = "blocks",
            recompute: bool = False, bf16: bool = False, offload: bool = False, tp: int = 1,
            steps: int = STEPS) -> dict:
    """Train the tiny example GPT ``steps`` optimizer steps at ``stage``; ``how`` it is compiled:
    ``none``, ``engine`` (``engine.compile``), ``before`` (``torch.compile(model)`` before
    ``initialize``), ``inplace`` (``model.compile()`` before it), ``blocks`` (each block compiled in
    place before ``initialize``) or ``wrapped``
    (each block replaced by ``torch.compile(block)``). ``units``: stage 3's units are the blocks
    (``unit_classes``) or every module with parameters (``modules``); ``tp``: the config's
    ``tensor_parallel.autotp_size`` (over the whole world: run at 4 ranks). From the third step on a
    recompilation raises (``error_on_recompile``). Returns the losses and, per step, the compile
    counts (``compile_counts``)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = build_gpt("tiny", dropout=0.0)
    if recompute:
        model.blocks = nn.ModuleList(Recomputed(b) for b in model.blocks)
    if how == "before":
        model = torch.compile(model, backend=backend)
    elif how == "inplace":
        model.compile(backend=backend)
    elif how == "blocks":
        for b in model.blocks:
            b.compile(backend=backend)
    elif how == "wrapped":
        model.blocks = nn.ModuleList(torch.compile(b, backend=backend) for b in model.blocks)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
           "steps_per_print": 10_000, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": zero, "bf16": {"enabled": bf16}, "tensor_parallel": {"autotp_size": tp}}
    try:
        engine, *_ = zerodp.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                       process_group=group if tp == 1 else None,  # tensor parallelism: the world
                                       unit_classes=(Block,) if units == "blocks" else ())
        if how == "engine":
            engine.compile(backend=backend)
    except (ValueError, zerodp.ConfigError) as e:
        return {"error": str(e)}
    g = torch.Generator().manual_seed(engine.get_data_parallel_rank())  # a tensor-parallel group's ranks: the same
    losses, per_step = [], []
    try:
        for step in range(steps):
            torch._dynamo.config.error_on_recompile = step >= 2
            for _ in range(gas):
                idx = torch.randint(0, 256, (2, 24), generator=g)
                _, loss = engine(idx, idx)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            per_step.append(compile_counts())
    finally:
        torch._dynamo.config.error_on_recompile = False
    out = {"losses": losses, "per_step": per_step, "compiled": engine.is_compiled,
           "units": len(engine.sharded.units) if engine.sharded is not None else 0}
    engine.destroy()
    return out

"""Pipeline parallelism under ZeRO against one process.

The model is a ``PipelineModule`` of small layers (an embedding tied to the output layer by a
``TiedLayerSpec``, residual MLP blocks, a norm), built with ``seed_layers`` so every layer starts
from the same values however the layers are split. The reference builds the same module as one
stage in one process and trains it on the whole global batch: every data-parallel rank's
micro-batches, the mean loss, torch's optimizer, the same global-norm clipping.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from tp_tasks import whole_params  # every stage's parameters, tensor slices put together

import zerodp
from zerodp.pipe import LayerSpec, PipelineModule, TiedLayerSpec

VOCAB, DIM, SEQ, MICRO = 32, 16, 6, 2
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
ADAMW = {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}
MUON = {"muon_lr": 0.02, "adam_lr": 0.01, "momentum": 0.9, "weight_decay": 0.1}
OPTIMIZERS = {"SGD": (torch.optim.SGD, SGD), "AdamW": (torch.optim.AdamW, ADAMW), "Muon": (None, MUON)}


class Block(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def embed_out(embedding: nn.Embedding, x):
    """The tied embedding used as the output layer."""
    return F.linear(x, embedding.weight)


def layers(blocks: int = 4, tied: bool = True) -> list:
    out = [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM) if tied else LayerSpec(nn.Embedding, VOCAB, DIM)]
    out += [LayerSpec(Block) for _ in range(blocks)]
    out.append(LayerSpec(nn.LayerNorm, DIM))
    out.append(TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=embed_out) if tied
               else LayerSpec(nn.Linear, DIM, VOCAB))
    return out


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))


def build(num_stages: int, blocks: int = 4, tied: bool = True, virtual: int = 1,
          checkpoint_every: int = 0) -> PipelineModule:
    return PipelineModule(layers(blocks, tied), num_stages=num_stages, loss_fn=loss_fn, seed_layers=True,
                          base_seed=7, partition_method="uniform", virtual_stages=virtual,
                          activation_checkpoint_interval=checkpoint_every)


def micro_batch(step: int, dp_rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * dp_rank + micro)
    x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def config(stage: int, gas: int, schedule: str, clip: float = 0.5, optimizer: str = "SGD",
           dtype: str = "fp32", tp: int = 0, offload: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "gradient_clipping": clip, "steps_per_print": 10**6,
           "optimizer": {"type": optimizer, "params": dict(OPTIMIZERS[optimizer][1])},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 600,
                                 "stage3_param_persistence_threshold": 50},
           "pipeline": {"schedule": schedule}}
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if tp:
        cfg["tensor_parallel"] = {"autotp_size": tp, "partition_config": {"layer_specs": [
            {"patterns": [r"\.up\.weight$"], "partition_type": "column"},
            {"patterns": [r"\.down\.weight$"], "partition_type": "row"}]}}
    return cfg


def reference(dp, steps: int, gas: int, clip: float = 0.5, optimizer: str = "SGD", blocks: int = 4,
              tied: bool = True) -> dict:
    model = build(1, blocks, tied)
    dp_of = dp if isinstance(dp, list) else [dp] * steps
    cls, hyper = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **{k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()})
    norms, losses = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        parts = [loss_fn(model(x), y) for r in range(dp_of[step])
                 for x, y in (micro_batch(step, r, m) for m in range(gas))]
        loss = sum(parts) / len(parts)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf).item())
        opt.step()
        losses.append(loss.item())
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms,
            "losses": losses}


def train(group, pp: int, stage: int, steps: int, gas: int, schedule: str = "1F1B", clip: float = 0.5,
          optimizer: str = "SGD", dtype: str = "fp32", virtual: int = 1, tp: int = 0, tied: bool = True,
          checkpoint_every: int = 0, save_to: str | None = None, offload: bool = False, compiled: bool = False) -> dict:
    """Worker task on every rank of the world: ``steps`` calls of ``train_batch``; ``compiled``: after
    ``engine.compile(backend="aot_eager")``."""
    model = build(pp, tied=tied, virtual=virtual, checkpoint_every=checkpoint_every)
    engine, _, _, _ = zerodp.initialize(model=model, config=config(stage, gas, schedule, clip, optimizer, dtype, tp,
                                                                   offload))
    if compiled:
        torch._dynamo.reset()
        counters.clear()
        engine.compile(backend="aot_eager")
    calls = [0]
    for m in model.modules():
        if isinstance(m, Block):
            m.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    losses, norms = [], []
    for step in range(steps):
        it = iter([micro_batch(step, engine.dp_rank, m) for m in range(gas)])
        losses.append(engine.train_batch(it).item())
        norms.append(engine.get_global_grad_norm())
    if save_to:
        engine.save_checkpoint(save_to)
    out = {"params": whole_params(engine), "losses": losses, "norms": norms, "stage": engine.stage_id,
           "first": engine.is_first_stage(), "last": engine.is_last_stage(),
           "comm": engine.comm_stats(by_group=True), "bubble": engine.bubble_fraction,
           "skipped": engine.skipped_steps, "global_steps": engine.global_steps,
           "blocks": sum(isinstance(m, Block) for m in model.modules()), "block_forwards": calls[0],
           "compiled": engine.is_compiled, "graphs": counters["stats"]["unique_graphs"] if compiled else 0}
    engine.destroy()
    return out


def fp16_overflow_on_one_stage(group) -> dict:
    """fp16 on PP2 x DP2: in step 0 an inf appears in one gradient of the last stage only (a hook);
    every stage must skip that step together, then step 1 trains."""
    model = build(2)
    cfg = config(1, 2, "1F1B")
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg)
    poisoned = []
    if engine.is_last_stage() and engine.dp_rank == 0:
        p = next(p for n, p in engine.module.named_parameters() if n.endswith("down.weight"))
        poisoned.append(p.register_hook(lambda g: g * float("inf") if engine.global_steps == 0 else g))
    before = {n: v.clone() for n, v in whole_params(engine).items()}
    scale0 = engine.loss_scale
    engine.train_batch(iter([micro_batch(0, engine.dp_rank, m) for m in range(2)]))
    after0 = whole_params(engine)
    out = {"unchanged": all(bool((after0[n] == before[n]).all()) for n in before),
           "skipped": engine.skipped_steps, "scale_halved": engine.loss_scale == scale0 / 2,
           "overflow": bool(engine.optimizer.overflow)}
    for h in poisoned:
        h.remove()
    engine.train_batch(iter([micro_batch(1, engine.dp_rank, m) for m in range(2)]))
    out["changed_after"] = any(not bool((v == after0[n]).all()) for n, v in whole_params(engine).items())
    out["global_steps"] = engine.global_steps
    engine.destroy()
    return out


def inplace_first_layer(group) -> dict:
    """A stage whose first layer works in place (``ReLU(inplace=True)``) on the activations it
    receives: trained on PP2 x DP2, against the same module in one process."""
    def make(stages):
        torch.manual_seed(3)
        return PipelineModule([nn.Linear(4, 8), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)],
                              num_stages=stages, loss_fn=nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = zerodp.initialize(model=make(2), config=cfg)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)) for _ in range(4)]
    engine.train_batch(iter(data[2 * engine.dp_rank:2 * engine.dp_rank + 2]))
    mine = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    ref = make(1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (sum(nn.functional.mse_loss(ref(x), y) for x, y in data) / 4).backward()
    opt.step()
    want = dict(ref.named_parameters())
    return {"err": max((v - want[n]).abs().max().item() for n, v in mine.items())}


def round_trip(group, path: str, legs: list, gas: int, first_step: int = 0, load_first: bool = False) -> dict:
    """Train and checkpoint through several grids: each leg ``(pp, tp, stage, steps)`` builds a
    fresh ``PipelineModule`` (other initial values than the checkpoint's) on that grid, loads the
    last checkpoint (but the first leg, unless ``load_first``), trains and saves. Returns the last
    leg's parameters, each step's norm and loss."""
    norms, losses, step = [], [], first_step
    for i, (pp, tp, stage, steps) in enumerate(legs):
        torch.manual_seed(100 + i)
        model = PipelineModule(layers(), num_stages=pp, loss_fn=loss_fn, seed_layers=True,
                               base_seed=7 if i == 0 and not load_first else 50 + i, partition_method="uniform")
        engine, _, _, _ = zerodp.initialize(model=model, config=config(stage, gas, "1F1B", tp=tp))
        if i or load_first:
            engine.load_checkpoint(path)
        for _ in range(steps):
            losses.append(engine.train_batch(iter([micro_batch(step, engine.dp_rank, m) for m in range(gas)])).item())
            norms.append(engine.get_global_grad_norm())
            step += 1
        engine.save_checkpoint(path)
        engine.save_16bit_model(f"{path}/16bit-{i}")
        out = {"params": whole_params(engine), "norms": norms, "losses": losses, "stage": engine.stage_id,
               "global_steps": engine.global_steps}
        engine.destroy()
    return out


def eval_batches(group, pp: int, stage: int) -> dict:
    """``eval_batch`` on a freshly built pipeline (every stage returns the mean loss); the loss of
    one process on the same batches for reference."""
    model = build(pp)
    engine, _, _, _ = zerodp.initialize(model=model, config=config(stage, 2, "1F1B"))
    got = engine.eval_batch(iter([micro_batch(9, engine.dp_rank, m) for m in range(2)])).item()
    engine.destroy()
    ref = build(1)
    with torch.no_grad():
        want = sum(loss_fn(ref(x), y) for x, y in (micro_batch(9, engine.dp_rank, m) for m in range(2))).item() / 2
    return {"got": got, "want": want}


def with_metrics(group, path: str) -> dict:
    """PP2 x DP2 with ``csv_monitor``: rank 0's rows."""
    import csv
    cfg = config(1, 4, "GPipe")
    cfg["csv_monitor"] = {"enabled": True, "output_path": path, "job_name": "pp"}
    engine, _, _, _ = zerodp.initialize(model=build(2), config=cfg)
    losses = [engine.train_batch(iter([micro_batch(s, engine.dp_rank, m) for m in range(4)])).item()
              for s in range(2)]
    engine.destroy()
    rows = []
    if dist.get_rank() == 0:
        with open(engine.monitor.csv_path) as f:
            rows = list(csv.DictReader(f))
    return {"rows": rows, "losses": losses}


def equal_stages_memory(group, stage: int) -> dict:
    """Four equal blocks on PP2 x DP2 (two a stage), AdamW in fp32: each rank's ledger after a step."""
    def model():
        return PipelineModule([LayerSpec(Block) for _ in range(4)], num_stages=2, loss_fn=nn.MSELoss(),
                              seed_layers=True, partition_method="uniform")
    cfg = config(stage, 2, "1F1B", optimizer="AdamW")
    cfg["zero_optimization"]["reduce_bucket_size"] = 10**6
    engine, _, _, _ = zerodp.initialize(model=model(), config=cfg)
    g = torch.Generator().manual_seed(engine.dp_rank)
    engine.train_batch(iter([(torch.randn(2, SEQ, DIM, generator=g), torch.randn(2, SEQ, DIM, generator=g))
                             for _ in range(2)]))
    out = {"memory": engine.memory_breakdown(), "total_params": sum(p.numel() for p in Block().parameters()) * 4}
    engine.destroy()
    return out


def activations_by_schedule(group) -> dict:
    """The first step's activation peak on PP2 x DP2 under GPipe and 1F1B, with 4 and 8 micro-batches."""
    out = {}
    for schedule in ("GPipe", "1F1B"):
        for m in (4, 8):
            engine, _, _, _ = zerodp.initialize(model=build(2), config=config(1, m, schedule))
            engine.train_batch(iter([micro_batch(0, engine.dp_rank, i) for i in range(m)]))
            out[f"{schedule}-{m}"] = engine.memory_breakdown()["activations_peak"]
            out["stage"] = engine.stage_id
            engine.destroy()
    return out

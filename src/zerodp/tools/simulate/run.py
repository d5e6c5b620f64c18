"""One simulated step: the fake group, the engine, the batch, the measurements, the estimate."""
from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...core.layout import Layout
from ...estimator import EstimateError, estimate
from . import pipeline
from .build import ModelSpec, build_model, no_initialization
from .tracker import PeakMemory, device_peak

__all__ = ["Simulation", "simulate", "OFFLOADS", "PRECISIONS"]

OFFLOADS = ("none", "optimizer", "optimizer+params")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODEL_STATES = ("parameters", "gradients", "master_weights", "optimizer_states")


@dataclass
class Simulation:
    """What one rank of the simulated job held and moved in one optimizer step (bytes)."""

    model: str
    world: int
    rank: int
    stage: int
    tp: int
    pp: int
    dp: int
    precision: str
    offload: str
    micro_batch: int
    seq: int
    params: int
    """Parameter elements this rank's model has (its tensor slice and pipeline stage), before sharding."""
    categories: dict[str, int]
    """``engine.memory_breakdown()`` after the step: model states, and the peaks of buffers."""
    peak: int
    """The most bytes allocated on the compute device at once during the measured (last) step."""
    at_start: int
    """Bytes allocated on the compute device when the measured step began."""
    collectives: dict[str, dict]
    """Per process group: bytes by kind, ``total`` and ``calls`` (collectives issued)."""
    estimated: dict[str, Optional[int]]
    """``zerodp estimate``'s row for the same job: the same categories, ``model_states``, ``device_total``."""
    seconds: float
    device_peak: Optional[int] = None
    notes: list[str] = field(default_factory=list)
    pipeline_stage: int = 0
    p2p_bytes: int = 0
    sp: int = 1
    """Ulysses sequence-parallel size: the rank ran ``seq / sp`` tokens of each sequence."""
    ep: int = 1
    """Expert-parallel size: the rank held ``E / ep`` experts of each layer, whole."""
    """Bytes this rank's pipeline stage sends point to point per step (computed: activations
    forward, their gradients back), in ``bytes_per_step`` too."""

    @property
    def model_states(self) -> int:
        """Model states, with hpZ's secondary copy at its peak (the update drops a trained group's)."""
        copy = self.categories.get("secondary_parameters_peak", 0)
        return sum(self.categories.get(k, 0) for k in MODEL_STATES) + copy

    @property
    def collectives_per_step(self) -> int:
        return sum(g.get("calls", 0) for g in self.collectives.values())

    @property
    def bytes_per_step(self) -> int:
        return sum(g.get("total", 0) for g in self.collectives.values()) + self.p2p_bytes

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(model_states=self.model_states, collectives_per_step=self.collectives_per_step,
                   bytes_per_step=self.bytes_per_step, units="bytes")
        out.update({k: self.categories.get(k, 0) for k in (*MODEL_STATES, "gradient_buckets_peak",
                                                            "gathered_parameters_peak", "secondary_parameters_peak")})
        return out


def _fake_world(world: int, rank: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    if dist.is_initialized():
        raise EstimateError("world", "a process group is already started in this process; the simulation "
                                     "starts its own fake one (run it in a process of its own)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _config(stage: int, tp: int, precision: str, offload: str, micro_batch: int, accumulation: int,
            base: Optional[dict], sp: int = 1, ep: int = 1) -> dict:
    cfg = dict(base or {})
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg.pop("train_batch_size", None)
    cfg["gradient_accumulation_steps"] = accumulation
    cfg.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-4}})
    zo = dict(cfg.get("zero_optimization") or {})
    zo["stage"] = stage
    if offload in ("optimizer", "optimizer+params"):
        zo.setdefault("offload_optimizer", {"device": "cpu"})
    if offload == "optimizer+params":
        zo.setdefault("offload_param", {"device": "cpu"})
    cfg["zero_optimization"] = zo
    for key in ("bf16", "fp16"):
        cfg[key] = {**(cfg.get(key) or {}), "enabled": precision == key}
    if tp > 1:
        cfg["tensor_parallel"] = {**(cfg.get("tensor_parallel") or {}), "autotp_size": tp}
    if sp > 1:
        cfg["sequence_parallel_size"] = sp
    if ep > 1:
        cfg["expert_parallel"] = {**(cfg.get("expert_parallel") or {}), "enabled": True, "autoep_size": ep}
    return cfg


def _vocab(model: nn.Module) -> int:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int):
        return vocab
    emb = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return emb[0].num_embeddings if emb else 2


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().mean()
    if getattr(out, "loss", None) is not None:
        return out.loss
    if isinstance(out, (tuple, list)):
        scalars = [t for t in out if isinstance(t, torch.Tensor) and t.dim() == 0]
        if scalars:
            return scalars[0]
        return out[0].float().mean()
    raise EstimateError("model", f"the model's forward returned a {type(out).__name__}; the simulation needs a "
                                 "loss (a scalar tensor, a tuple holding one, or an output with .loss)")


def _is_causal_lm(model: nn.Module) -> bool:
    """A transformers causal LM (called with ``input_ids=`` and ``labels=``)."""
    return getattr(model, "config", None) is not None and hasattr(model, "generation_config")


def _step(engine, model: nn.Module, batch: tuple) -> None:
    if hasattr(engine, "train_batch"):  # a pipeline: one micro-batch per accumulation step
        engine.train_batch(iter([batch] * engine.gradient_accumulation_steps()))
        return
    ids = batch[0]
    extra = batch[2] if len(batch) > 2 else {}
    for _ in range(engine.gradient_accumulation_steps()):
        if _is_causal_lm(model):
            loss = _loss_of(engine(input_ids=ids, labels=ids, **extra))  # a transformers causal LM
        else:
            loss = _loss_of(engine(ids, ids))
        engine.backward(loss)
    engine.step()


def simulate(model: str, *, world: int, stage: int, rank: int = 0, tp: int = 1, pp: int = 1,
             precision: str = "bf16", offload: str = "none", micro_batch: int = 1, seq: int = 128,
             model_kwargs: Optional[dict] = None, config: Optional[dict] = None, steps: int = 2,
             accumulation: Optional[int] = None, sp: int = 1, ep: int = 1,
             progress: Optional[Callable[[str], None]] = None) -> Simulation:
    """Run ``steps`` optimizer steps of ``model`` as rank ``rank`` of ``world`` over a fake process
    group (in this process, which must not have started one; it is ended again, also on an error)
    and measure the last; see the package docstring. ``sp``: Ulysses sequence parallelism (a
    transformers model, its attention wrapped as DeepSpeed's ``UlyssesSPAttentionHF`` wraps it):
    the rank runs ``seq / sp`` tokens of each sequence. ``ep``: expert parallelism (a transformers MoE
    model, split as the config's ``expert_parallel`` block splits it): the rank holds ``E / ep``
    experts of each layer; over the fake group every rank routes as this one does, so this rank's
    experts get ``ep`` times the tokens this rank routes to them."""
    say = progress or (lambda _m: None)
    if precision not in PRECISIONS:
        raise EstimateError("precision", f"{precision!r}; allowed: {', '.join(PRECISIONS)}")
    if offload not in OFFLOADS:
        raise EstimateError("offload", f"{offload!r}; allowed: {', '.join(OFFLOADS)}")
    if stage not in (0, 1, 2, 3):
        raise EstimateError("stage", f"{stage}; allowed: 0, 1, 2, 3")
    if offload == "optimizer+params" and stage != 3:
        raise EstimateError("offload", "optimizer+params offloads parameters, which only stage 3 shards")
    if steps < 1:
        raise EstimateError("steps", f"{steps}; at least 1 (the last one is measured)")
    if world < 1 or not 0 <= rank < world:
        raise EstimateError("rank", f"{rank} is not a rank of a world of {world}")
    if world % (tp * pp):
        raise EstimateError("tp", f"tensor {tp} x pipeline {pp} does not divide the {world} ranks")
    if sp > 1 and seq % sp:
        raise EstimateError("seq", f"{seq} tokens do not split over the {sp} sequence-parallel ranks")
    if ep > 1 and (world % ep or tp > 1 or pp > 1 or sp > 1):
        raise EstimateError("ep", f"expert parallelism over {ep} ranks needs a world it divides ({world}) and no "
                                  "tensor, pipeline or sequence parallelism beside it")
    spec = ModelSpec(model, model_kwargs)
    hpz = int(((config or {}).get("zero_optimization") or {}).get("zero_hpz_partition_size", 1) or 1)
    est = estimate(model, model_kwargs=model_kwargs, ranks_per_node=world, precision=precision, tp=tp, pp=pp,
                   micro_batch=micro_batch, seq_len=seq, hpz=hpz if stage == 3 else None, sp=sp, ep=ep)
    row = est.row(stage, offload)
    import zerodp

    from ...core import device as devices
    from ...core.flat import local_tensor
    from ...parallel import build_grid

    gc.collect()  # what an earlier simulation in this process left must not count in this one
    # the rank's place in the grid (core/layout.py); its pipeline stage's data x tensor ranks are the fake world
    layout = Layout.of(pipe=pp, shard=world // (tp * pp), tensor=tp)
    coords = layout.coords(rank)
    pipe_stage, per_stage = coords["pipe"], world // pp
    stage_rank = Layout.of(shard=world // (tp * pp), tensor=tp).rank_of(coords)
    construct, partition = spec.construct, None
    if pp > 1:
        layers = pipeline.decoder_layers(spec, tp)
        bounds = pipeline.stage_bounds(layers, pp)
        construct = lambda: pipeline.stage_module(layers, bounds, pipe_stage, pp)  # noqa: E731
        partition = pipeline.tp_partition
    _fake_world(per_stage, stage_rank)
    try:
        dev = devices.default_device()
        accumulation = accumulation or max(pp, int((config or {}).get("gradient_accumulation_steps", 1)))
        cfg = _config(stage, tp, precision, offload, micro_batch, accumulation, config, sp, ep)
        where = f" (pipeline stage {pipe_stage} of {pp})" if pp > 1 else ""
        say(f"building rank {rank} of {world}'s model{where}")
        t0 = time.perf_counter()
        grid = build_grid(tp_size=tp, source="config") if tp > 1 else None
        built = build_model(construct, stage=stage, tp=tp, dtype=PRECISIONS[precision], device=dev, grid=grid,
                            partition=partition)
        params = sum(local_tensor(p).numel() for p in built.parameters())
        say("initialize (stage 3: one unit at a time)")
        mpu = _sequence_parallel(built, sp, micro_batch, seq) if sp > 1 else None
        with no_initialization(built):
            engine, _, _, _ = zerodp.initialize(model=built, config=cfg, param_init_fn=_no_init, mpu=mpu)
        if pp > 1:
            batch = pipeline.stage_batch(spec, pipe_stage, micro_batch, seq, PRECISIONS[precision], dev)
        else:
            local = seq // sp  # this rank's slice of each sequence
            ids = torch.randint(0, _vocab(built), (micro_batch, local), device=dev)
            batch = (ids, ids)
            if sp > 1:
                start = mpu.get_sequence_parallel_rank() * local
                batch += ({"position_ids": torch.arange(start, start + local, device=dev).expand(micro_batch, -1)},)
        for i in range(steps - 1):
            say(f"step {i + 1} of {steps} (not measured: it creates the optimizer states and records the "
                "order of units that later steps prefetch in)")
            _step(engine, built, batch)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        say(f"step {steps} of {steps}, measured")
        with PeakMemory(dev.type) as meter:
            _step(engine, built, batch)
        seconds = time.perf_counter() - t0
        categories = engine.memory_breakdown()
        stats = engine.comm_stats(by_group=True)
        estimated = {k: getattr(row, k) for k in (*MODEL_STATES, "gradient_buckets", "gathered_parameters",
                                                   "activations", "cpu", "secondary_parameters")}
        estimated.update(model_states=row.model_states, device_total=row.device_total)
        notes = list(est.notes)
        p2p = 0
        if pp > 1:
            p2p = pipeline.p2p_bytes(spec, pipe_stage, pp, accumulation, micro_batch, seq,
                                     PRECISIONS[precision].itemsize)
            first, last = bounds[pipe_stage], bounds[pipe_stage + 1] - 1
            notes.append(f"pipeline stage {pipe_stage} of {pp}: layers {first}-{last} of {len(layers)}, "
                         f"simulated as a one-stage pipeline over its {per_stage} ranks; "
                         f"{accumulation} micro-batches; point-to-point bytes computed, not simulated")
        sim = Simulation(model, world, rank, stage, tp, pp, world // (tp * pp), precision, offload, micro_batch, seq,
                         params, categories, meter.peak, meter.start, stats, estimated, seconds,
                         device_peak(dev), notes, pipe_stage, p2p, sp, ep)
        engine.destroy()
    finally:
        if sp > 1:
            from ...parallel import sequence, sequence_hf
            sequence_hf.unregister_from_transformers()
            sequence.forget_sequence_axis()
        if ep > 1:
            from ...parallel.expert import forget_expert_axes
            forget_expert_axes()
        dist.destroy_process_group()
    gc.collect()
    return sim


def _sequence_parallel(model: nn.Module, sp: int, micro_batch: int, seq: int):
    """Wrap a transformers model's attention in Ulysses over groups of ``sp`` ranks; the ``mpu``."""
    if not _is_causal_lm(model):
        raise EstimateError("sp", "sequence parallelism is simulated on a transformers causal LM (a config), whose "
                                  "attention Ulysses wraps; this model is not one")
    from ...parallel.sequence_hf import UlyssesSPAttentionHF
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    try:
        return UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation=impl,
                                                               sequence_parallel_size=sp, micro_batch_size=micro_batch,
                                                               seq_length=seq)
    except ValueError as e:
        raise EstimateError("sp", str(e)) from None


def _no_init(module: nn.Module) -> None:
    """``param_init_fn``: nothing (the values stay zeros), instead of a model's ``_init_weights``."""

"""The estimate: :func:`estimate` checks its input, computes every configuration's row and
recommends the fastest one that fits; :class:`Estimate` holds the result."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Union

from torch import nn

from ..core.flat import ALIGN_BYTES
from . import experts
from .accounting import PRECISIONS, OptimizerSpec, _optimizer, make_accounting
from .activations import Activations, estimate_activations, longest_sequence
from .buffers import estimate_buffers
from .cluster import Cluster, resolve_cluster
from .inputs import (
    DEFAULT_MAX_LIVE,
    DEFAULT_REDUCE_BUCKET,
    EstimateError,
    _element_count,
    _gb,
    _num,
    _positive_int,
    parse_memory,
)
from .model import ModelInfo, resolve_model
from .report import Estimate
from .stages import ROW_KEYS, Row, _with_fit, estimate_row
from .timing import Job, predict

#: Fastest first: lower stages communicate less; offload runs the optimizer on the CPU.
RECOMMENDATION_ORDER = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "optimizer"),
                        (3, "optimizer"), (3, "optimizer+params")]


def _recommend(rows: list[Row], device_memory: Optional[int], cpu_memory: Optional[int],
               activations: Activations) -> tuple[Optional[Row], str]:
    """The fastest configuration that fits, and a one-line reason."""
    if device_memory is None:
        return None, "no device memory given: pass it to check which configurations fit"
    by_key = {(r.stage, r.offload): r for r in rows}
    act = ("activations included" if activations.bytes is not None
           else "activations not included")
    for key in RECOMMENDATION_ORDER:
        row = by_key[key]
        if row.fits:
            return row, _reason(row, by_key, device_memory, act)
    last = by_key[RECOMMENDATION_ORDER[-1]]
    if last.fits_device:
        return None, (f"nothing fits: the device side fits only with offload, and the CPU side "
                      f"needs {_gb(last.cpu_per_node)} per node even at {last.label} "
                      f"(> {_gb(cpu_memory)} CPU memory); use more nodes or more CPU memory")
    return None, (f"nothing fits: even {last.label} needs {_gb(last.device_total)} per device "
                  f"(> {_gb(device_memory)}; {act}); use more ranks, a smaller micro-batch or "
                  "sequence, activation checkpointing, or smaller reduce_bucket_size / "
                  "stage3_max_live_parameters")


def _reason(row: Row, by_key: dict, device_memory: int, act: str) -> str:
    need = f"{_gb(row.device_total)} of {_gb(device_memory)} per device, {act}"
    if row.offload == "none":
        if row.stage == 0:
            return f"plain data parallelism fits ({need}); it communicates least"
        below = by_key[(row.stage - 1, "none")]
        return (f"the lowest stage that fits ({need}); stage {below.stage} needs "
                f"{_gb(below.device_total)}, and lower stages communicate less")
    cpu = (f"{_gb(row.cpu_per_node)} CPU memory per node" +
           ("" if row.fits_cpu is not None else ", not checked: no CPU memory given"))
    return (f"no stage fits on the device alone (stage 3 needs "
            f"{_gb(by_key[(3, 'none')].device_total)}); the fastest offload that fits ({need}; "
            f"{cpu}); offload runs the optimizer step on the CPU and is often 2-3x slower")


def _recommend_by_time(rows: list[Row], device_memory: Optional[int]) -> tuple[Optional[Row], str]:
    """The configuration predicted fastest among those that fit, and why."""
    fitting = [r for r in rows if r.runnable and r.step_time is not None and (r.fits or device_memory is None)]
    if not fitting:
        return None, "nothing fits (see the device column); no step time to compare"
    best = min(fitting, key=lambda r: r.step_time.step_time_s)
    t = best.step_time
    others = sorted((r for r in fitting if r is not best), key=lambda r: r.step_time.step_time_s)
    nearest = (f"; next: {others[0].label} at {others[0].step_time.step_time_s / t.step_time_s:.2f}x"
               if others else "")
    lower = [r for r in rows if r.offload == "none" and r.stage < best.stage and r.fits is False]
    why = f" ({lower[-1].label} does not fit)" if lower else ""
    return best, (f"predicted fastest that fits{why}: {t.step_time_s:.3g} s per step, "
                  f"{t.tokens_per_s_per_device:,.0f} tokens/s per device, {100 * t.mfu:.0f}% of peak, "
                  f"most of it {t.dominant}{nearest}")


def estimate(model: Union[str, int, nn.Module, ModelInfo], *, nodes: int = 1, ranks_per_node: int = 1,
             device_memory: Union[None, str, int] = None, cpu_memory: Union[None, str, int] = None,
             precision: str = "bf16", optimizer: Union[str, OptimizerSpec] = "adamw",
             accounting: Optional[str] = None, micro_batch: Optional[int] = None,
             seq_len: Optional[int] = None, checkpointing: bool = False,
             model_kwargs: Union[None, str, dict] = None,
             reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET,
             max_live_parameters: int = DEFAULT_MAX_LIVE, tp: int = 1,
             shard_size: Optional[int] = None, pp: int = 1, cluster: Union[None, str, dict, Cluster] = None,
             gradient_accumulation: int = 1, recalibrate: bool = False, fused_attention: bool = False,
             virtual_stages: int = 1, hpz: Optional[int] = None, sp: int = 1, tiled: bool = False,
             offload_activations: bool = False, ep: int = 1) -> Estimate:
    """Per-rank memory of ZeRO stages 0-3, with and without offload, and a recommendation.

    ``model``: a parameter count (``"7.5B"`` or an int), a path to a ``transformers`` config
    (``config.json`` or its directory), a factory ``"module:function"`` (called with
    ``model_kwargs``, a dict or JSON object, on the meta device), or a module. ``device_memory``
    and ``cpu_memory`` (per node) are sizes such as ``"80GB"``/``"24GiB"`` or bytes.
    ``accounting``: ``"mixed"`` (default for bf16/fp16), ``"no-master"``, or ``"fp32"``
    (the only one for fp32). ``tp``: tensor-parallel size (each rank holds its slice of the
    parameters the model's plan splits; ZeRO shards over the N / tp data-parallel ranks);
    ``shard_size``: hybrid sharding (MiCS), ZeRO shards every state over groups of that many
    data-parallel ranks; ``hpz``: ZeRO++ hpZ at stage 3 (``zero_hpz_partition_size``), every state
    sharded over all data-parallel ranks plus a 16-bit secondary copy of the parameters over groups
    of that many, which backward's and later micro-batches' gathers read within the group;
    ``pp``: pipeline stages, each holding 1/pp of the parameters (an even split);
    ``virtual_stages``: chunks of layers per stage, for the interleaved 1F1B schedule.
    ``fused_attention``: activations without the attention scores (flash attention, SDPA).
    ``sp``: Ulysses sequence parallelism over groups of ``sp`` ranks (ZeRO still shards over all the
    data-parallel ranks, the sequence-parallel ones included; each rank holds ``seq_len / sp`` tokens
    of activations); ``tiled``: ALST's tiled MLP and loss; ``offload_activations`` (with
    ``checkpointing``): the layers' inputs in host memory (``cpu_checkpointing``). With a device
    memory, each row also gets the longest sequence that fits (``row.longest_seq``). ``ep``: expert
    parallelism, the experts split over groups of ``ep`` ranks (``experts.py``).
    ``cluster`` (a preset name, ``"local"``, a JSON file or a :class:`Cluster`): every row also
    gets its predicted step time (``row.step_time``) for ``micro_batch`` (default 1) x ``seq_len``
    (default: the model's context) x ``gradient_accumulation`` micro-batches per step, and the
    recommendation is the fastest predicted that fits; the cluster's device and CPU memory are
    the defaults of ``device_memory`` and ``cpu_memory``.
    Raises :class:`EstimateError` for input it cannot use.
    """
    nodes = _positive_int(nodes, "nodes")
    ranks_per_node = _positive_int(ranks_per_node, "ranks_per_node")
    micro_batch = None if micro_batch is None else _positive_int(micro_batch, "micro_batch")
    seq_len = None if seq_len is None else _positive_int(seq_len, "seq_len")
    reduce_bucket_size = _element_count(reduce_bucket_size, "reduce_bucket_size")
    max_live_parameters = _element_count(max_live_parameters, "max_live_parameters")
    device = None if device_memory is None else parse_memory(device_memory, "device_memory")
    cpu = None if cpu_memory is None else parse_memory(cpu_memory, "cpu_memory")
    machines = resolve_cluster(cluster, recalibrate=recalibrate)
    if machines is not None:
        device = machines.device_memory if device is None else device
        cpu = machines.cpu_memory if cpu is None else cpu
    gradient_accumulation = _positive_int(gradient_accumulation, "gradient_accumulation")
    spec = _optimizer(optimizer)
    acc = make_accounting(precision, spec, accounting)
    info = resolve_model(model, model_kwargs)
    world = nodes * ranks_per_node
    tp = _positive_int(tp, "tp")
    pp = _positive_int(pp, "pp")
    if world % (tp * pp):
        raise EstimateError("tp" if world % tp else "pp", f"tensor {tp} x pipeline {pp} does not divide the "
                                                          f"{world} ranks")
    virtual_stages = _positive_int(virtual_stages, "virtual_stages")
    if virtual_stages > 1 and pp == 1:
        raise EstimateError("virtual_stages", "the interleaved schedule needs pipeline stages: give pp too")
    chunks = pp * virtual_stages
    if virtual_stages > 1 and info.transformer is not None and info.transformer.layers % chunks:
        raise EstimateError("virtual_stages", f"{pp} stages x {virtual_stages} chunks = {chunks} do not divide the "
                                              f"{info.transformer.layers} layers")
    if virtual_stages > 1 and machines is not None and gradient_accumulation % pp:
        raise EstimateError("virtual_stages", f"the interleaved schedule runs micro-batches in multiples of the "
                                              f"{pp} stages; gradient_accumulation is {gradient_accumulation}")
    n = world // (tp * pp)  # the data-parallel ranks ZeRO shards over
    if shard_size is not None:
        shard_size = _positive_int(shard_size, "shard_size")
        if n % shard_size:
            raise EstimateError("shard_size", f"{shard_size} does not divide the {n} data-parallel ranks")
        n = shard_size
    hpz = 1 if hpz is None else _positive_int(hpz, "hpz")
    sp = _positive_int(sp, "sp")
    if sp > 1:
        _check_sequence_parallel(info, sp, world, tp, pp, shard_size, hpz, machines)
    ep = _positive_int(ep, "ep")
    if ep > 1:
        _check_expert_parallel(ep, world, tp, pp, sp, shard_size, hpz, machines)
    if hpz > 1:
        if shard_size is not None:
            raise EstimateError("hpz", "hpZ keeps states over every data-parallel rank, hybrid sharding (shard_size) "
                                       "within groups: give one of them")
        if tp > 1 or pp > 1:
            raise EstimateError("hpz", "hpZ with tensor or pipeline parallelism is not implemented in zerodp")
        if n % hpz:
            raise EstimateError("hpz", f"{hpz} does not divide the {n} data-parallel ranks")
    whole = info
    info = info.local(tp).stage(pp)
    if seq_len is not None and seq_len % sp:
        raise EstimateError("seq_len", f"{seq_len} tokens do not split over the {sp} sequence-parallel ranks")
    acts = estimate_activations(info, precision, micro_batch, seq_len, checkpointing, fused_attention, pp,
                                virtual_stages, sp=sp, tiled=tiled, offload=offload_activations)
    buffers = estimate_buffers(info, acc.params, reduce_bucket_size, max_live_parameters, pipeline=pp > 1)
    if ep > 1:  # the dense part over the N ranks, this rank's experts over the N / ep holding the same
        dense, mine = experts.split(info, ep)
        none = estimate_buffers(mine, acc.params, 0, 0)
        rows = [_with_fit(experts.add_rows(estimate_row(acc, dense, stage, off, n, ranks_per_node, buffers, acts.bytes),
                                           estimate_row(acc, mine, stage, off, n // ep, ranks_per_node, none, 0)),
                          device, cpu) for stage, off in ROW_KEYS]
    else:
        rows = [_with_fit(estimate_row(acc, info, stage, off, n, ranks_per_node, buffers, acts.bytes, hpz),
                          device, cpu) for stage, off in ROW_KEYS]
    if device is not None and pp == 1:
        rows = [replace(r, longest_seq=longest_sequence(
            info, precision, micro_batch, device - (r.device_total - (r.activations or 0)), checkpointing,
            fused_attention, sp, tiled, offload_activations)) for r in rows]
    if machines is not None:
        seq = seq_len or acts.seq_len or (whole.transformer.context if whole.transformer else None)
        if seq is None:
            raise EstimateError("seq_len", "a step time needs the sequence length: pass seq_len")
        job = Job(micro_batch=micro_batch or 1, seq_len=seq, gradient_accumulation=gradient_accumulation,
                  checkpointing=checkpointing, tp=tp, pp=pp, dp=world // (tp * pp), virtual_stages=virtual_stages,
                  ranks_per_node=ranks_per_node, precision=precision, reduce_bucket_size=reduce_bucket_size, hpz=hpz)
        rows = [replace(r, step_time=predict(whole, info, acc, r.stage, r.offload, job, machines,
                                             largest_unit=info.largest_unit)) for r in rows]
        rec, reason = _recommend_by_time(rows, device)
    else:
        rec, reason = _recommend(rows, device, cpu, acts)
    notes = [acts.note] if acts.bytes is None else []
    notes.append("stage 0 with offload is shown for comparison only (zerodp offloads from stage 1; "
                 "stage 2 with offload keeps less on the device for the same CPU memory, so it is "
                 "recommended instead of stages 0-1)")
    notes.append("offload to disk (device \"nvme\") keeps the CPU column in files instead, with at most "
                 "three tiles of sub_group_size elements of it in CPU memory at once")
    notes.append(f"padding: each flat group is padded to N shards of a multiple of {ALIGN_BYTES} "
                 f"bytes, under {ALIGN_BYTES} bytes per shard per group")
    if tp > 1:
        split = ("every parameter assumed split (no tensor-parallel plan known for this model)"
                 if whole.split_params is None else
                 f"the plan splits {_num(whole.split_params)} of {_num(whole.params)} parameter elements; "
                 "the rest (norms, biases of row splits, position embeddings) stay whole on every rank")
        notes.append(f"tensor parallelism: {tp} ranks per layer, Ψ is one rank's slice ({_num(info.params)}); "
                     f"{split}; activations are not divided by the tensor-parallel size here")
    if hpz > 1:
        notes.append(f"hpZ (zero_hpz_partition_size {hpz}), stage 3 rows: every state sharded over the {n} "
                     f"data-parallel ranks as at plain stage 3, plus the secondary copy of the parameters "
                     f"(2Ψ/{hpz} in 16-bit) in 'states'; traffic over all {n} ranks is the step's first forward's "
                     f"gathers and the gradients' reduce-scatter, the other gathers run within groups of {hpz}")
    elif shard_size is not None:
        notes.append(f"hybrid sharding (MiCS, mics_shard_size {n}): every state sharded within groups of {n} "
                     "ranks and replicated across the groups; N above is the group")
    if ep > 1:
        t = experts.traffic(info, ep, n, micro_batch or 1, acts.seq_len or 1, PRECISIONS[precision])
        verdict = (f"saves {_gb(t.saving)}" if t.saving >= 0 else f"costs {_gb(-t.saving)} more")
        notes.append(f"expert parallelism: the {info.num_experts} experts of each of {info.moe_layers} layers over "
                     f"groups of {ep} ranks; dense states sharded over {n} ranks, expert states over the {n // ep} "
                     f"holding the same experts; per micro-batch and rank {_gb(t.all_to_all)} of token all-to-alls; "
                     f"stage 3 gathers {_gb(t.gathers_with)} of experts instead of {_gb(t.gathers_without)} without "
                     f"expert parallelism (leaf-module ZeRO-3): in bytes moved it {verdict}")
    if sp > 1:
        notes.append(f"sequence parallelism (Ulysses): groups of {sp} ranks share each sequence; ZeRO shards "
                     f"over all {n} data-parallel ranks, the sequence-parallel ones included, and the batch "
                     f"counts {world // sp} data-parallel groups")
    if acts.host:
        notes.append(f"cpu_checkpointing: the layers' inputs, {_gb(acts.host)} per rank, wait in host memory "
                     "(not in the CPU column)")
    if pp > 1:
        notes.append(f"pipeline parallelism: {pp} stages, Ψ is one stage's share ({_num(info.params)}, an even "
                     "split; a stage's real share follows its layers), plus the activations the schedule keeps for "
                     "its micro-batches in flight, not counted here")
    if machines is not None:
        notes.append(f"step time: on {machines.name} ({machines.description or 'a described cluster'}), "
                     f"micro-batch {job.micro_batch} x sequence {job.seq_len} x {gradient_accumulation} "
                     "micro-batch(es) per step; a model of the step (docs/estimate.md), not a measurement")
    return Estimate(info, nodes, ranks_per_node, precision, spec, acc, device, cpu, buffers, acts,
                    rows, rec, reason, notes, tp=tp, shard_size=n, pp=pp, cluster=machines, hpz=hpz, sp=sp, ep=ep)


def _check_expert_parallel(ep: int, world: int, tp: int, pp: int, sp: int, shard_size: Optional[int], hpz: int,
                           machines: Optional[Cluster]) -> None:
    """What zerodp's expert parallelism composes with (as the engine refuses the rest)."""
    if world % ep:
        raise EstimateError("ep", f"{ep} does not divide the {world} ranks")
    if tp > 1 or pp > 1 or sp > 1 or shard_size is not None or hpz > 1:
        raise EstimateError("ep", "expert parallelism beside tensor, pipeline or sequence parallelism, hybrid sharding "
                                  "or hpZ is not implemented in zerodp")
    if machines is not None:
        raise EstimateError("ep", "step times with expert parallelism are not modelled: drop --time")


def _check_sequence_parallel(info: ModelInfo, sp: int, world: int, tp: int, pp: int,
                             shard_size: Optional[int], hpz: int, machines: Optional[Cluster]) -> None:
    """What zerodp's sequence parallelism composes with (as the engine refuses it)."""
    if world % sp:
        raise EstimateError("sp", f"{sp} does not divide the {world} ranks")
    if tp > 1 or pp > 1:
        raise EstimateError("sp", "sequence parallelism with tensor or pipeline parallelism is refused, as "
                                  "DeepSpeed refuses it")
    if shard_size is not None or hpz > 1:
        raise EstimateError("sp", "sequence parallelism with hybrid sharding or hpZ is not implemented in zerodp")
    if machines is not None:
        raise EstimateError("sp", "step times with sequence parallelism are not modelled: drop --time")
    if info.transformer is not None and info.transformer.heads % sp:
        raise EstimateError("sp", f"the model's {info.transformer.heads} attention heads do not split over "
                                  f"{sp} sequence-parallel ranks")

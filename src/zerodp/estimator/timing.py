"""A model of one optimizer step's time: compute from FLOPs, each collective from its bytes and
the link it crosses, what overlaps with what at each stage, offload's transfers and CPU step, the
pipeline's bubble, activation recomputation (docs/estimate.md, "Step time").

Per micro-batch, a data-parallel rank computes ``F / (tp * pp)`` FLOPs, where ``F`` is the
model's forward-and-backward FLOPs for the micro-batch: three forwards' worth, ``6 Psi b s``, plus
for a known transformer shape attention's ``12 b s^2 h L`` (Megatron-LM's count, up to how it
counts the output layer); activation recomputation runs the forward once more (four). Compute
time is FLOPs over the device's peak times its efficiency (a third forward, two thirds backward):
``gemm_efficiency``, or on a cluster that measured it by width (``local``), the efficiency at one
rank's width of the layers, ``h / tp``. Collectives run as rings: an all-reduce of ``B`` bytes over ``N`` ranks takes
``2 (N-1)/N B / bw + 2 (N-1) lat``, a reduce-scatter or all-gather half that, with the bandwidth
and latency of the node's links when the group fits in a node. A group that spans nodes with ``k``
of its ranks on each runs ``k`` rings at once, each through its own rank's network adapter (NCCL's
channels): ``bw`` is ``k`` adapters' bandwidth, at most the node's links, and the latency the
network's; its all-reduce takes a tree (``2 B / bw + 2 log2(N) lat``) where that is faster.

What overlaps (``cluster.overlap`` of it is hidden; the first gather and the last bucket never):

* stages 0-1: the gradient all-reduce / reduce-scatter of the last micro-batch with its backward;
* stage 2: each micro-batch's reduce-scatter with its backward;
* stage 3: each unit's all-gather with the compute of the unit before it (prefetch), forward and
  backward, and the reduce-scatter with backward; with hpZ (``hpz`` ranks) only the step's first
  forward gathers over every data-parallel rank, the other gathers within the hpZ group (a node);
* stages 1-3 end with the updated parameters' all-gather (stages 1-2) after the optimizer step,
  exposed; tensor parallelism's all-reduces (two per layer forward, two backward) are exposed;
* optimizer offload: the gradient shard goes to the host during backward, the CPU runs the
  update, the parameters come back (exposed); parameter offload adds a host read before every
  stage-3 gather.

A pipeline of ``pp`` stages runs ``m`` micro-batches in ``m + pp - 1`` slots of one stage's
micro-batch time: the ``pp - 1`` extra slots are the bubble. The interleaved schedule with ``v``
chunks of layers per stage (Narayanan et al. 2021) shrinks the bubble to ``(pp - 1) / v`` slots and
sends each micro-batch's activations ``v`` times as often.

Ranks that are processes sharing fewer cores (``cluster.shared_cores``, the ``local`` cluster) take
the longer of that critical path at full speed and the node's total work over its cores: a
rank's idle time (the bubble, the latency part of its exposed collectives) is another's running
time.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from ..core.layout import Layout
from .accounting import FP32, Accounting
from .cluster import Cluster
from .inputs import EstimateError
from .model import ModelInfo

#: bytes an elementwise optimizer step touches per element on the device (Adam with an fp32
#: master: read param, grad, m, v; write master, m, v and the 16-bit copy)
OPTIMIZER_BYTES = 32


@dataclass(frozen=True)
class Job:
    """The batch and the layout a prediction is for."""

    micro_batch: int
    seq_len: int
    gradient_accumulation: int = 1
    checkpointing: bool = False
    tp: int = 1
    pp: int = 1
    dp: int = 1
    virtual_stages: int = 1  # chunks of layers per pipeline stage (the interleaved 1F1B schedule)
    ranks_per_node: int = 1
    precision: str = "bf16"
    reduce_bucket_size: int = 500_000_000
    hpz: int = 1  # stage 3: hpZ's secondary group size (backward's and later micro-batches' gathers within it)


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, per part, and what follows from it."""

    compute_s: float
    communication_s: float
    """Communication not hidden behind compute."""
    optimizer_s: float
    offload_s: float
    bubble_s: float
    step_time_s: float
    tokens_per_s: float
    """Tokens of the global batch per second of step, over all devices."""
    tokens_per_s_per_device: float
    tflops_per_device: float
    """Model FLOPs (recomputation not counted) per second per device, in TFLOP/s."""
    hardware_tflops_per_device: float
    """The same with recomputation's extra forward counted (Megatron-LM's convention)."""
    mfu: float
    """``tflops_per_device`` over the device's peak."""

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def dominant(self) -> str:
        parts = {"compute": self.compute_s, "communication": self.communication_s, "optimizer": self.optimizer_s,
                 "offload": self.offload_s, "pipeline bubble": self.bubble_s}
        return max(parts, key=parts.get)


def forward_flops(model: ModelInfo, micro_batch: int, seq_len: int) -> float:
    """FLOPs of one forward of a micro-batch through the whole ``model``: two per parameter and
    token (every weight in one multiply-add; the embedding as the tied output layer), plus, for a
    known transformer shape, attention's scores and weighted sum, ``4 b s^2 h`` per layer."""
    b, s = micro_batch, seq_len
    flops = 2.0 * model.params * b * s
    t = model.transformer
    if t is not None:
        flops += 4.0 * b * s * s * t.hidden * t.layers
    return flops


class _Links:
    """Collectives on the cluster for the data-, tensor- and pipeline-parallel groups: rings inside a
    node; across nodes, NCCL's rings run one channel per node-local rank of the group, each through
    that rank's own network adapter, so a group with ``k`` ranks on every node moves ``k`` times one
    adapter's bandwidth (up to the node's links), and its all-reduce may take a tree instead (``2 log2
    N`` latencies rather than ``2 (N-1)``), whichever is faster."""

    def __init__(self, cluster: Cluster, job: Job) -> None:
        self.c = cluster
        per_node = job.ranks_per_node
        # a group's ranks on one node, as the grid lays them out (tensor innermost, then data, then pipeline)
        layout = Layout.of(pipe=job.pp, shard=job.dp, tensor=job.tp)
        self.tp_together = layout.together(["tensor"], per_node)
        self.dp_together = layout.together(["shard"], per_node)
        self.pp_inside = layout.together(["pipe"], per_node) == job.pp
        self.latency = self.transfer = 0.0  # seconds of every collective costed, by part

    def link(self, n: int, together: int) -> tuple[float, float]:
        """Bandwidth and latency per step of a ring over ``n`` ranks, ``together`` of them per node."""
        c = self.c
        if together >= n:
            return c.intra_bandwidth, c.intra_latency
        return min(c.intra_bandwidth, together * c.inter_bandwidth), c.inter_latency

    def _cost(self, transfer: float, latency: float) -> float:
        self.transfer += transfer
        self.latency += latency
        return transfer + latency

    def latency_share(self) -> float:
        """The part of the collectives' time that is waiting for the ring's steps, not moving bytes."""
        total = self.latency + self.transfer
        return self.latency / total if total else 0.0

    def all_reduce(self, nbytes: float, n: int, together: int) -> float:
        if n <= 1:
            return 0.0
        bw, lat = self.link(n, together)
        ring = (2 * (n - 1) / n * nbytes / bw, 2 * (n - 1) * lat)
        if together < n:  # across nodes: a tree when the ring's latencies cost more than it saves
            tree = (2 * nbytes / bw, 2 * math.ceil(math.log2(n)) * lat)
            ring = min(ring, tree, key=sum)
        return self._cost(*ring)

    def gather(self, nbytes: float, n: int, together: int) -> float:
        """An all-gather or reduce-scatter whose full buffer is ``nbytes``."""
        if n <= 1:
            return 0.0
        bw, lat = self.link(n, together)
        return self._cost((n - 1) / n * nbytes / bw, (n - 1) * lat)

    def send(self, nbytes: float, inside: bool) -> float:
        bw, lat = self.link(2, 2 if inside else 1)
        return self._cost(nbytes / bw, lat)


def predict(whole: ModelInfo, model: ModelInfo, acc: Accounting, stage: int, offload: str, job: Job,
            cluster: Cluster, largest_unit: Optional[int] = None) -> StepTime:
    """The step time of ``stage`` with ``offload`` for ``job`` on ``cluster``. ``whole`` is the
    model, ``model`` one rank's share of it (``whole.local(tp).stage(pp)``); ``largest_unit``:
    stage 3's largest gathered unit, in elements."""
    if job.micro_batch < 1 or job.seq_len < 1:
        raise EstimateError("seq_len", "a step time needs a micro-batch and a sequence length")
    links = _Links(cluster, job)
    dtype = "fp32" if acc.params == FP32 else job.precision
    # a tensor-parallel rank multiplies matrices 1/tp as wide
    width = whole.transformer.hidden // job.tp if whole.transformer else None
    rate = cluster.peak(dtype) * cluster.efficiency(width)
    n, m = job.dp, job.gradient_accumulation
    psi, trained = model.params, model.trainable_params
    pb, gb = acc.params, acc.grads

    # compute, per micro-batch, of one rank
    fwd_t = forward_flops(whole, job.micro_batch, job.seq_len) / (job.tp * job.pp) / rate
    bwd_t = 2 * fwd_t + (fwd_t if job.checkpointing else 0.0)
    micro_compute = fwd_t + bwd_t
    # one micro-batch's activations (b s h), what tensor-parallel all-reduces and pipeline sends move
    t = model.transformer
    act = job.micro_batch * job.seq_len * (t.hidden if t else 1) * (2 if dtype != "fp32" else 4)

    # tensor parallelism: two all-reduces of the activations per layer forward, two backward
    tp_t = 0.0
    if job.tp > 1 and model.transformer is None:
        raise EstimateError("tp", "a step time with tensor parallelism needs the model's layer shapes (a "
                                  "transformers config or a factory), not a bare count")
    if job.tp > 1:
        per_layer = links.all_reduce(act, job.tp, links.tp_together)
        calls = 4 + (2 if job.checkpointing else 0)
        tp_t = calls * per_layer * t.layers / job.pp

    ov = cluster.overlap
    hide = lambda comm, window: max(0.0, comm - ov * window)  # noqa: E731
    bucket = min(job.reduce_bucket_size, trained) * gb
    params_ag = links.gather(psi * pb, n, links.dp_together)
    grads_rs = links.gather(trained * gb, n, links.dp_together)
    per_micro, boundary = 0.0, 0.0
    if stage == 0:
        reduce_t = links.all_reduce(trained * gb, n, links.dp_together)
        boundary = hide(reduce_t, bwd_t) + links.all_reduce(bucket, n, links.dp_together) * (ov > 0)
    elif stage in (1, 2):
        last_bucket = links.gather(bucket, n, links.dp_together) * (ov > 0)
        if stage == 1:
            boundary = hide(grads_rs, bwd_t) + last_bucket
        else:
            per_micro = hide(grads_rs, bwd_t) + last_bucket
        boundary += params_ag
    else:
        unit = (largest_unit or psi) * pb
        fetch = 0.0
        if offload == "optimizer+params":  # each gather first reads this rank's shard from the host
            fetch = psi * pb / n / cluster.host_bandwidth
        first = links.gather(unit, n, links.dp_together)
        # every unit is a collective of its own: its ring steps' latency, twice gathered and once reduced
        units = max(1, -(-psi // (largest_unit or psi)))
        lat = (units - 1) * (n - 1) * links.link(n, links.dp_together)[1]
        per_micro = hide(params_ag + fetch, fwd_t) + hide(params_ag + fetch + grads_rs, bwd_t) + first + 3 * lat
        if job.hpz > 1:  # hpZ: only the step's first forward gathers over all n; the rest within hpz ranks
            k, together = job.hpz, min(job.hpz, links.dp_together)
            sec_ag, sec_first = links.gather(psi * pb, k, together), links.gather(unit, k, together)
            sec_lat = (units - 1) * (k - 1) * links.link(k, together)[1]
            over_all = hide(params_ag + fetch, fwd_t) + first + lat  # the first forward's gathers, once a step
            per_micro = (hide(sec_ag + fetch, fwd_t) + hide(sec_ag + fetch + grads_rs, bwd_t) + sec_first
                         + 2 * sec_lat + lat)
            boundary += over_all - (hide(sec_ag + fetch, fwd_t) + sec_first + sec_lat)

    # the optimizer step on this rank's shard
    shard = trained / (n if stage >= 1 else 1)
    offload_t = 0.0
    if offload == "none":
        optimizer_t = shard * OPTIMIZER_BYTES / cluster.memory_bandwidth
    else:
        host = cluster.host_bandwidth
        grads_down = hide(shard * gb / host, bwd_t)
        params_up = shard * pb / host
        optimizer_t = shard / (cluster.cpu_optimizer_rate / max(1, job.ranks_per_node))
        offload_t = grads_down + params_up

    if job.pp > 1:  # the activations to the next stage, their gradients back: once per chunk
        per_micro += 2 * job.virtual_stages * links.send(act, links.pp_inside)
    micro = micro_compute + tp_t + per_micro
    bubble = (job.pp - 1) * micro / job.virtual_stages
    busy = m * micro + boundary + optimizer_t + offload_t  # what one rank spends, at full speed
    step, scale = busy + bubble, 1.0
    cores = cluster.shared_cores
    if cores is not None and job.ranks_per_node > cores:
        # processes sharing cores: the node's work over its cores, unless the critical path is longer
        # (a pipeline's idle slots, and a rank waiting out a ring's latency, give the core to another)
        waiting = (m * (tp_t + per_micro) + boundary) * links.latency_share()
        work = (busy - waiting) * job.ranks_per_node / cores + waiting
        if work > step:
            step, scale, bubble = work, work / busy, 0.0

    tokens = job.micro_batch * job.seq_len * m * n
    world = job.tp * job.pp * n
    model_flops = 3 * forward_flops(whole, job.micro_batch, job.seq_len) * m * n
    per_device = model_flops / step / world
    hardware = per_device * (4 / 3 if job.checkpointing else 1)
    return StepTime(compute_s=scale * m * micro_compute, communication_s=scale * (m * (tp_t + per_micro) + boundary),
                    optimizer_s=scale * optimizer_t, offload_s=scale * offload_t, bubble_s=bubble, step_time_s=step,
                    tokens_per_s=tokens / step, tokens_per_s_per_device=tokens / step / world,
                    tflops_per_device=per_device / 1e12, hardware_tflops_per_device=hardware / 1e12,
                    mfu=per_device / cluster.peak(dtype))

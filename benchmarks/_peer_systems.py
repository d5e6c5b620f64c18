"""The systems ``peers.py`` compares, and how each trains one step of the example GPT: what a
worker builds from a system's name (``build``), and the grid arithmetic of the tensor- and
pipeline-parallel ones (``ranks_needed``, ``stands_for``). ``peers.py`` has the runs, the
counting and the table."""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    family: str            # "torch", "deepspeed" or "zerodp"
    description: str
    imports: tuple[str, ...]  # the modules it needs beyond torch.distributed


SYSTEMS = [
    System("ddp", "torch", "torch DistributedDataParallel, AdamW", ("torch.nn.parallel",)),
    System("ddp-zro", "torch", "DDP + torch ZeroRedundancyOptimizer(AdamW)",
           ("torch.nn.parallel", "torch.distributed.optim")),
    System("fsdp2", "torch", "FSDP2 fully_shard per block + root, reshard_after_forward=True",
           ("torch.distributed.fsdp",)),
    System("fsdp2-noreshard", "torch", "FSDP2 fully_shard per block + root, reshard_after_forward=False",
           ("torch.distributed.fsdp",)),
    System("ds1", "deepspeed", "DeepSpeed ZeRO stage 1", ("deepspeed",)),
    System("ds2", "deepspeed", "DeepSpeed ZeRO stage 2", ("deepspeed",)),
    System("ds3", "deepspeed", "DeepSpeed ZeRO stage 3", ("deepspeed",)),
    System("zero0", "zerodp", "zerodp stage 0", ("zerodp",)),
    System("zero1", "zerodp", "zerodp stage 1", ("zerodp",)),
    System("zero2", "zerodp", "zerodp stage 2", ("zerodp",)),
    System("zero3", "zerodp", "zerodp stage 3", ("zerodp",)),
    System("zero3-noreshard", "zerodp", "zerodp stage 3, stage3_max_reuse_distance at its default (1e9): "
           "units stay gathered from forward to backward", ("zerodp",)),
    # tensor parallelism (2 adjacent ranks per layer, the example GPT's plan on torch's TP styles);
    # each data-parallel rank trains on the micro-batches of the 2 ranks it stands for, so the
    # global batch, the losses and the norms are the data-parallel systems' at the same world size
    System("zero3-tp2", "zerodp", "zerodp stage 3 over DP N/2 x TP 2", ("zerodp",)),
    System("zero3-tp2-sp", "zerodp", "zerodp stage 3 over DP N/2 x TP 2, with sequence and loss parallelism",
           ("zerodp",)),
    System("fsdp2-tp2", "torch", "FSDP2 over DP N/2 x torch TP 2 (the same plan), reshard_after_forward=True",
           ("torch.distributed.fsdp", "torch.distributed.tensor.parallel", "zerodp")),
    # pipeline parallelism (2 stages, 1F1B, the GPT as a PipelineModule of layers: _pipeline_gpt.py);
    # a data-parallel rank trains on the micro-batches of the ranks it stands for, one micro-batch each
    System("zero1-pp2", "zerodp", "zerodp stage 1 over PP 2 x DP N/2, 1F1B", ("zerodp",)),
    System("zero3-pp2", "zerodp", "zerodp stage 3 over PP 2 x DP N/2, 1F1B", ("zerodp",)),
    System("zero1-pp2-tp2", "zerodp", "zerodp stage 1 over PP 2 x TP 2 x DP N/4, 1F1B", ("zerodp",)),
    System("ds1-pp2", "deepspeed", "DeepSpeed's pipeline engine, ZeRO stage 1, PP 2 x DP N/2", ("deepspeed",)),
    # offload (benchmarks/offload.py --part steps runs these): each system's own CPU Adam
    System("ds2-offload", "deepspeed", "DeepSpeed ZeRO-Offload stage 2 (DeepSpeedCPUAdam)", ("deepspeed",)),
    System("ds3-offload", "deepspeed", "DeepSpeed ZeRO-Offload stage 3, optimizer and parameters on CPU",
           ("deepspeed",)),
    System("zero2-offload", "zerodp", "zerodp stage 2, optimizer offload to CPU (fused AdamW)", ("zerodp",)),
    System("zero3-offload", "zerodp", "zerodp stage 3, optimizer and parameter offload to CPU", ("zerodp",)),
    System("zero3-nvme", "zerodp", "zerodp stage 3, optimizer offload to disk (--nvme-path)", ("zerodp",)),
]
BY_NAME = {s.name: s for s in SYSTEMS}

ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

#: The tensor-parallel size of the ``-tp2`` systems and the pipeline stages of the ``-pp2`` ones.
TP = PP = 2


@dataclasses.dataclass
class Trainer:
    """One system, ready to train: ``step(x, y)`` runs forward, backward, clipping and the
    update and returns ``(loss, grad_norm_before_clipping)``."""

    step: Callable
    extra_comm: Callable[[], tuple[float, int]] = lambda: (0.0, 0)  # (bytes, calls) per step not seen from Python
    own_comm_bytes: Callable[[], Optional[float]] = lambda: None    # the system's own counter, if any
    own_comm_by_group: Callable[[], Optional[dict]] = lambda: None  # zerodp: its bytes per process group


def norm_value(norm) -> float:
    if hasattr(norm, "full_tensor"):  # a DTensor (FSDP2)
        norm = norm.full_tensor()
    return float(norm)


def _ddp_bucket_traffic(net, world: int, params) -> tuple[float, int]:
    """DDP's gradient all-reduces per step (issued from C++): ring bytes and calls, from
    DDP's own buckets (as rebuilt after the first step)."""
    sizes: list[int] = []
    try:
        sizes = [b.buffer().numel() * b.buffer().element_size()
                 for b in net.reducer._get_zeros_like_grad_buckets()]
    except Exception:
        try:
            sizes = [int(s) for s in str(net._get_ddp_logging_data().get("bucket_sizes", "")).split(",") if s]
        except Exception:
            pass
    if not sizes:
        sizes = [sum(p.numel() * p.element_size() for p in params if p.requires_grad)]
    return 2 * sum(sizes) * (world - 1) / world, len(sizes)


def ranks_needed(system: str) -> int:
    """The tensor-parallel size times the pipeline stages of ``system``: the world size must be a multiple."""
    return (TP if "-tp2" in system else 1) * (PP if "-pp2" in system else 1)


def stands_for(system: str, rank: int, world: int) -> list[int]:
    """The ranks of the data-parallel systems whose micro-batches ``rank`` of ``system`` trains on:
    a data-parallel rank of a grid with tensor and pipeline axes stands for world / data ranks."""
    tp = TP if "-tp2" in system else 1
    pp = PP if "-pp2" in system else 1
    data = world // (tp * pp)
    d = (rank // tp) % data
    k = world // data
    return list(range(d * k, d * k + k))


def build_pipeline(system: str, model, args, world: int) -> Trainer:
    """zerodp's or DeepSpeed's pipeline engine over the GPT as layers (``_pipeline_gpt.py``)."""
    import _pipeline_gpt as pg
    import torch
    stage = int(system[2] if system.startswith("ds") else system[4])
    tp = TP if system.endswith("-tp2") else 1
    micro_batches = TP * PP if tp > 1 else PP
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": micro_batches,
              "gradient_clipping": args.clip, "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": int(args.bucket_mb * 2**20 / 4)}}
    if system.startswith("ds"):
        import deepspeed
        from deepspeed.pipe import PipelineModule
        config["optimizer"] = {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]), "torch_adam": True}}
        net = PipelineModule(layers=pg.layers(deepspeed.pipe, model), num_stages=PP, loss_fn=pg.loss_fn,
                             partition_method="parameters")
        engine, _, _, _ = deepspeed.initialize(model=net, config=config,
                                               model_parameters=[p for p in net.parameters() if p.requires_grad])
        own = None
    else:
        import zerodp
        from zerodp.pipe import PipelineModule
        config["pipeline"] = {"schedule": "1F1B"}
        if tp > 1:
            config["tensor_parallel"] = {"autotp_size": tp, "partition_config": pg.TP_PARTITION}
        net = PipelineModule(layers=pg.layers(zerodp.pipe, model), num_stages=PP, loss_fn=pg.loss_fn,
                             partition_method="parameters")
        engine, _, _, _ = zerodp.initialize(model=net, config=config, optimizer=lambda g: torch.optim.AdamW(g, **ADAMW))
        own = lambda: float(engine.comm_stats()["total"])  # noqa: E731

    def step(xs, ys):
        loss = engine.train_batch(iter(zip(xs, ys)))
        return loss, engine.get_global_grad_norm()
    by_group = (lambda: engine.comm_stats(by_group=True)) if own is not None else (lambda: None)
    return Trainer(step, own_comm_bytes=own or (lambda: None), own_comm_by_group=by_group)


def build(system: str, model, gpt, args, world: int) -> Trainer:
    import torch

    clip = args.clip
    max_norm = clip if clip > 0 else math.inf
    bucket_elems = int(args.bucket_mb * 2**20 / 4)
    # stage 3's prefetch: one block's elements ahead (FSDP2's fixed depth), or --prefetch-mb
    prefetch_elems = (sum(p.numel() for p in model.blocks[0].parameters()) if args.prefetch_mb is None
                      else int(args.prefetch_mb * 2**20 / 4))

    def torch_step(forward, params, opt):
        def step(x, y):
            _, loss = forward(x, y)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss, norm
        return step

    if system in ("ddp", "ddp-zro"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model, bucket_cap_mb=args.bucket_mb)
        params = list(model.parameters())
        if system == "ddp":
            opt = torch.optim.AdamW(params, **ADAMW)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **ADAMW)
        return Trainer(torch_step(net, params, opt), extra_comm=lambda: _ddp_bucket_traffic(net, world, params))

    if system == "fsdp2-tp2":  # torch's own 2-D composition: TP inside pairs, FSDP2 across them
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from zerodp.parallel.plans import GPT_PLAN
        from zerodp.parallel.tensor import apply_plan
        mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
        apply_plan(model, GPT_PLAN, mesh["tp"])
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=True)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=True)
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, **ADAMW)

        def step(x, y):  # clip_grad_norm_ cannot stack norms of 1-D (dp) and 2-D (dp, tp) parameters:
            _, loss = model(x, y)  # one total per mesh, each made whole, then combined
            loss.backward()
            by_mesh: dict = defaultdict(list)
            for p in params:
                by_mesh[p.grad.device_mesh].append(p)
            norm = math.sqrt(sum(float(norm_value(torch.nn.utils.get_total_norm([p.grad for p in ps]))) ** 2
                                 for ps in by_mesh.values()))
            for ps in by_mesh.values():
                torch.nn.utils.clip_grads_with_norm_(ps, max_norm, torch.tensor(norm))
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss, norm
        return Trainer(step)

    if system.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        reshard = system == "fsdp2"
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, **ADAMW)
        return Trainer(torch_step(model, params, opt))

    if "-pp2" in system:
        return build_pipeline(system, model, args, world)

    if system.startswith("ds"):
        import deepspeed
        stage, offload = int(system[2]), system.endswith("-offload")
        config = {
            "train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]),
                                                      "torch_adam": not offload}},
            "gradient_clipping": clip, "steps_per_print": 10**9, "wall_clock_breakdown": False,
            "zero_optimization": {
                "stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                "reduce_scatter": True, "reduce_bucket_size": bucket_elems,
                "allgather_bucket_size": bucket_elems,
                "stage3_prefetch_bucket_size": prefetch_elems, "stage3_max_reuse_distance": 0},
        }
        if offload:
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
            if stage == 3:
                config["zero_optimization"]["offload_param"] = {"device": "cpu"}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def ds_step(x, y):
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss, engine.get_global_grad_norm()
        return Trainer(ds_step)

    if system.startswith("zero"):
        import zerodp
        stage, offload = int(system[4]), system[6:]
        keep_gathered = offload == "noreshard"
        offload = "" if keep_gathered else offload
        tp = TP if offload.startswith("tp2") else 1
        split_sequence = offload == "tp2-sp"
        offload = "" if offload.startswith("tp2") else offload
        config = {
            "train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": clip, "steps_per_print": 10**9,
            "zero_optimization": {
                "stage": stage, "overlap_comm": True, "reduce_bucket_size": bucket_elems,
                "allgather_bucket_size": bucket_elems,
                "stage3_prefetch_bucket_size": prefetch_elems, "stage3_max_reuse_distance": 0},
            "tensor_parallel": {"autotp_size": tp, "sequence_parallel": split_sequence, "loss_parallel": split_sequence},
        }
        if keep_gathered:
            del config["zero_optimization"]["stage3_max_reuse_distance"]
        # the peers' optimizer exactly (torch's default AdamW), not the fused one zerodp builds
        # from an "optimizer" config block, so the step times compare the engines alone; with
        # offload, each system's own CPU Adam (zerodp's: torch's fused AdamW from the config)
        optimizer = lambda groups: torch.optim.AdamW(groups, **ADAMW)  # noqa: E731
        if offload:
            optimizer = None
            config["optimizer"] = {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}}
            zc = config["zero_optimization"]
            zc["offload_optimizer"] = ({"device": "cpu"} if offload == "offload" else
                                       {"device": "nvme", "nvme_path": args.nvme_path})
            if offload == "offload" and stage == 3:
                zc["offload_param"] = {"device": "cpu"}
        engine, _, _, _ = zerodp.initialize(model=model, config=config, unit_classes=(gpt.Block,),
                                            optimizer=optimizer)

        def zero_step(x, y):
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss, engine.get_global_grad_norm()
        return Trainer(zero_step, own_comm_bytes=lambda: float(engine.comm_stats()["total"]),
                       own_comm_by_group=lambda: engine.comm_stats(by_group=True))

    raise ValueError(f"unknown system {system!r}")

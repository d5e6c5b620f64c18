"""Tensor parallelism (and hybrid sharding) under ZeRO against one process.

The example GPT (and a ``transformers`` Llama built from a config) trains on a grid of tensor x
data ranks; the reference is the same model in one process, torch's AdamW, the whole global batch
(every data-parallel rank's micro-batches) and the same global-norm clipping. Every tensor-parallel
rank of a data-parallel rank sees that rank's batch. Parameters are compared whole: each rank's
slices are gathered over the tensor-parallel group and put in place by their ``TPSlice``.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp

ADAMW = {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
OPTIMIZERS = {"AdamW": (torch.optim.AdamW, ADAMW), "SGD": (torch.optim.SGD, SGD)}
VOCAB, SEQ, MICRO = 64, 8, 2


def build_gpt(seed: int = 0, **overrides):
    from zerodp.examples.gpt import build_gpt as build
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, block_size=SEQ)
    kw.update(overrides)
    return build("tiny", **kw)


def build_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def build_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def build_qwen(seed: int = 0, version: int = 3):
    """A ``transformers`` Qwen2 (biases on q, k and v) or Qwen3 (a norm on each head's q and k)."""
    import transformers
    torch.manual_seed(seed)
    config, model = (transformers.Qwen3Config, transformers.Qwen3ForCausalLM) if version == 3 else (
        transformers.Qwen2Config, transformers.Qwen2ForCausalLM)
    cfg = config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ, tie_word_embeddings=False,
                 attn_implementation="sdpa")
    return model(cfg)


def build_mistral(seed: int = 0):
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ,
                        sliding_window=SEQ // 2, tie_word_embeddings=False, attn_implementation="sdpa")
    return MistralForCausalLM(cfg)


MODELS = {"gpt": build_gpt, "llama": build_llama, "gpt2": build_gpt2, "llama_labels": build_llama,
          "qwen2": lambda seed=0: build_qwen(seed, 2), "qwen3": build_qwen, "mistral": build_mistral}


def batch(step: int, dp_rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * dp_rank + micro)
    x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def loss_of(model_name: str, out, y) -> torch.Tensor:
    if model_name == "gpt":
        return out[1]  # the transformers models: the loss from the logits, or their own from labels
    if model_name == "llama_labels":
        return out.loss
    return F.cross_entropy(out.logits.float().reshape(-1, VOCAB), y.reshape(-1))


def forward(model_name: str, module, x, y):
    if model_name == "gpt":
        return module(x, y)
    if model_name == "llama_labels":
        return module(input_ids=x, labels=x)
    return module(input_ids=x)


def config(stage: int, tp: int, dp: int, gas: int = 1, clip: float = 0.0, dtype: str = "fp32",
           hybrid: int = 0, offload: bool = False, optimizer: str = "AdamW", loss_parallel: bool = False,
           sequence_parallel: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "gradient_clipping": clip, "steps_per_print": 10**6,
           "optimizer": {"type": optimizer, "params": dict(OPTIMIZERS[optimizer][1])},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000,
                                 "stage3_param_persistence_threshold": 100},
           "tensor_parallel": {"autotp_size": tp, "loss_parallel": loss_parallel,
                               "sequence_parallel": sequence_parallel}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if hybrid:
        cfg["zero_optimization"]["mics_shard_size"] = hybrid
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def reference(model_name: str, dp, steps: int, gas: int = 1, clip: float = 0.0,
              optimizer: str = "AdamW") -> dict:
    """One process: parameters after ``steps`` and the gradient norm of each step; ``dp`` is the
    number of data-parallel ranks whose batches make a step's global batch (a list: per step)."""
    model = MODELS[model_name]()
    cls, hyper = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **{k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()})
    norms = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        losses = []
        for r in range(dp[step] if isinstance(dp, list) else dp):
            for m in range(gas):
                x, y = batch(step, r, m)
                losses.append(loss_of(model_name, forward(model_name, model, x, y), y))
        (sum(losses) / len(losses)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf).item())
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms}


def whole_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter whole: gathered at stage 3, its tensor-parallel slices put together."""
    from zerodp.core.flat import local_tensor
    out = {}
    tp_group = engine.grid.tensor.group
    slices = {s.name: s.tp for g in engine.flat_groups for s in g.slots}
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        for name, p in engine.module.named_parameters():
            local = local_tensor(p).detach().float().to("cpu", copy=True)
            tp = slices.get(name)
            if tp is None:
                out[name] = local
                continue
            parts = [torch.empty_like(local) for _ in range(tp.size)]
            dist.all_gather(parts, local.contiguous(), group=tp_group)
            full = torch.empty(tp.shape)
            for r, part in enumerate(parts):
                tp.place(full, part, r)
            out[name] = full
    return out


def train(group, model_name: str, stage: int, tp: int, steps: int, gas: int = 1, clip: float = 0.0,
          dtype: str = "fp32", hybrid: int = 0, offload: bool = False, plain_loop: bool = False,
          optimizer_name: str = "AdamW", grid_from: str = "config", loss_parallel: bool = False,
          sequence_parallel: bool = False, client_optimizer: bool = False) -> dict:
    """Worker task on every rank of the pool's world: train on the grid, return whole parameters,
    the gradient norms, the grid's facts, memory and traffic. ``grid_from``: the config's
    ``autotp_size``, a ``DeviceMesh`` passed as ``mesh_param`` (``"mesh"``), or ``tp_model_init``.
    ``client_optimizer``: the optimizer is built by the script on the unsplit model and passed to
    ``initialize`` (instead of the config's)."""
    world = dist.get_world_size()
    dp = world // tp
    model = MODELS[model_name]()
    cfg = config(stage, tp, dp, gas, clip, dtype, hybrid, offload, optimizer_name, loss_parallel, sequence_parallel)
    kwargs = {}
    if grid_from == "mesh":
        from torch.distributed.device_mesh import init_device_mesh
        del cfg["tensor_parallel"]
        kwargs["mesh_param"] = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    elif grid_from == "tp_model_init":
        del cfg["tensor_parallel"]
        model = zerodp.tp_model_init(model, tp_size=tp, dtype=torch.float32)
    if client_optimizer:
        del cfg["optimizer"]
        cls, hyper = OPTIMIZERS[optimizer_name]
        kwargs["optimizer"] = cls(model.parameters(), **hyper)
    engine, optimizer, _, _ = zerodp.initialize(model=model, config=cfg, **kwargs)
    dp_rank = engine.dp_rank
    norms = []
    for step in range(steps):
        for m in range(gas):
            x, y = (t.to(engine.device) for t in batch(step, dp_rank, m))
            if plain_loop:  # split logits: the backward in torch's loss_parallel(), as torch asks
                from torch.distributed.tensor.parallel import loss_parallel as lp
                with lp() if loss_parallel else contextlib.nullcontext():
                    (loss_of(model_name, forward(model_name, engine, x, y), y) / gas).backward()
            else:
                loss = loss_of(model_name, forward(model_name, engine, x, y), y)
                engine.backward(loss)
                engine.step()
        if plain_loop:
            optimizer.step()
            optimizer.zero_grad()
        norms.append(engine.get_global_grad_norm())
    out = {"params": whole_params(engine), "norms": norms, "dp_rank": dp_rank, "tp_rank": engine.grid.tensor.rank,
           "memory": engine.memory_breakdown(), "comm": engine.comm_stats(by_group=True),
           "local_numel": sum(g.numel for g in engine.flat_groups)}
    engine.destroy()
    return out


def mismatched_batch(group, tp: int) -> str:
    """Rank 1 (same tensor-parallel group as rank 0) feeds a different batch: the error, per rank."""
    model = build_gpt()
    engine, _, _, _ = zerodp.initialize(model=model, config=config(1, tp, dist.get_world_size() // tp))
    x, y = batch(0, engine.dp_rank, 0)
    if dist.get_rank() == 1:
        x = (x + 1) % VOCAB
    try:
        engine(x, y)
    except RuntimeError as e:
        return str(e)
    finally:
        engine.destroy()
    return "no error"


# -- a model split by its script, Megatron-style, with an mpu ----------------------------------

class _MPU:
    """DeepSpeed's/Megatron's ``mpu`` contract over groups the script made: tensor groups of
    adjacent ranks, data groups across them."""

    def __init__(self, tp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp = tp
        for start in range(0, world, tp):
            g = dist.new_group(list(range(start, start + tp)))
            if rank in range(start, start + tp):
                self.tp_group = g
        for t in range(tp):
            g = dist.new_group(list(range(t, world, tp)))
            if rank % tp == t:
                self.dp_group = g

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_world_size(self):
        return dist.get_world_size(self.dp_group)

    def get_data_parallel_rank(self):
        return dist.get_rank(self.dp_group)

    def get_model_parallel_group(self):
        return self.tp_group

    def get_model_parallel_world_size(self):
        return self.tp

    def get_model_parallel_rank(self):
        return dist.get_rank(self.tp_group)


class _Copy(torch.autograd.Function):  # Megatron's "f": identity forward, all-reduce backward
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Reduce(torch.autograd.Function):  # Megatron's "g": all-reduce forward, identity backward
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class MegatronMLP(torch.nn.Module):
    """Embedding, a column-parallel and a row-parallel linear layer, an output layer; with
    ``group`` the two middle layers hold this rank's slices (marked as Megatron marks them)."""

    def __init__(self, group=None, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, dim)
        up, down = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)
        self.head = torch.nn.Linear(dim, VOCAB)
        self.group = group
        tp = dist.get_world_size(group) if group is not None else 1
        r = dist.get_rank(group) if group is not None else 0
        part = hidden // tp
        self.up_w = torch.nn.Parameter(up.weight.detach()[r * part:(r + 1) * part].clone())
        self.up_b = torch.nn.Parameter(up.bias.detach()[r * part:(r + 1) * part].clone())
        self.down_w = torch.nn.Parameter(down.weight.detach()[:, r * part:(r + 1) * part].clone())
        self.down_b = torch.nn.Parameter(down.bias.detach().clone())
        for p, dim_ in ((self.up_w, 0), (self.up_b, 0), (self.down_w, 1)):
            p.tensor_model_parallel, p.partition_dim = True, dim_

    def forward(self, x, y):
        h = self.emb(x)
        into = _Copy.apply(h, self.group) if self.group is not None else h  # the residual path keeps h
        a = F.gelu(F.linear(into, self.up_w, self.up_b))
        o = F.linear(a, self.down_w)
        if self.group is not None:
            o = _Reduce.apply(o, self.group)
        logits = self.head(h + o + self.down_b)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def sgd_reference(model: torch.nn.Module, dp: int, steps: int, clip: float) -> dict:
    """One process: ``model(x, y)`` (its loss) trained with SGD on the first micro-batch of ``dp``
    data-parallel ranks per step, clipped to ``clip``; its parameters and the norm of each step."""
    cls, hyper = OPTIMIZERS["SGD"]
    opt = cls(model.parameters(), **hyper)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        (sum(model(*batch(step, r, 0)) for r in range(dp)) / dp).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms}


def megatron_reference(dp: int, steps: int, clip: float) -> dict:
    return sgd_reference(MegatronMLP(), dp, steps, clip)


def megatron_train(group, stage: int, tp: int, steps: int, clip: float) -> dict:
    mpu = _MPU(tp)
    model = MegatronMLP(mpu.tp_group)
    cfg = config(stage, tp, dist.get_world_size() // tp, clip=clip, optimizer="SGD")
    del cfg["tensor_parallel"]
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, mpu=mpu)
    norms = []
    for step in range(steps):
        loss = engine(*batch(step, engine.dp_rank, 0))
        engine.backward(loss)
        engine.step()
        norms.append(engine.get_global_grad_norm())
    out = {"params": whole_params(engine), "norms": norms, "grid": engine.grid.describe()}
    engine.destroy()
    return out


def grid_round_trip(group, path: str, legs: list, gas: int, clip: float, model_name: str = "gpt") -> dict:
    """Train and checkpoint through several grids: each leg ``(stage, tp, hybrid, steps)`` (and
    optionally ``sequence_parallel``) builds a fresh model and engine on that grid, loads the
    previous leg's checkpoint (but the first), trains its steps and saves. Returns the last leg's
    whole parameters and every step's norm."""
    norms, step = [], 0
    for i, (stage, tp, hybrid, steps, *rest) in enumerate(legs):
        # later legs: every value must come from the checkpoint
        model = MODELS[model_name](seed=0 if i == 0 else 100 + i)
        cfg = config(stage, tp, dist.get_world_size() // tp, gas, clip, hybrid=hybrid, optimizer="SGD",
                     sequence_parallel=bool(rest and rest[0]))
        engine, _, _, _ = zerodp.initialize(model=model, config=cfg)
        if i:
            engine.load_checkpoint(path)
        for _ in range(steps):
            for m in range(gas):
                x, y = batch(step, engine.dp_rank, m)
                engine.backward(loss_of(model_name, forward(model_name, engine, x, y), y))
                engine.step()
            norms.append(engine.get_global_grad_norm())
            step += 1
        engine.save_checkpoint(path)
        out = {"params": whole_params(engine), "norms": norms, "global_steps": engine.global_steps}
        engine.destroy()
    return out


def save_and_export(group, path: str, stage: int, tp: int) -> dict:
    """Train two steps on a TP grid, save a checkpoint and the 16-bit model; the reference-comparable
    whole parameters and what save_16bit_model wrote (rank 0)."""
    model = build_gpt()
    engine, _, _, _ = zerodp.initialize(model=model, config=config(stage, tp, dist.get_world_size() // tp,
                                                                   2, 0.5, optimizer="SGD"))
    for step in range(2):
        for m in range(2):
            x, y = batch(step, engine.dp_rank, m)
            engine.backward(engine(x, y)[1])
            engine.step()
    engine.save_checkpoint(path, tag="tp")
    engine.save_16bit_model(path, "model16.pt")
    out = {"params": whole_params(engine)}
    engine.destroy()
    return out


def llama_checkpointed(group, stage: int, tp: int, steps: int) -> dict:
    """The Llama with activation checkpointing (``gradient_checkpointing_enable``) on a TP grid."""
    model = build_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = zerodp.initialize(model=model, config=config(stage, tp, dist.get_world_size() // tp,
                                                                   2, 0.5, optimizer="SGD"))
    norms = []
    for step in range(steps):
        for m in range(2):
            x, y = batch(step, engine.dp_rank, m)
            engine.backward(loss_of("llama", forward("llama", engine, x, y), y))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    out = {"params": whole_params(engine), "norms": norms}
    engine.destroy()
    return out


def count_tensor_collectives(group, tp: int, loss_parallel: bool = False, sequence_parallel: bool = False,
                             model_name: str = "gpt") -> dict:
    """One forward and backward of the example GPT (or ``model_name``) on a TP grid under torch's
    ``CommDebugMode``: the collectives DTensor really issued, beside what the engine counted for
    the tensor group."""
    from torch.distributed.tensor.debug import CommDebugMode
    model = MODELS[model_name]()
    engine, _, _, _ = zerodp.initialize(model=model, config=config(
        1, tp, dist.get_world_size() // tp, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel))
    x, y = batch(0, engine.dp_rank, 0)
    mode = CommDebugMode()
    with mode:
        engine.backward(loss_of(model_name, forward(model_name, engine, x, y), y))
        engine.step()  # the step too: sequence-parallel norms' partial gradients are summed when read
    counts = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
    out = {"debug_counts": counts, "engine": engine.comm_stats(by_group=True)["tensor"]}
    engine.destroy()
    return out


def refused_split(group, n_head: int, tp: int) -> str:
    """What initialize says of a model whose heads do not split over ``tp`` ranks."""
    model = build_gpt(n_head=n_head)
    try:
        zerodp.initialize(model=model, config=config(1, tp, dist.get_world_size() // tp))
    except ValueError as e:
        return str(e)
    return "no error"


def refused_option(group, case: str) -> str:
    """What initialize says of loss or sequence parallelism where zerodp cannot apply it."""
    world = dist.get_world_size()
    option = "sequence_parallel" if case == "sequence_partition_config" else "loss_parallel"
    # a plan from a partition_config: no norms named; a model whose plan gathers no logits
    model, cfg = PlainMLP(), config(1, 2, world // 2, **{option: True})
    cfg["tensor_parallel"]["partition_config"] = PARTITION_CONFIG
    try:
        zerodp.initialize(model=model, config=cfg)
    except ValueError as e:
        return str(e)
    return "no error"


def refused_gloo_on_cuda(group) -> str:
    """What initialize says of tensor parallelism over gloo where the engine computes on CUDA (on a
    machine without one, as if ``core/device.py`` had picked a GPU: the check comes first)."""
    import zerodp.core.device as device
    world = dist.get_world_size()
    chosen = device.default_device
    device.default_device = lambda: torch.device("cuda", 0)
    try:
        zerodp.initialize(model=build_gpt(), config=config(1, 2, world // 2))
    except ValueError as e:
        return str(e)
    finally:
        device.default_device = chosen
    return "no error"


class PlainMLP(torch.nn.Module):
    """A model zerodp has no plan for: split only by the config's ``partition_config``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, x, y):
        h = self.emb(x)
        logits = self.head(h + self.down(torch.relu(self.up(h))))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


PARTITION_CONFIG = {"layer_specs": [{"patterns": [r"^up\.weight$"], "partition_type": "column"},
                                    {"patterns": [r"^down\.weight$"], "partition_type": "row"}]}


def partition_config_train(group, stage: int, tp: int, steps: int) -> dict:
    cfg = config(stage, tp, dist.get_world_size() // tp, clip=0.5, optimizer="SGD")
    cfg["tensor_parallel"]["partition_config"] = PARTITION_CONFIG
    engine, _, _, _ = zerodp.initialize(model=PlainMLP(), config=cfg)
    norms = []
    for step in range(steps):
        engine.backward(engine(*batch(step, engine.dp_rank, 0)))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    out = {"params": whole_params(engine), "norms": norms,
           "split": sorted(s.name for g in engine.flat_groups for s in g.slots if s.tp is not None)}
    engine.destroy()
    return out


def partition_config_reference(dp: int, steps: int) -> dict:
    return sgd_reference(PlainMLP(), dp, steps, 0.5)


def embedding_backward_rows(group, tp: int) -> dict:
    """The rows of every embedding gradient made in one step of the example GPT split over the
    vocabulary (``aten.embedding_dense_backward``'s ``num_weights``, seen by a dispatch mode),
    and the step's loss."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Rows(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.embedding_dense_backward.default:
                self.seen.append(int(args[2]))
            return func(*args, **(kwargs or {}))

    engine, *_ = zerodp.initialize(model=build_gpt(), config=config(1, tp, dist.get_world_size() // tp))
    x, y = batch(0, engine.dp_rank, 0)
    loss = loss_of("gpt", forward("gpt", engine, x, y), y)
    with Rows() as rows:
        engine.backward(loss)
    engine.step()
    engine.destroy()
    return {"rows": rows.seen, "loss": loss.item()}

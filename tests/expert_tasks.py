"""Worker tasks for ``test_expert.py``: a small mixture-of-experts model with its experts split over
expert-parallel groups (``parallel/expert.py``), trained through the engine at ZeRO stages 0-3 on 4
ranks, against the same model with every expert on one process."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp
from zerodp.parallel.expert import ExpertParallelMoE

EXPERTS, HIDDEN, VOCAB, TOP_K, BATCH, SEQ = 4, 8, 32, 2, 2, 3


class ToyMoE(nn.Module):
    """Embedding, one mixture-of-experts layer (top-2 of 4, the last expert's router logit pushed
    down so that it is never chosen and others are often idle on a rank), output layer."""

    def __init__(self, ep: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        router = nn.Linear(HIDDEN, EXPERTS)
        with torch.no_grad():
            router.bias[-1] = -20.0
        experts = [nn.Sequential(nn.Linear(HIDDEN, 16), nn.GELU(), nn.Linear(16, HIDDEN)) for _ in range(EXPERTS)]
        self.moe = ExpertParallelMoE(router, experts, TOP_K, ep)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = x + self.moe(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _batches(steps: int, world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    return [[(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
             for _ in range(world)] for _ in range(steps)]


def train_expert_parallel(group, stage: int, ep: int, steps: int = 3, gas: int = 1, offload: bool = False,
                          bf16: bool = False, offload_params: bool = False, fp16: bool = False) -> dict:
    """``steps`` optimizer steps of ``gas`` micro-batches (optimizer states in host memory with
    ``offload``); the losses per micro-batch, the gradient norms per step, the parameters."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    model = ToyMoE(ep)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 1}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_params:
        zero["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
           "gradient_clipping": 1.0, "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_optimization": zero,
           "bf16": {"enabled": bf16}, "fp16": {"enabled": fp16, "initial_scale_power": 8}}
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, process_group=group)
    ref = ToyMoE(1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses, norms, ref_losses, ref_norms = [], [], [], []
    for i, batch in enumerate(_batches(steps * gas, world)):
        loss = engine(*batch[rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        per_rank = [ref(*b) for b in batch]
        if i % gas == 0:
            opt.zero_grad()
        (torch.stack(per_rank).mean() / gas).backward()
        if (i + 1) % gas == 0:
            norms.append(engine.get_global_grad_norm())
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
            opt.step()
        ref_losses.append(per_rank[rank].item())
    params = list(engine.module.parameters())
    with zerodp.zero.GatheredParameters(params):
        mine = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    want = dict(ref.named_parameters())
    counts = engine.comm_stats(by_group=True)
    # the whole model as the 16-bit saves gather it (on rank 0): every expert, from its rank
    whole = engine._consolidated_16bit_state_dict() if (ep > 1 or stage == 3) else {}
    engine.destroy()
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms,
            "params": mine, "ref_params": {n: want[n].detach().clone() for n in mine},
            "local": engine.module.moe.local, "groups": sorted(counts), "whole": whole,
            "ref_whole": {n: p.detach().clone() for n, p in want.items()} if whole else {}}


def refusals(group) -> dict:
    from zerodp.parallel.expert import ExpertParallelError

    def experts(n):
        return [nn.Linear(HIDDEN, HIDDEN) for _ in range(n)]
    out = {}
    for key, make in (("experts", lambda: ExpertParallelMoE(nn.Linear(HIDDEN, 4), experts(4), 2, 3)),
                      ("world", lambda: ExpertParallelMoE(nn.Linear(HIDDEN, 3), experts(3), 2, 3)),
                      ("top_k", lambda: ExpertParallelMoE(nn.Linear(HIDDEN, 4), experts(4), 5, 2)),
                      ("with_hybrid", lambda: zerodp.initialize(model=ToyMoE(2), process_group=group, config={
                          "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "mics_shard_size": 2},
                          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))):
        try:
            make()
            out[key] = "accepted"
        except (ExpertParallelError, ValueError) as e:
            out[key] = str(e)
    return out


def _mixtral(experts: int = 4):
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=experts,
                        num_experts_per_tok=2, max_position_embeddings=32, attn_implementation="sdpa")
    return MixtralForCausalLM(cfg)


def _qwen3_moe(experts: int = 4):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=experts,
                         num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=32,
                         attn_implementation="sdpa")
    return Qwen3MoeForCausalLM(cfg)


def train_hf_expert_parallel(group, stage: int, ep: int, road: str = "api", steps: int = 3,
                             kind: str = "qwen3") -> dict:
    """transformers' Qwen3-MoE with its fused experts split by ``expert_parallelize`` (``road`` "api")
    or by the config's ``expert_parallel`` block ("config", DeepSpeed's AutoEP keys; "init": the model
    built in ``zero.Init`` first), against the same model on one process."""
    from zerodp.parallel.expert_hf import expert_parallelize, local_expert_range
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    build = _mixtral if kind == "mixtral" else _qwen3_moe
    if road == "init":  # built in zero.Init, given the reference's values as a checkpoint load would
        from zerodp.core.init_shards import gathered
        with zerodp.zero.Init(data_parallel_group=group):
            model = build()
        values = dict(build().named_parameters())
        for n, p in model.named_parameters():
            with gathered([p], 0), torch.no_grad():
                p.copy_(values[n])
    else:
        model = build()
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**9, "gradient_clipping": 1.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    if road == "api":
        expert_parallelize(model, ep)
    else:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep, "top_k": 2,
                                  "preset_model": "mixtral" if kind == "mixtral" else "qwen3_moe"}
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, process_group=group)
    split = [r for m in engine.module.modules() if (r := local_expert_range(m)) is not None]
    chosen = []  # the experts this rank's tokens chose, per layer and step
    for m in engine.module.modules():
        if local_expert_range(m) is not None or (ep == 1 and hasattr(m, "gate_up_proj")):
            m.register_forward_pre_hook(lambda mod, args: chosen.append(sorted(set(args[1].flatten().tolist()))))
    ref = build()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses, norms, ref_losses, ref_norms = [], [], [], []
    for batch in _batches(steps, world):
        ids, labels = batch[rank]
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
        per_rank = [ref(input_ids=i, labels=lab).loss for i, lab in batch]
        opt.zero_grad()
        torch.stack(per_rank).mean().backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        opt.step()
        ref_losses.append(per_rank[rank].item())
    with zerodp.zero.GatheredParameters(list(engine.module.parameters())):
        mine = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    experts = split[0] if split else range(4)
    want = {}
    for n, p in ref.named_parameters():
        want[n] = p.detach()[experts.start:experts.stop].clone() if ".mlp.experts." in n else p.detach().clone()
    engine.destroy()
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms,
            "params": mine, "ref_params": want, "experts": list(experts), "chosen": chosen}


def autoep_refusals(group) -> dict:
    out = {}
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    for key, experts, ep in (("preset", 4, {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}),
                             ("top_k", 4, {"enabled": True, "autoep_size": 2, "top_k": 3}),
                             ("world", 4, {"enabled": True, "autoep_size": 3}),
                             ("experts", 6, {"enabled": True, "autoep_size": 4})):
        try:
            zerodp.initialize(model=_qwen3_moe(experts), config={**base, "expert_parallel": ep}, process_group=group)
            out[key] = "accepted"
        except ValueError as e:
            out[key] = str(e)
    return out

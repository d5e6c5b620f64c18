"""Worker tasks for ``test_sequence.py``'s Hugging Face road: DeepSpeed's ``UlyssesSPAttentionHF``
registered with transformers on a small Llama, the Trainer's sequence-parallel loss, against the
same model on one process; and the data loader adapter."""
from __future__ import annotations

import torch
import torch.distributed as dist

import zerodp
from zerodp.parallel import sequence as sp_mod
from zerodp.parallel import sequence_hf

SEQ, BATCH, VOCAB = 16, 2, 64


def _llama(kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _batches(steps: int, dp: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (dp * BATCH, SEQ), generator=g) for _ in range(steps)]


class _GatherWithGrad(torch.autograd.Function):
    """``torch.distributed.nn.functional.all_gather`` (the Trainer's): every rank's tensor, and in
    backward the sum over the ranks of the gradient of this rank's. torch's own backward on gloo
    scatters from group ranks taken as global ranks, which fails for a group without rank 0, so the
    same function is written here with an all-reduce."""

    @staticmethod
    def forward(ctx, group, t):
        ctx.group = group
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, t.contiguous(), group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        total = torch.stack(grads)
        dist.all_reduce(total, group=ctx.group)
        return None, total[dist.get_rank(ctx.group)]


def _sp_loss(model, inputs: dict, group) -> torch.Tensor:
    """The Trainer's loss under DeepSpeed sequence parallelism (``deepspeed_sp_compute_loss``): each
    rank's mean over its valid tokens, weighted by them over the group."""
    loss = model(**inputs, labels=inputs["shift_labels"]).loss
    good = (inputs["shift_labels"] != -100).view(-1).sum()
    losses = torch.stack(_GatherWithGrad.apply(group, loss))
    goods = torch.stack(_GatherWithGrad.apply(group, good.float()))
    safe = torch.where(goods > 0, losses, torch.zeros_like(losses))
    return (safe * goods).sum() / goods.sum().clamp(min=1)


def train_hf_sequence_parallel(group, stage: int, sp: int, kv_heads: int, steps: int = 3) -> dict:
    sp_mod.forget_sequence_axis()
    sequence_hf.unregister_from_transformers()
    world = dist.get_world_size()
    dp = world // sp
    model = _llama(kv_heads)
    mpu = sequence_hf.UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation="sdpa", sequence_parallel_size=sp, micro_batch_size=BATCH)
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**9, "gradient_clipping": 1.0,
           # SGD: Adam would turn the rounding of near-zero gradients into whole steps
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    engine, _, _, _ = zerodp.initialize(model=model, config=cfg, mpu=mpu)
    sp_group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
    chunk = SEQ // sp
    cut = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    losses, norms = [], []
    for ids in _batches(steps, dp):
        mine = ids[engine.dp_rank * BATCH:(engine.dp_rank + 1) * BATCH]
        shift = torch.nn.functional.pad(mine, (0, 1), value=-100)[:, 1:]
        inputs = {"input_ids": mine[:, cut].contiguous(), "position_ids": torch.arange(SEQ)[cut].repeat(BATCH, 1),
                  "shift_labels": shift[:, cut].contiguous()}  # as the data loader adapter serves them
        loss = _sp_loss(engine, inputs, sp_group)
        engine.backward(loss)
        engine.step()
        norms.append(engine.get_global_grad_norm())
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    sequence_hf.unregister_from_transformers()
    sp_mod.forget_sequence_axis()

    ref = _llama(kv_heads)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses, ref_norms = [], []
    for ids in _batches(steps, dp):
        loss = ref(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        opt.step()
        ref_losses.append(loss.item())
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms, "params": params,
            "ref_params": {n: p.detach().clone() for n, p in ref.named_parameters()}}


class _Loader:
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def adapter_slices(group) -> dict:
    """Each rank of a group of 4 draws its own batch; every rank serves its slice of each, in rank
    order, with the labels shifted on the whole sequence."""
    sp_mod.forget_sequence_axis()
    axis = sp_mod.initialize_sequence_parallel(4)
    rank = dist.get_rank()
    ids = torch.arange(8).view(1, 8) + 100 * rank
    batch = {"input_ids": ids, "position_ids": torch.arange(8).view(1, 8), "labels": ids.clone(), "tag": rank}
    adapter = sequence_hf.UlyssesSPDataLoaderAdapter(_Loader([batch]), sp_rank=axis.rank, sp_group=axis.group,
                                                     sp_world_size=4, device="cpu")
    served = [next(adapter) for _ in range(4)]
    try:
        next(adapter)
        stopped = False
    except StopIteration:
        stopped = True
    bad = sequence_hf.UlyssesSPDataLoaderAdapter(_Loader([{"input_ids": ids, "labels": ids}]), sp_rank=axis.rank,
                                                 sp_group=axis.group, sp_world_size=4, device="cpu")
    try:
        next(bad)
        error = None
    except ValueError as e:
        error = str(e)
    sp_mod.forget_sequence_axis()
    return {"served": [{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in b.items()} for b in served],
            "length": len(adapter), "stopped": stopped, "error": error}


def flex_forward(group) -> float:
    """flex attention under Ulysses (sp 2 of 4 ranks), forward only (torch has no flex backward on
    the CPU): each rank's slice of the logits against one process's whole-sequence forward; the
    largest difference."""
    sp_mod.forget_sequence_axis()
    sequence_hf.unregister_from_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="sdpa"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="flex_attention"))
    mpu = sequence_hf.UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation="flex_attention", sequence_parallel_size=2, micro_batch_size=BATCH)
    try:
        ids = _batches(1, 1)[0]
        chunk = SEQ // 2
        cut = slice(mpu.get_sequence_parallel_rank() * chunk, (mpu.get_sequence_parallel_rank() + 1) * chunk)
        with torch.no_grad():
            mine = model(input_ids=ids[:, cut], position_ids=torch.arange(SEQ)[cut].expand(BATCH, -1)).logits
            want = ref(input_ids=ids).logits[:, cut]
        return (mine - want).abs().max().item()
    finally:
        sequence_hf.unregister_from_transformers()
        sp_mod.forget_sequence_axis()

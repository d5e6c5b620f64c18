"""Worker tasks for ``test_sequence.py``: Ulysses sequence parallelism (``parallel/sequence.py``) on a
small causal attention model, against one process training on the whole batch and sequence."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp
from zerodp.parallel import sequence as sp_mod

VOCAB, DIM, HEADS, SEQ, BATCH = 37, 16, 4, 8, 2


class TinyAttentionLM(nn.Module):
    """Embedding, one causal attention block (optionally with fewer key/value heads), an MLP and the
    output layer; with ``comm`` the attention runs Ulysses over that sequence-parallel group."""

    def __init__(self, kv_heads: int = HEADS, comm=None, layer: str = "function") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kv_heads, self.comm, self.layer = kv_heads, comm, layer
        d = DIM // HEADS
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(64, DIM)
        self.q = nn.Linear(DIM, DIM)
        self.kv = nn.Linear(DIM, 2 * kv_heads * d, bias=False)  # a key bias gets no gradient: Adam would amplify noise
        self.o = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)
        self.dist_attn = None
        if comm is not None and layer == "deepspeed":
            self.dist_attn = sp_mod.DistributedAttention(self._bshd_attention)  # the process's group

    @staticmethod
    def _core(q, k, v):  # [b, h, s, d]
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def _bshd_attention(self, q, k, v):  # DeepSpeed's layout, [b, s, h, d]
        return self._core(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)

    def forward(self, ids, positions):
        b, s = ids.shape
        d = DIM // HEADS
        x = self.emb(ids) + self.pos(positions)
        q = self.q(x).view(b, s, HEADS, d)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, d).unbind(2)
        if self.dist_attn is not None:
            att = self.dist_attn(q, k, v, 0)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            att = (sp_mod.ulysses_attention(q, k, v, self._core, self.comm) if self.comm is not None
                   else self._core(q, k, v)).transpose(1, 2)
        x = x + self.o(att.reshape(b, s, DIM))
        x = x + self.mlp(x)
        return self.head(x)


def _batches(steps: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: the ids of every data-parallel rank's samples, ``[dp * BATCH, SEQ]``, and their labels
    (the next token, shifted on the whole sequence before any split; the last one unknown: -100)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (dp * BATCH, SEQ), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full((dp * BATCH, 1), -100)], dim=1)
        out.append((ids, labels))
    return out


def _config(stage: int, sp: int, gas: int = 1, offload: bool = False) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 1}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "gradient_clipping": 1.0, "sequence_parallel_size": sp, "zero_optimization": zero}


def train_sequence_parallel(group, stage: int, sp: int, kv_heads: int, layer: str, steps: int = 3,
                            road: str = "config", gas: int = 1, offload: bool = False) -> dict:
    """``steps`` steps of ``gas`` micro-batches with ``sp`` sequence-parallel ranks per group (world 4):
    each rank runs its data-parallel group's samples, its slice of the sequence, and the mean loss
    over its tokens (optimizer states in host memory with ``offload``). Returns the losses (per
    micro-batch, averaged over the ranks), the gradient norms (per step) and the parameters, and the
    same from one process."""
    sp_mod.forget_sequence_axis()
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // sp
    if road == "mpu":  # DeepSpeed's module is the mpu (deepspeed.runtime.sequence_parallel.parallel_state_sp)
        from zerodp.runtime.sequence_parallel import parallel_state_sp as mpu
        mpu.initialize_sequence_parallel(sp)
        model = TinyAttentionLM(kv_heads, sp_mod.sequence_axis().comm(label="sequence"), layer)
        engine, _, _, _ = zerodp.initialize(model=model, config=_config(stage, 1), mpu=mpu)
    else:
        axis = sp_mod.initialize_sequence_parallel(sp)  # before the model, as DeepSpeed's users do
        model = TinyAttentionLM(kv_heads, axis.comm(label="sequence"), layer)
        engine, _, _, _ = zerodp.initialize(model=model, config=_config(stage, sp, gas, offload))
    assert engine.dp_world_size == dp and engine.seq_dp_world_size == world
    me_dp, me_sp = engine.dp_rank, rank % sp
    chunk = SEQ // sp
    cut = slice(me_sp * chunk, (me_sp + 1) * chunk)
    losses, norms = [], []
    for i, (ids, labels) in enumerate(_batches(steps * gas, dp)):
        mine = slice(me_dp * BATCH, (me_dp + 1) * BATCH)
        x, y = ids[mine, cut], labels[mine, cut]
        pos = torch.arange(SEQ)[cut].expand(BATCH, -1)
        logits = engine(x, pos)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum") \
            / (y != -100).sum().clamp(min=1) * (y.numel() / (BATCH * chunk))
        engine.backward(loss)
        engine.step()
        if (i + 1) % gas == 0:
            norms.append(engine.get_global_grad_norm())
        total = torch.tensor([loss.item() * (y != -100).sum().item(), float((y != -100).sum())])
        dist.all_reduce(total)
        losses.append(total[0].item() / total[1].item())
    params = {}
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    sp_mod.forget_sequence_axis()

    # one process: every sample, the whole sequence, one mean over all tokens
    ref = TinyAttentionLM(kv_heads)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    ref_losses, ref_norms = [], []
    for i, (ids, labels) in enumerate(_batches(steps * gas, dp)):
        logits = ref(ids, torch.arange(SEQ).expand(ids.shape[0], -1))
        # each rank's loss is its tokens' mean; the engine averages over the ranks
        per_rank = []
        for g in range(dp):
            for r in range(sp):
                y = labels[g * BATCH:(g + 1) * BATCH, r * chunk:(r + 1) * chunk]
                lg = logits[g * BATCH:(g + 1) * BATCH, r * chunk:(r + 1) * chunk]
                per_rank.append(F.cross_entropy(lg.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100,
                                                reduction="sum") / (y != -100).sum().clamp(min=1)
                                * (y.numel() / (BATCH * chunk)))
        loss = torch.stack(per_rank).mean() / gas
        if i % gas == 0:
            opt.zero_grad()
        loss.backward()
        if (i + 1) % gas == 0:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
            opt.step()
        valid = (labels != -100).sum()
        ref_losses.append(F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100,
                                          reduction="sum").item() / valid.item())
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms, "params": params,
            "ref_params": {n: p.detach().clone() for n, p in ref.named_parameters()}}


def refusals(group) -> dict:
    """What sequence parallelism refuses, by message."""
    sp_mod.forget_sequence_axis()
    out = {}
    comm = sp_mod.initialize_sequence_parallel(4).comm()
    q = torch.zeros(1, 6, 8, 2)  # 6 heads over 4 ranks
    for name, fn in {
        "heads": lambda: sp_mod.ulysses_attention(q, q, q, TinyAttentionLM._core, comm),
        "kv_heads": lambda: sp_mod.ulysses_attention(torch.zeros(1, 4, 2, 2), torch.zeros(1, 3, 2, 2),
                                                     torch.zeros(1, 3, 2, 2), TinyAttentionLM._core, comm),
        "sequence": lambda: comm.all_to_all(torch.zeros(1, 6, 4, 2), 1, 2),
        "deepspeed_kv": lambda: sp_mod.DistributedAttention(TinyAttentionLM._core)(
            torch.zeros(1, 2, 4, 2), torch.zeros(1, 2, 2, 2), torch.zeros(1, 2, 2, 2), 0),
        "other_size": lambda: sp_mod.initialize_sequence_parallel(2),
        "with_tensor": lambda: (sp_mod.forget_sequence_axis(), zerodp.initialize(model=TinyAttentionLM(), config={
            **_config(1, 2), "tensor_parallel": {"autotp_size": 2}})),
    }.items():
        try:
            fn()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            out[name] = f"{type(e).__name__}: {e}"
    sp_mod.forget_sequence_axis()
    return out


def save_with_sequence_parallel_load_without(group, path: str, stage: int) -> dict:
    """Train two steps at sequence-parallel size 2, save; load into engines at sizes 1 and 4 of the
    same model (another split of the same ranks) and compare the parameters."""
    import os
    sp_mod.forget_sequence_axis()
    axis = sp_mod.initialize_sequence_parallel(2)
    engine, _, _, _ = zerodp.initialize(model=TinyAttentionLM(2, axis.comm(label="sequence")),
                                        config=_config(stage, 2))
    chunk = SEQ // 2
    me_sp = dist.get_rank() % 2
    for ids, labels in _batches(2, engine.dp_world_size):
        mine = slice(engine.dp_rank * BATCH, (engine.dp_rank + 1) * BATCH)
        cut = slice(me_sp * chunk, (me_sp + 1) * chunk)
        logits = engine(ids[mine, cut], torch.arange(SEQ)[cut].expand(BATCH, -1))
        engine.backward(F.cross_entropy(logits.reshape(-1, VOCAB), labels[mine, cut].reshape(-1), ignore_index=-100))
        engine.step()
    engine.save_checkpoint(os.path.join(path, "ckpt"), tag="t")
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    sp_mod.forget_sequence_axis()
    out = {}
    for sp in (1, 4):
        comm = sp_mod.initialize_sequence_parallel(sp).comm(label="sequence") if sp > 1 else None
        other, _, _, _ = zerodp.initialize(model=TinyAttentionLM(2, comm), config=_config(stage, sp))
        other.load_checkpoint(os.path.join(path, "ckpt"), tag="t")
        with zerodp.GatheredParameters(list(other.module.parameters())):
            out[sp] = all(torch.equal(p, saved[n]) for n, p in other.module.named_parameters())
        out[f"steps{sp}"] = other.global_steps
        other.destroy()
        sp_mod.forget_sequence_axis()
    return out

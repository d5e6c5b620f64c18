"""Worker tasks for ``test_tiled.py``: a model whose MLP and loss run tiled (``parallel/tiled.py``)
trained by the engine, against the same model untiled on one process."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp
from zerodp.parallel.tiled import TiledFusedLogitsLoss, TiledMLP

DIM, VOCAB, SEQ, BATCH = 12, 29, 12, 2


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class TiledNet(nn.Module):
    def __init__(self, tiles: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tiles = tiles
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mlp = Mlp()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, labels):
        x = self.emb(ids)
        if self.tiles > 1:
            x = x + TiledMLP.apply(lambda m, t: m(t), self.mlp, x, self.tiles, list(self.mlp.parameters()))
            loss_sum = TiledFusedLogitsLoss.apply(
                lambda m, xt, yt: F.cross_entropy(m(xt), yt, reduction="sum"), self.head, x, labels, None,
                self.tiles, list(self.head.parameters()), "sum")
        else:
            x = x + self.mlp(x)
            loss_sum = F.cross_entropy(self.head(x).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
        return loss_sum / labels.numel()


def train_tiled(group, stage: int, tiles: int, gas: int) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": 0.2}}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    engine, _, _, _ = zerodp.initialize(model=TiledNet(tiles), config=cfg, process_group=group)
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=g) for _ in range(2 * gas)]
    norms = []
    for i, batch in enumerate(data):
        mine = batch[rank * BATCH:(rank + 1) * BATCH]
        engine.backward(engine(mine[:, :-1], mine[:, 1:]))
        engine.step()
        if (i + 1) % gas == 0:
            norms.append(engine.get_global_grad_norm())
    with zerodp.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    ref = TiledNet(1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    ref_norms = []
    for i, batch in enumerate(data):
        (ref(batch[:, :-1], batch[:, 1:]) / gas).backward()
        if (i + 1) % gas == 0:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
            opt.step()
            opt.zero_grad()
    return {"norms": norms, "ref_norms": ref_norms, "params": params,
            "ref_params": {n: p.detach().clone() for n, p in ref.named_parameters()}}

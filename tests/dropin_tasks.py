"""Worker tasks for ``test_dropin_api.py``: DeepSpeed's module-level names and engine queries,
called from real ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zerodp
import zerodp.comm as ds_comm
from zerodp.accelerator import get_accelerator


def comm_calls(group) -> dict:
    """zerodp.comm's collectives, as a script calls them (on the test's group of 2 ranks)."""
    rank, world = ds_comm.get_rank(group), ds_comm.get_world_size(group)
    t = torch.tensor([float(rank + 1)])
    ds_comm.all_reduce(t, group=group)
    b = torch.tensor([float(rank * 10)])
    ds_comm.broadcast(b, src=dist.get_global_rank(group, world - 1), group=group)
    parts = [torch.zeros(1) for _ in range(world)]
    ds_comm.all_gather(parts, torch.tensor([float(rank)]), group=group)
    ds_comm.barrier(group=group)
    return {"rank": rank, "world": world, "initialized": ds_comm.is_initialized(),
            "all_reduce": t.item(), "broadcast": b.item(), "all_gather": [p.item() for p in parts],
            "backend": get_accelerator().communication_backend_name()}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def engine_queries(group, stage: int, precision: str) -> dict:
    torch.manual_seed(0)
    model = Net()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                          "warmup_num_steps": 10}},
           "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    engine, opt, _, sched = zerodp.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                              process_group=group)
    out = {"fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(), "stage": engine.zero_optimization_stage(),
           "world_size": engine.world_size, "global_rank": engine.global_rank, "local_rank": engine.local_rank,
           "device": str(engine.device), "module_is_model": engine.module is model,
           "optimizer_is": opt is engine.optimizer,
           "scheduler_is": sched is engine.lr_scheduler and sched is not None,
           "gas": engine.gradient_accumulation_steps(), "train_batch_size": engine.train_batch_size(),
           "micro": engine.train_micro_batch_size_per_gpu(), "norm_before": engine.get_global_grad_norm()}
    engine.eval()
    out["eval_mode"] = (not engine.training, not model.training)
    engine.train()
    out["train_mode"] = (engine.training, model.training)
    applied = []
    for micro in range(6):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(micro * 7 + dist.get_rank(group)))
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        applied.append(engine.was_step_applied())
    out.update(applied=applied, global_steps=engine.global_steps, lr=engine.get_lr(),
               norm=engine.get_global_grad_norm(), global_samples=engine.global_samples)
    engine.destroy()
    return out

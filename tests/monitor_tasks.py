"""Worker tasks for the training-metrics tests: a tiny model trained with the CSV monitor on."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zerodp

MICRO = 3


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def make_config(directory: str, job: str, stage: int, gas: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                         "warmup_num_steps": 3}},
            "zero_optimization": {"stage": stage},
            "csv_monitor": {"enabled": True, "output_path": directory, "job_name": job}}


def train_and_record(group, directory: str, job: str, stage: int = 2, gas: int = 2, steps: int = 3,
                     tokens_per_sample=None, model_parameters=None) -> dict:
    """Train ``steps`` optimizer steps and return what the engine reported along the way:
    per step the micro-batch losses, the learning rates the update used, the gradient norm,
    memory and communication; plus where this rank's monitor writes."""
    rank = dist.get_rank(group) if group is not None else 0
    model = build_model()
    params = model_parameters(model) if model_parameters is not None else None
    engine, _, _, _ = zerodp.initialize(model=model, model_parameters=params,
                                        config=make_config(directory, job, stage, gas),
                                        process_group=group)
    if tokens_per_sample is not None:
        engine.monitor.tokens_per_sample = tokens_per_sample
    gen = torch.Generator().manual_seed(100 + rank)
    record = {"losses": [], "lrs": [], "grad_norms": [], "memory": [], "comm": []}
    for _ in range(steps):
        losses = []
        for _ in range(gas):
            x = torch.randn(MICRO, 6, generator=gen)
            loss = engine(x).pow(2).mean()
            losses.append(loss.item())
            if engine.is_gradient_accumulation_boundary():
                record["lrs"].append(engine.get_lr())  # what this step's update uses
            engine.backward(loss)
            engine.step()
        record["losses"].append(losses)
        record["grad_norms"].append(engine.get_global_grad_norm())
        record["memory"].append(engine.memory_breakdown())
        record["comm"].append(engine.comm_stats())
    monitor = engine.monitor
    record.update(writes=monitor.writes, csv_path=str(monitor.csv_path) if monitor.csv_path else None,
                  train_batch_size=engine.train_batch_size(), world_size=engine.world_size,
                  stage=engine.zero_stage)
    monitor.close()
    engine.destroy()
    return record

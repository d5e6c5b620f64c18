r"""A training script that survives a lost process: run it under torchrun with restarts,

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 \
        ft_script.py CKPT_DIR OUT_DIR [STEPS]

and when any rank dies, torchrun restarts every rank; each one loads the newest checkpoint
and goes on from the step it names. Batches are a function of (rank, step) alone, so the
run ends with the same weights as one that was never interrupted. (The variable gives each
attempt a rendezvous store of its own; with torch's default, the restarted ranks can read
the dead ones' addresses from the old store and fail to connect.)
"""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp

SAVE_EVERY = 10


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: the same on every attempt."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(64, 32, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def main() -> None:
    ckpt_dir, out_dir = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 64, "zero_optimization": {"stage": 2}}
    engine, _, _, _ = zerodp.initialize(model=model, optimizer=optimizer, config=config)

    path, _ = engine.load_checkpoint(ckpt_dir)  # (None, None) on the first attempt
    if path is not None and engine.global_rank == 0:
        print(f"resumed from {path} at step {engine.global_steps}", flush=True)

    while engine.global_steps < steps:
        x, y = batch(engine.global_rank, engine.global_steps)
        loss = F.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        if engine.global_steps % SAVE_EVERY == 0:
            engine.save_checkpoint(ckpt_dir)

    engine.save_16bit_model(out_dir, "model.safetensors")  # full weights, written by rank 0
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

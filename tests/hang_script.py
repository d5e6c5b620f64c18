"""One rank of a job in which rank VICTIM stops answering (SIGSTOP) at PLACE, or is slow there.

    python hang_script.py RANK WORLD PORT STAGE PLACE VICTIM OUT_DIR

PLACE: ``forward`` or ``backward`` (inside a block's forward or backward at step 2), ``step`` (in
the optimizer's step at step 2), ``save`` (writing its shard of a checkpoint after step 2), or
``slow`` (the victim sleeps 7 s in the forward of step 2, its heartbeat going on). The engine
runs with ``comms_timeout_s: 2``. Each other rank lets the engine's error end it, as a script would,
after writing what it saw to OUT_DIR/rank{RANK}.json just before (the test reads those, and the
exit code).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zerodp
from zerodp.examples.gpt import Block, build_gpt

TIMEOUT_S = 2.0


def main() -> None:
    rank, world, port, stage, place, victim, out = sys.argv[1:]
    rank, world, stage, victim, out = int(rank), int(world), int(stage), int(victim), Path(out)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if place == "pipeline":
        return pipeline(rank, stage, victim, out)
    torch.manual_seed(0)
    model = build_gpt("tiny", n_layer=3)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "comms_timeout_s": TIMEOUT_S,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    engine, *_ = zerodp.initialize(model=model, config=config, unit_classes=(Block,))
    current, fired = [0], []

    def stop_here():
        if rank == victim and current[0] == 2 and not fired:
            fired.append(True)
            if place == "slow":
                time.sleep(3.5 * TIMEOUT_S)
            else:
                os.kill(os.getpid(), signal.SIGSTOP)

    block = engine.module.blocks[1]
    if place in ("forward", "slow"):
        block.register_forward_pre_hook(lambda m, a: stop_here())
    elif place == "backward":
        block.register_full_backward_pre_hook(lambda m, g: stop_here())
    elif place == "step":  # the engine calls the optimizer class's step
        cls = type(engine.optimizer)
        inner = cls.step

        def step(self, *a, **k):
            stop_here()
            return inner(self, *a, **k)
        cls.step = step
    elif place == "save":
        from zerodp.checkpoint import save as save_module
        write = save_module._Job.write_rank

        def write_rank(job):
            stop_here()
            return write(job)
        save_module._Job.write_rank = write_rank
    report = {"rank": rank, "steps": 0}
    try:
        for step in range(4):
            current[0] = step
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randint(0, 256, (2, 32), generator=g)
            _, loss = engine(x, torch.roll(x, -1, 1))
            engine.backward(loss)
            engine.step()
            report["steps"] = step + 1
            if place == "save" and step == 1:
                current[0] = 2
                engine.save_checkpoint(str(out / "ckpt"))
        report["error"] = None
    except Exception as e:  # reported, then raised: the process ends as a user's script would
        report["error"] = f"{type(e).__name__}: {e}"
        report["at"] = time.time()
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        raise
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def pipeline(rank: int, stage: int, victim: int, out: Path) -> None:
    """Two pipeline stages (``pp_tasks``' model, 1F1B); the victim stops in a block's forward at
    step 2, inside torch's schedule, whose sends and receives the engine's watchdog guards."""
    import pp_tasks
    config = pp_tasks.config(stage, 2, "1F1B")
    config["comms_timeout_s"] = TIMEOUT_S
    model = pp_tasks.build(2)
    engine, *_ = zerodp.initialize(model=model, config=config)
    current = [0]

    def stop_here(*_) -> None:
        if current[0] == 2:
            os.kill(os.getpid(), signal.SIGSTOP)
    for m in model.modules():
        if isinstance(m, pp_tasks.Block) and rank == victim:
            m.register_forward_pre_hook(stop_here)
    for step in range(4):
        current[0] = step
        engine.train_batch(iter([pp_tasks.micro_batch(step, engine.dp_rank, m) for m in range(2)]))
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "steps": 4, "error": None}))


if __name__ == "__main__":
    main()
    # the report is written: end here, before gloo's teardown, which aborts about one run in 40
    # ("terminate called without an active exception") after all work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

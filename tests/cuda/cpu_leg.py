"""The CPU leg of the CUDA checkpoint test: started with no GPU visible, it loads a checkpoint a
CUDA engine wrote, trains one step on the CPU, saves, and reports what it held.

    CUDA_VISIBLE_DEVICES= python cpu_leg.py STAGE DTYPE LOAD_DIR SAVE_DIR FIRST OUT.pt
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tasks' modules

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from checkpoint_tasks import make_engine, snapshot, train_steps  # noqa: E402

from zerodp.utils import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402


def main() -> None:
    stage, dtype, load_dir, save_dir, first, out = sys.argv[1:]
    stage, first = int(stage), int(first)
    assert not torch.cuda.is_available()
    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=0, world_size=1)
    engine = make_engine(None, stage, dtype, seed=123)
    engine.load_checkpoint(load_dir)
    result = {"device": str(engine.device), "loaded": snapshot(engine),
              "consolidated": get_fp32_state_dict_from_zero_checkpoint(load_dir)}
    result["norms"] = train_steps(engine, first, first + 1)
    engine.save_checkpoint(save_dir)
    result["after"] = snapshot(engine)
    engine.destroy()
    torch.save(result, out)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

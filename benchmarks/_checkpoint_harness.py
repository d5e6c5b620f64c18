"""The systems ``checkpoint.py`` compares, each around one model: a training step, a save
(synchronous or asynchronous), a load."""
from __future__ import annotations

import os
from typing import Optional

ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


class Harness:
    """One system around one model: ``step``, ``save`` (returns a handle to ``wait`` on when
    asynchronous), ``load``. ``no_async`` says why a system has no asynchronous save."""

    no_async: Optional[str] = None

    def step(self, x, y) -> float:
        raise NotImplementedError

    def save(self, folder: str, tag: str, asynchronous: bool = False):
        raise NotImplementedError

    def wait(self, handle) -> None:
        pass

    def load(self, folder: str, tag: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class EngineHarness(Harness):
    """A DeepSpeed-style engine (``self.engine``, named ``system`` in errors): forward, backward and
    step, and ``load_checkpoint``."""

    system = "the engine"

    def step(self, x, y) -> float:
        _, loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def load(self, folder, tag) -> None:
        path, _ = self.engine.load_checkpoint(folder, tag=tag)
        if path is None:
            raise RuntimeError(f"{self.system} found no checkpoint {tag} in {folder}")


class ZerodpHarness(EngineHarness):
    system = "zerodp"

    def __init__(self, model, gpt, args) -> None:
        import zerodp
        config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
                  "steps_per_print": 10**9, "zero_optimization": {"stage": args.stage}}
        self.engine, _, _, _ = zerodp.initialize(model=model, config=config, unit_classes=(gpt.Block,))

    def save(self, folder, tag, asynchronous=False):
        self.engine.save_checkpoint(folder, tag=tag, async_save=asynchronous)

    def wait(self, handle) -> None:
        self.engine.wait_for_checkpoint()

    def close(self) -> None:
        self.engine.wait_for_checkpoint()


class DeepSpeedHarness(EngineHarness):
    system = "DeepSpeed"
    no_async = ("DeepSpeed's asynchronous writers (decoupled / fast checkpoint engines) build on its "
                "async_io op, which needs CUDA")

    def __init__(self, model, gpt, args) -> None:
        import deepspeed
        config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]),
                                                            "torch_adam": True}},
                  "steps_per_print": 10**9, "wall_clock_breakdown": False,
                  "zero_optimization": {"stage": args.stage}}
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=config)

    def save(self, folder, tag, asynchronous=False):
        self.engine.save_checkpoint(folder, tag=tag)


class DcpHarness(Harness):
    def __init__(self, model, gpt, args) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        self._async_group = None

    def step(self, x, y) -> float:
        _, loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def save(self, folder, tag, asynchronous=False):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        path = os.path.join(folder, tag)
        if not asynchronous:
            dcp.save(self._state(), checkpoint_id=path)
            return None
        if self._async_group is None:  # the background thread's collectives on a group of their own
            self._async_group = dist.new_group(backend="gloo")
        return dcp.async_save(self._state(), checkpoint_id=path, process_group=self._async_group)

    def wait(self, handle) -> None:
        if handle is not None:
            handle.result()

    def load(self, folder, tag) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        state = self._state()
        dcp.load(state, checkpoint_id=os.path.join(folder, tag))
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


HARNESSES = {"zerodp": ZerodpHarness, "ds": DeepSpeedHarness, "dcp": DcpHarness}

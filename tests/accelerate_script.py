"""A Trainer script with no DeepSpeed in it, for ``accelerate launch --use_deepspeed
--deepspeed_config_file CFG ... accelerate_script.py OUT.json`` (the DeepSpeed config comes from
the launcher) or plain ``torchrun``: trains the tiny GPT-2 of ``hf_trainer_tasks.py`` (or the model kind
named by ``TEST_MODEL_KIND``, e.g. ``qwen3moe``) three steps; rank 0 writes the logged losses, the
engine's class and the classes of the stage-3 leaf modules to OUT.json."""
from __future__ import annotations

import json
import os
import sys

from hf_trainer_tasks import Tokens, build_model
from transformers import Trainer, TrainingArguments

args = TrainingArguments(output_dir=os.path.join(os.path.dirname(sys.argv[1]), "out"), per_device_train_batch_size=2,
                         max_steps=3, logging_steps=1, learning_rate=1e-3, lr_scheduler_type="constant", use_cpu=True,
                         save_strategy="no", report_to=[], disable_tqdm=True)
trainer = Trainer(model=build_model(kind=os.environ.get("TEST_MODEL_KIND", "gpt2")), args=args,
                  train_dataset=Tokens(48))
trainer.train()
if int(os.environ.get("RANK", "0")) == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                   "engine": type(trainer.model_wrapped).__module__,
                   "distributed": str(trainer.accelerator.distributed_type),
                   "leaves": sorted({type(m).__name__ for m in trainer.model.modules()
                                     if getattr(m, "_z3_leaf", False)})}, f)

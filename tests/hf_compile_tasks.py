"""A transformers Llama trained by the Hugging Face ``Trainer`` with ``torch_compile=True`` on zerodp
(``ZERODP_AS_DEEPSPEED=1``):

    ZERODP_AS_DEEPSPEED=1 torchrun --nproc-per-node 2 hf_compile_tasks.py OUT.json CASE [CASE ...]

CASE is ``plain`` (the Trainer's own DDP loop, uncompiled: the reference) or ``z<stage>`` with
``-c`` (``torch_compile=True``: Accelerate calls ``engine.compile(backend=...)``) and ``-reg``
(Accelerate's regional compilation, ``compile_regions_deepspeed``: each decoder layer compiled in
place after ``initialize``), and ``-aot`` (the ``aot_eager`` backend instead of inductor). Each
trains five optimizer steps on fixed token batches; rank 0 writes per case the logged losses, how
the model ended up compiled, and dynamo's counts of compiled graphs and graph breaks.
"""
from __future__ import annotations

import gc
import os
import sys

import torch
import torchrun_cases
from accelerate.state import AcceleratorState
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

VOCAB, SEQ, STEPS = 96, 16, 5


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def run_case(case: str, out_dir: str) -> dict:
    print(f"case {case}", file=sys.stderr, flush=True)
    flags = case.split("-")
    stage = None if flags[0] == "plain" else int(flags[0][1:])
    compiled = "c" in flags
    os.environ["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] = "1" if "reg" in flags else "0"
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64))
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, f"trainer-{case}"), per_device_train_batch_size=2, max_steps=STEPS,
        logging_steps=1, learning_rate=1e-3, lr_scheduler_type="constant", use_cpu=True, save_strategy="no",
        report_to=[], disable_tqdm=True, deepspeed=None if stage is None else ds_config(stage), torch_compile=compiled,
        torch_compile_backend=("aot_eager" if "aot" in flags else "inductor") if compiled else None)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    engine = getattr(trainer, "model_wrapped", None)
    layers = trainer.model.model.layers
    result = {
        "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "engine_compiled": bool(getattr(engine, "is_compiled", False)),
        "layers_compiled": all(getattr(m, "_compiled_call_impl", None) is not None for m in layers),
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": {},
    }
    for reason, n in counters["graph_break"].items():
        key = reason.strip().split("\n")[0][:100]
        result["breaks"][key] = result["breaks"].get(key, 0) + n
    AcceleratorState._reset_state()
    unset_hf_deepspeed_config()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    for key in ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"):
        os.environ.pop(key, None)
    gc.collect()
    return result


if __name__ == "__main__":
    torchrun_cases.serve(run_case)

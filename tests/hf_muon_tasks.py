"""A transformers Llama trained by the Hugging Face ``Trainer`` with a DeepSpeed Muon config on zerodp
(``ZERODP_AS_DEEPSPEED=1``):

    ZERODP_AS_DEEPSPEED=1 torchrun --nproc-per-node 2 hf_muon_tasks.py OUT.json CASE [CASE ...]

CASE is ``plain`` (the Trainer's own DDP loop with :class:`ReferenceMuon`, the same math on whole
parameters on every rank: the reference) or ``z<stage>`` (``"optimizer": {"type": "Muon"}`` in the
DeepSpeed config). Both take the Trainer's parameters in one group (its weight decay on all of
them, as it gives them to ``deepspeed.initialize``), DeepSpeed's tagging rule (matrices whose names
have neither ``embed`` nor ``lm_head`` to Muon), the Trainer's clipping at 1.0 and its learning
rate for the AdamW half. Rank 0 writes each case's logged
losses, and its parameters after five steps to ``params-CASE.pt`` beside OUT.
"""
from __future__ import annotations

import gc
import os
import sys

import torch
import torchrun_cases
from accelerate.state import AcceleratorState
from hf_compile_tasks import VOCAB, Tokens  # the same fixed token batches
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from zerodp.optim.muon_math import orthogonalize

STEPS, LR, MUON_LR, WD = 5, 3e-3, 0.02, 0.1


class ReferenceMuon(torch.optim.Optimizer):
    """DeepSpeed's MuonWithAuxAdam on whole parameters: groups whose ``use_muon`` is set take
    momentum 0.95, the Nesterov blend, the orthogonalized matrix and decoupled weight decay; the
    others Adam with betas (0.9, 0.999), eps 1e-8 (the Trainer's) and decoupled weight decay."""

    def __init__(self, groups: list[dict]) -> None:
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                state = self.state[p]
                if g["use_muon"]:
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(p.grad, 0.05)
                    update = orthogonalize(p.grad.lerp(buf, 0.95).reshape(-1), p.shape).view(p.shape)
                else:
                    state["step"] = state.get("step", 0) + 1
                    m = state.setdefault("exp_avg", torch.zeros_like(p)).lerp_(p.grad, 0.1)
                    v = state.setdefault("exp_avg_sq", torch.zeros_like(p)).lerp_(p.grad.square(), 0.001)
                    update = (m / (1 - 0.9 ** state["step"])) / ((v / (1 - 0.999 ** state["step"])).sqrt() + 1e-8)
                p.mul_(1 - g["lr"] * g["weight_decay"]).add_(update, alpha=-g["lr"])


def reference_optimizer(model: torch.nn.Module) -> ReferenceMuon:
    """With a DeepSpeed config's optimizer the Trainer hands ``initialize`` its trainable parameters
    in one group: the config's weight decay reaches every parameter, norms included."""
    muon = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n and "lm_head" not in n]
    adam = [p for p in model.parameters() if all(p is not q for q in muon)]
    return ReferenceMuon([{"params": muon, "use_muon": True, "lr": MUON_LR, "weight_decay": WD},
                          {"params": adam, "use_muon": False, "lr": LR, "weight_decay": WD}])


def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "optimizer": {"type": "Muon", "params": {"lr": "auto", "muon_lr": MUON_LR, "momentum": 0.95,
                                                     "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def run_case(case: str, out_dir: str) -> dict:
    print(f"case {case}", file=sys.stderr, flush=True)
    stage = None if case == "plain" else int(case[1:])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, tie_word_embeddings=False))
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, f"trainer-{case}"), per_device_train_batch_size=2, max_steps=STEPS,
        logging_steps=1, learning_rate=LR, weight_decay=WD, lr_scheduler_type="constant", use_cpu=True,
        save_strategy="no", report_to=[], disable_tqdm=True, deepspeed=None if stage is None else ds_config(stage))
    optimizers = (reference_optimizer(model), None) if stage is None else (None, None)
    if stage is None:
        optimizers = (optimizers[0], torch.optim.lr_scheduler.LambdaLR(optimizers[0], lambda _: 1.0))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=optimizers)
    trainer.train()
    engine = trainer.model_wrapped
    if stage is None:
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    else:
        import deepspeed  # zerodp, under ZERODP_AS_DEEPSPEED=1
        with deepspeed.zero.GatheredParameters(list(trainer.model.parameters())):
            params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = {
        "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "params": os.path.join(out_dir, f"params-{case}.pt"),
        "optimizer": type(getattr(engine, "optimizer", None)).__name__,
        "groups": [(g.get("name"), g["use_muon"], g["lr"], g["weight_decay"], len(g["params"]))
                   for g in getattr(engine, "optimizer", trainer.optimizer).param_groups],
    }
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(params, result["params"])
    AcceleratorState._reset_state()
    unset_hf_deepspeed_config()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    gc.collect()
    return result


if __name__ == "__main__":
    torchrun_cases.serve(run_case)

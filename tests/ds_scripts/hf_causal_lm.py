"""A Hugging Face causal-LM fine-tune in DeepSpeed's style: the pretrained model is loaded inside
``deepspeed.zero.Init`` when the config asks for ZeRO-3, a weight is read with
``deepspeed.zero.GatheredParameters``, and the result is written with ``save_16bit_model``
beside its config, so ``from_pretrained`` opens it. The data are synthetic token sequences
(each sequence counts up from a random start), so it needs no download.
"""
import argparse
import json
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM


def parse_args():
    parser = argparse.ArgumentParser(description="fine-tune a causal LM")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--model_name_or_path", type=str, required=True)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq_len", type=int, default=16)
    parser.add_argument("--out", type=str, default=None, help="results (JSON, rank 0)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_batch(step, rank, micro_batch, seq_len, vocab):
    g = torch.Generator().manual_seed(7919 * step + rank)
    start = torch.randint(0, vocab, (micro_batch, 1), generator=g)
    return (start + torch.arange(seq_len)) % vocab


def main():
    args = parse_args()
    deepspeed.init_distributed()
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    zero_stage = ds_config.get("zero_optimization", {}).get("stage", 0)

    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=zero_stage == 3):
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)

    model_engine, optimizer, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=[p for p in model.parameters() if p.requires_grad])
    vocab = model.config.vocab_size

    losses = []
    model_engine.train()
    for step in range(args.steps):
        input_ids = get_batch(step, model_engine.global_rank, model_engine.train_micro_batch_size_per_gpu(),
                              args.seq_len, vocab).to(model_engine.device)
        outputs = model_engine(input_ids=input_ids, labels=input_ids)
        model_engine.backward(outputs.loss)
        model_engine.step()
        losses.append(outputs.loss.item())
        if model_engine.global_rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}")

    embedding = model_engine.module.get_input_embeddings().weight
    with deepspeed.zero.GatheredParameters(embedding, modifier_rank=None):
        embedding_norm = embedding.float().norm().item()
        embedding_shape = list(embedding.shape)

    model_engine.save_16bit_model(args.output_dir)
    if model_engine.global_rank == 0:
        model.config.save_pretrained(args.output_dir)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"losses": losses, "embedding_norm": embedding_norm,
                           "embedding_shape": embedding_shape,
                           "files": sorted(os.listdir(args.output_dir))}, f)


if __name__ == "__main__":
    main()

"""Pretrain a small LLaMA with the HuggingFace Trainer and effpretrain: python examples/hf_trainer.py [STEPS]"""

import argparse
import collections
import logging
import sys
import textwrap
import typing
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from effpretrain.hf import EffPretrainCallback, apply_factorization, create_optimizer

max_steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
seq_len = 64

# Data: byte-level tokens of some standard-library sources (no download). Use your own tokenized
# dataset here: rows of input_ids with labels = input_ids, as for any causal LM.
text = "".join(
    Path(m.__file__).read_text(encoding="utf-8") for m in (argparse, collections, logging, textwrap, typing)
)
ids = torch.tensor(list(text.encode("utf-8")))
rows = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
data = [{"input_ids": r, "labels": r} for r in rows]
train_data, eval_data = data[:-64], data[-64:]

# The model: a LLaMA with the shapes of effpretrain's "tiny" preset, then Low-Rank surgery:
# every attention/MLP Linear becomes W = (alpha / r) B A with rank r = 32.
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=352,
    num_attention_heads=4,
    num_hidden_layers=4,
    max_position_embeddings=seq_len,
    tie_word_embeddings=False,
)
model = LlamaForCausalLM(config)
apply_factorization(model, "lowrank", rank=32, alpha=32)

# Optimizer and schedule with the benchmark's restarts: every 50 updates the factor pairs are
# rebalanced and Adam's state is reset, then the LR ramps back over 10 updates.
# For GaLore instead: drop apply_factorization and use create_optimizer(model, "galore", ..., rank=32).
optimizer, scheduler = create_optimizer(
    model, "adamw", num_training_steps=max_steps, lr=3e-3, restarts_every=50
)

args = TrainingArguments(
    output_dir="runs/hf-lowrank",
    max_steps=max_steps,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=2,
    logging_steps=10,
    eval_strategy="steps",
    eval_steps=100,
    save_steps=100,
    report_to=[],
)
trainer = Trainer(
    model=model,
    args=args,
    train_dataset=train_data,
    eval_dataset=eval_data,
    optimizers=(optimizer, scheduler),
    callbacks=[EffPretrainCallback()],  # perplexity, memory (estimated and measured), resumable counters
)
trainer.train()  # after an interruption: trainer.train(resume_from_checkpoint=True)
metrics = trainer.evaluate()
print(f"eval_loss {metrics['eval_loss']:.3f}  eval_ppl {metrics['eval_ppl']:.1f}")

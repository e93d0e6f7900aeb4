"""LLaMA presets as transformers `LlamaConfig` / `LlamaForCausalLM` (docs/benchmark.md)."""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class Preset:
    hidden: int
    intermediate: int
    heads: int
    layers: int
    vocab: int = 32000  # the paper's T5 tokenizer; the trainer uses the real tokenizer's size


PRESETS: dict[str, Preset] = {
    # Trains in seconds on a laptop CPU; for tests and the quickstart.
    "tiny": Preset(hidden=128, intermediate=352, heads=4, layers=4, vocab=8192),
    "llama_20m": Preset(hidden=256, intermediate=688, heads=4, layers=4),
    "llama_60m": Preset(hidden=512, intermediate=1376, heads=8, layers=8),
    "llama_130m": Preset(hidden=768, intermediate=2048, heads=12, layers=12),
    "llama_350m": Preset(hidden=1024, intermediate=2736, heads=16, layers=24),
    "llama_1b": Preset(hidden=2048, intermediate=5461, heads=32, layers=24),
}


def build_llama_config(preset: str, vocab_size: int | None = None, max_positions: int = 1024, **kw):
    """The transformers LlamaConfig of a preset: RMSNorm eps 1e-6, SiLU MLP, RoPE, untied head."""
    from transformers import LlamaConfig

    p = PRESETS[preset]
    return LlamaConfig(
        vocab_size=vocab_size or p.vocab,
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_attention_heads=p.heads,
        num_key_value_heads=p.heads,
        num_hidden_layers=p.layers,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        use_cache=False,
        attn_implementation="sdpa",
        **kw,
    )


def build_model(preset: str, vocab_size: int | None = None, max_positions: int = 1024, seed: int = 0):
    """Builds a freshly initialised LlamaForCausalLM (fp32) deterministically from `seed`."""
    from transformers import LlamaForCausalLM

    cfg = build_llama_config(preset, vocab_size, max_positions)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model


def set_activation_checkpointing(model: torch.nn.Module, every: int | Collection[int]) -> int:
    """Checkpoints every `every`-th decoder layer (0 disables), or the layers whose indices
    `every` lists; returns how many layers are.

    Works on transformers' GradientCheckpointingLayer blocks directly, so "every k layers"
    does not depend on the transformers version's own enabling API.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    fn = functools.partial(checkpoint, use_reentrant=False)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    chosen = set(range(0, len(layers), every) if every > 0 else ()) if isinstance(every, int) else set(every)
    count = 0
    for i, layer in enumerate(layers):
        on = i in chosen
        layer.gradient_checkpointing = on
        layer._gradient_checkpointing_func = fn
        count += on
    return count

"""The model a run trains, from its config: the LLaMA preset, seeded, plus factorization surgery;
its placement (checkpointing, dtype, device, compilation); and one training step on a given batch,
for the measurements and checks that run a step without the trainer's data pipeline."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

import optimizers
from effpretrain import grad_norm
from effpretrain.compile import compile_blocks
from effpretrain.config import RunConfig
from effpretrain.errors import ConfigError
from effpretrain.loss import token_loss_sum
from effpretrain.models import FACTOR_KINDS, apply_factorization, build_model, set_activation_checkpointing
from effpretrain.models.factorized import begin_warm_start_
from effpretrain.models.llama import (
    build_llama_config,
    config_location,
    config_source,
    load_hf_config,
    model_shape,
)
from effpretrain.models.pretrained import PretrainedWeights, load_pretrained
from effpretrain.models.quantize import quantize_linear_, quantize_weights_


def build_run_model(
    cfg: RunConfig, vocab_size: int, weights: PretrainedWeights | None = None
) -> tuple[torch.nn.Module, dict[str, Any] | None]:
    """The model a run trains: the preset, or ``model.config``'s (or ``model.init``'s) model as it
    is, seeded, plus factorization surgery if configured; built layer by layer
    (`effpretrain.models.materialize`). With `weights` (``model.init``'s, `open_pretrained`) the
    model is those weights instead, read unit by unit (`load_pretrained`; its report is
    ``weights.report``), and the surgery starts from them (`FactorSpec.pretrained_start`); without
    them a ``model.init`` run's architecture is built fresh (evaluation and export then load a
    checkpoint's weights into it).
    Its weights are fp32, or, for a ``bf16-pure`` run without factorization, bf16: each layer is
    cast as soon as it is initialised (the values `place_model`'s cast of the fp32 model gives), so
    the fp32 model is never held whole. A factorized model stays fp32 here: the surgery creates
    its factors from fp32 weights, and `place_model` casts after it.

    Returns:
        The model and the surgery's report (None without a factorization).

    Raises:
        ConfigError: `data.seq_len` exceeds the positions, ``model.config`` cannot be read, is not
            a supported architecture or its vocabulary is not the tokenizer's, or the factorization
            rejects its options.
    """
    dtype = weights_dtype(cfg)
    cast = None if dtype == torch.float32 or cfg.factor.kind != "none" else (lambda _, layer: layer.to(dtype))
    if cfg.train.weight_quant == "int8" and cfg.factor.kind == "none":
        # INT8 weights from the layer's own build on: a 13B model never exists in fp32 whole.
        cast = functools.partial(_quantize_unit, cfg, cast)
    if weights is not None:
        model, weights.report = load_pretrained(run_hf_config(cfg, vocab_size), weights, after_layer=cast)
    elif cfg.model.config or cfg.model.init:
        hf_config = run_hf_config(cfg, vocab_size)
        model = build_model(hf_config, seed=cfg.train.seed, after_layer=cast)
    else:
        max_pos = cfg.model.max_position_embeddings or cfg.data.seq_len
        if cfg.data.seq_len > max_pos:
            raise ConfigError(
                f"data.seq_len={cfg.data.seq_len} exceeds model.max_position_embeddings={max_pos}"
            )
        model = build_model(cfg.model.preset, vocab_size, max_pos, seed=cfg.train.seed, after_layer=cast)
    report = None
    if cfg.factor.kind != "none":
        try:
            report = apply_factorization(
                model,
                cfg.factor.kind,
                cfg.factor.rank,
                cfg.factor.alpha,
                targets=tuple(cfg.factor.targets),
                density=cfg.factor.density,
                seed=cfg.factor.seed,
                pretrained=weights is not None,
            )
        except ValueError as e:
            raise ConfigError(f"factor: {e}") from None
    return model, report


def build_hf_config(cfg: RunConfig, vocab_size: int) -> Any:
    """The transformers config of the run's model (``model.config``'s or ``model.init``'s,
    checked; or the preset's with the run's positions), without building the model."""
    if cfg.model.config or cfg.model.init:
        return run_hf_config(cfg, vocab_size)
    max_pos = cfg.model.max_position_embeddings or cfg.data.seq_len
    return build_llama_config(cfg.model.preset, vocab_size, max_pos)


def _quantize_unit(cfg: RunConfig, cast: Any, name: str, unit: torch.nn.Module) -> None:
    """A unit of the layer-by-layer build, final: cast to the run's dtype (`cast`), then its INT8
    target weights quantized (`train.weight_quant: int8`); the embedding and an untied head too
    with `train.weight_quant_embeddings` (a tied one waits for `place_model`, which keeps the tie)."""
    if cast is not None:
        cast(name, unit)
    edge = name in ("model.embed_tokens", "lm_head")
    if not edge:
        quantize_weights_(unit, cfg.optim.targets, cfg.train.weight_quant_group)
    elif cfg.train.weight_quant_embeddings and not model_shape(cfg.model).tied:
        quantize_linear_(unit, cfg.train.weight_quant_group)


def weights_dtype(cfg: RunConfig) -> torch.dtype:
    """The dtype a run's weights train in: bf16 for ``bf16-pure``, else fp32."""
    return torch.bfloat16 if cfg.train.precision == "bf16-pure" else torch.float32


def run_vocabulary(cfg: RunConfig, tokens: int, tokenizer: str) -> int:
    """The vocabulary of the run's model for a tokenizer of `tokens` tokens: the tokenizer's, or,
    for ``model.init``, its embedding's rows, which may exceed the tokenizer's count (padded, as
    Qwen's are) but never fall short of it.

    Raises:
        ConfigError: ``model.init``'s tokenizer has more tokens than its embedding has rows.
    """
    if not cfg.model.init:
        return tokens
    rows = model_shape(cfg.model).vocab
    if tokens > rows:
        raise ConfigError(
            f"model.init: the tokenizer {tokenizer} has {tokens} tokens but the model's embedding "
            f"has {rows} rows; use the model's own tokenizer (data.tokenizer)"
        )
    return rows


def run_hf_config(cfg: RunConfig, vocab_size: int) -> Any:
    """``model.config``'s (or ``model.init``'s) transformers config, checked against the run: a
    supported architecture, the tokenizer's vocabulary, enough positions for ``data.seq_len``
    (``model.max_position_embeddings``, when set, replaces the config's); `vocab_size` is
    `run_vocabulary`'s."""
    model_shape(cfg.model)  # readable and supported, else the one-line ConfigError
    key = config_source(cfg.model)[0]
    hf_config = load_hf_config(config_location(cfg.model))
    if hf_config.vocab_size != vocab_size:
        raise ConfigError(
            f"{key}: vocab_size={hf_config.vocab_size} but the tokenizer has {vocab_size} tokens; "
            "use a model and a tokenizer (data.tokenizer) of the same vocabulary"
        )
    if cfg.model.max_position_embeddings:
        hf_config.max_position_embeddings = cfg.model.max_position_embeddings
    if cfg.data.seq_len > hf_config.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds {key}'s max_position_embeddings="
            f"{hf_config.max_position_embeddings}"
        )
    hf_config.use_cache = False
    hf_config._attn_implementation = "sdpa"
    return hf_config


def place_model(
    model: torch.nn.Module, cfg: RunConfig, device: torch.device | str, checkpointed: int | Collection[int]
) -> torch.nn.Module:
    """Places a built model as the trainer does, before any DDP or FSDP2 wrapping: a warm start's
    frozen start (`factor.warm_start_steps`), activation checkpointing of the `checkpointed`
    layers, bf16 weights for ``bf16-pure``, the device, INT8 target weights for
    ``train.weight_quant: int8``, and `train.compile`'s compiled blocks."""

    if cfg.factor.warm_start_steps:
        begin_warm_start_(model)  # before DDP wraps it: DDP reduces what requires grad now
    set_activation_checkpointing(model, checkpointed)
    if weights_dtype(cfg) != torch.float32:
        model = model.to(weights_dtype(cfg))  # a factorized model's (a dense one is built so)
    if not any(p.is_meta for p in model.parameters()):  # a meta model is filled after FSDP2 shards it
        model = model.to(device)
    if cfg.train.weight_quant == "int8":  # after the dtype and the device: INT8 from here on
        quantize_weights_(
            model,
            cfg.optim.targets,
            cfg.train.weight_quant_group,
            embeddings=cfg.train.weight_quant_embeddings,
        )
    if cfg.train.compile:
        compile_blocks(model)  # before sharding: FSDP2 then wraps the compiled blocks
    return model


def synthetic_batch(
    cfg: RunConfig, vocab_size: int, seed: int = 0, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """One micro-batch of uniform random token ids (`train.batch_size` x `data.seq_len`, every
    position real), drawn on the CPU from `seed` so that any device gets the same ids."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (cfg.train.batch_size, cfg.data.seq_len), generator=gen)
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),
        "labels": ids.to(device),
    }


def make_train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    cfg: RunConfig,
    batches: Callable[[int], dict[str, torch.Tensor]],
    *,
    sched: Any = None,
    in_backward: Any = None,
    rounding: Any = None,
) -> Callable[[], float]:
    """One optimizer step as a callable: `train.grad_accum` micro-steps on ``batches(k)`` (forward
    with the run's loss, backward of the token-mean loss), the global gradient norm clipped at
    `train.grad_clip` (0: the norm only, as the trainer computes it for its log) by the trainer's
    own `effpretrain.grad_norm.clip_grad_norm_`, the optimizer and schedule steps, ``zero_grad``.
    With `in_backward` (an `effpretrain.in_backward.InBackward`) the parameters step inside
    backward and the step finishes the engine's update instead of clipping. With `rounding` (the
    run's `optimizers.writer.Rounding`) each call is the next step of its noise. Returns the step's
    loss."""

    K = cfg.train.grad_accum
    clip = cfg.train.grad_clip

    def step() -> float:
        total = 0.0
        if rounding is not None:
            rounding.step += 1
        for k in range(K):
            if in_backward is not None:
                in_backward.begin_micro(k, K)
            s, n = token_loss_sum(
                model, batches(k), packed=True, loss=cfg.train.loss, chunk_tokens=cfg.train.loss_chunk_tokens
            )
            loss = s / (n * K)
            loss.backward()
            total += float(loss.detach())
        if in_backward is not None:
            in_backward.finish()
        else:
            grad_norm.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def registry_recipes(tiny: Path) -> list[str]:
    """The tiny recipes (stems under `tiny`) that cover every registry row: one per registered
    optimizer (trained on the dense model) and one per factor kind (its restarts recipe where it
    has one), so checks that sweep the methods follow the registries instead of a hand-kept list."""

    kinds = [f"{k}_restarts" if (tiny / f"{k}_restarts.yaml").is_file() else k for k in FACTOR_KINDS]
    return [*optimizers.METHODS, *kinds]

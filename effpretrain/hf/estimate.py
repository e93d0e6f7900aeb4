"""`estimate_memory`: the estimator for a model handed to the Trainer."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

import optimizers
from effpretrain import memory
from effpretrain.config import (
    OptimConfig,
)
from effpretrain.hf.factory import factor_config
from effpretrain.hf.registry import _config_of, _engine_of, _method_of
from effpretrain.models.llama import PRESETS, ModelShape, shape_of
from optimizers.momentum_reset import unwrap_optimizer

log = logging.getLogger(__name__)


# Memory


def _shape_of(model: torch.nn.Module) -> ModelShape | None:
    """The `ModelShape` of a model of a supported architecture (any size and vocabulary: Llama,
    Mistral, Qwen2, Qwen3), None for any other model."""
    c = getattr(model, "config", None)
    try:
        return shape_of(c) if c is not None else None
    except ValueError:
        return None


def _dtype_name(model: torch.nn.Module, bf16_autocast: bool) -> str | None:
    dtype = next(model.parameters()).dtype
    if dtype == torch.bfloat16:
        return "bf16-pure"
    if dtype == torch.float32:
        return "bf16-mixed" if bf16_autocast else "fp32"
    return None


def _optim_config_from_groups(method: str, optimizer: torch.optim.Optimizer | None) -> OptimConfig:
    # Without a RunConfig, the projection settings are read back from a projected group.
    o = OptimConfig(name=method)
    groups = unwrap_optimizer(optimizer).param_groups if optimizer is not None else []
    g = next((g for g in groups if g.get("project") or g.get("rank") is not None), None)
    if g is not None:
        o.rank, o.update_proj_gap = int(g["rank"]), int(g.get("update_proj_gap", o.update_proj_gap))
        o.scale, o.proj_type = float(g.get("scale", o.scale)), g.get("proj_type", o.proj_type)
    return o


def estimate_memory(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    bf16_autocast: bool = False,
    batch_size: int = 1,
    seq_len: int | None = None,
    activation_checkpointing: int = 0,
    grad_accum: int = 1,
    grad_clip: float = 0.0,
    world_size: int = 1,
) -> memory.Estimate:
    """The analytic memory estimate for training `model` with `optimizer`, in bytes per process.

    When the model is of a supported architecture (Llama, Mistral, Qwen2, Qwen3; any shape and
    vocabulary, fp32 or bf16) this is `effpretrain.memory.estimate`, the same numbers as
    ``effpretrain estimate`` and a run's summary.json, activations included (when `seq_len` is
    known). Otherwise weights, gradients and optimizer state are derived from the model's actual
    parameters and the optimizer's actual param groups with the same per-method formulas
    (`optimizers.state_bytes`); activations are not estimated (0, ``detail["activations"] ==
    "unknown"``). ``detail["source"]`` says which.

    Args:
        model: the model (after any factorization).
        optimizer: its optimizer (possibly wrapped); None or an unregistered class leaves the
            optimizer state out (0, ``detail["optimizer_state"] == "unknown"``).
        bf16_autocast: fp32 weights trained under bf16 autocast (TrainingArguments(bf16=True)).
        batch_size: sequences per process per micro-step.
        seq_len: tokens per sequence; None leaves activations out.
        activation_checkpointing: checkpoint every k-th decoder layer (0: off).
        grad_accum: micro-batches per update (held gradients; with an optimizer from
            ``create_optimizer(..., update_in_backward=True)`` the in-backward terms: accumulators).
        grad_clip: the clipping threshold (in backward, 0 allows GaLore's low-rank accumulators).
        world_size: the Trainer's processes: its DDP's buckets (a second copy of the gradients)
            count in the ``peak`` (supported architectures), except with updates in backward,
            where the model has no DDP wrapper (`prepare_trainer`): one process's figures.
    """
    method = _method_of(optimizer)
    shape, dtype = _shape_of(model), _dtype_name(model, bf16_autocast)
    if shape is None or dtype is None or method is None:
        return _from_parameters(model, optimizer, method)
    est = memory.estimate(
        shape,
        method,
        dtype=dtype,
        **_model_options(model, optimizer, method),
        batch_size=batch_size,
        seq_len=seq_len or 1,
        activation_checkpointing=activation_checkpointing,
        grad_accum=grad_accum,
        grad_clip=grad_clip,
        world_size=world_size,
        sharding="ddp" if world_size > 1 else "none",
        ddp_bucket_view=False,
    )
    est.detail["source"] = f"{'preset' if shape.label in PRESETS else 'model'}:{shape.label}"
    if seq_len is None:
        est = dataclasses.replace(est, activations=0, detail={**est.detail, "activations": "unknown"})
    return est


def _model_options(model: torch.nn.Module, optimizer: Any, method: str) -> dict[str, Any]:
    """`memory.estimate`'s options read from the model and its optimizer."""
    f, cfg = factor_config(model), _config_of(optimizer)
    return {
        "vocab_size": model.config.vocab_size,
        "optim_cfg": cfg.optim if cfg is not None else _optim_config_from_groups(method, optimizer),
        "factor_kind": f.kind,
        "factor_rank": f.rank,
        "density": f.density,
        "factor_targets": f.targets,
        "update_in_backward": _engine_of(optimizer) is not None,
    }


def _from_parameters(model: torch.nn.Module, optimizer: Any, method: str | None) -> memory.Estimate:
    """Weights, gradients and optimizer state of a model of another architecture, from its actual
    parameters and the optimizer's actual param groups (`optimizers.state_bytes`)."""
    params = list(model.parameters())
    weights = memory.tensor_bytes(params)
    for module in model.modules():  # persistent buffers such as SLTrain's sparse index are weights too
        weights += memory.tensor_bytes(
            b
            for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set
        )
    trainable = [p for p in params if p.requires_grad]
    state, detail = 0, {"source": "parameters", "method": method, "activations": "unknown"}
    if method is not None and optimizer is not None:
        for group in unwrap_optimizer(optimizer).param_groups:
            for p in group["params"]:
                state += optimizers.state_bytes(method, tuple(p.shape), group, p.dtype)
    else:
        detail["optimizer_state"] = "unknown"
    return memory.Estimate(
        weights=weights,
        grads=memory.tensor_bytes(trainable),
        optimizer_state=state,
        activations=0,
        params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in trainable),
        detail=detail,
    )


def _estimate_fields(est: memory.Estimate) -> dict[str, int]:
    fields = {"est_weights_bytes": est.weights, "est_grads_bytes": est.grads}
    if est.detail.get("optimizer_state") != "unknown":
        fields["est_optimizer_state_bytes"] = est.optimizer_state
    if est.detail.get("activations") != "unknown":
        fields["est_activations_bytes"] = est.activations
    fields["est_total_bytes"] = est.total
    return fields

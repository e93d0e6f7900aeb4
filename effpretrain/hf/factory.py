"""`create_optimizer`: an effpretrain optimizer and schedule for any model, built as `effpretrain train` builds them; the config read from a model."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from effpretrain.config import (
    ATTN_MLP_TARGETS,
    FactorConfig,
    OptimConfig,
    RestartsConfig,
    RunConfig,
    TrainConfig,
    validate,
)
from effpretrain.hf.registry import _CONFIGS, _DRIVEN, _ENGINES
from effpretrain.in_backward import InBackward
from effpretrain.models.factorized import FACTOR_KINDS, factorized_layers
from effpretrain.optim_setup import build_optimizer_and_schedule
from optimizers.momentum_reset import unwrap_optimizer

log = logging.getLogger(__name__)


# Config from a model


def _factor_kind(layer: torch.nn.Module) -> str:
    names = {spec.layer: name for name, spec in FACTOR_KINDS.items()}
    # The most derived registered class wins: a ReLoRALinear is also a LoRALinear.
    for cls in type(layer).__mro__:
        if cls in names:
            return names[cls]
    raise ValueError(f"{type(layer).__name__} is not a registered factorized layer")


def factor_config(model: torch.nn.Module) -> FactorConfig:
    """The `FactorConfig` describing the factorized layers `model` already holds (kind "none" if it has none).

    Raises:
        ValueError: the model mixes factorization kinds (one run uses one kind).
    """
    layers = factorized_layers(model)
    if not layers:
        return FactorConfig(kind="none")
    kinds = sorted({_factor_kind(layer) for _, layer in layers})
    if len(kinds) > 1:
        raise ValueError(f"model mixes factorization kinds {kinds}; effpretrain runs one kind per model")
    first = layers[0][1]
    return FactorConfig(
        kind=kinds[0],
        rank=first.rank,
        alpha=first.alpha,
        targets=sorted({name.rpartition(".")[2] for name, _ in layers}),
        density=float(getattr(first, "density", FactorConfig.density)),
    )


def build_run_config(
    model: torch.nn.Module,
    method: str,
    *,
    num_training_steps: int,
    lr: float,
    weight_decay: float = 0.0,
    warmup_ratio: float = 0.1,
    min_lr_ratio: float = 0.1,
    schedule: str = "cosine",
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float | None = None,
    rank: int = 128,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    proj_type: str = "std",
    basis: str = "default",
    targets: Sequence[str] | None = None,
    restarts_every: int = 0,
    refactorize: bool = True,
    reset_momentum: bool = True,
    recovery_steps: int = 10,
    update_in_backward: bool = False,
    **method_kwargs: Any,
) -> RunConfig:
    """The validated `RunConfig` that `create_optimizer` builds from (arguments as there).

    The factorization section is read from the model (`factor_config`), so the trainer's rules
    that depend on it (ReLoRA merges, which pairs are refactorized) apply unchanged.

    Raises:
        effpretrain.errors.ConfigError (a ValueError): a value out of range or an unknown method,
            naming the config key and the choices.
    """
    cfg = RunConfig(
        method=method,
        factor=factor_config(model),
        optim=OptimConfig(
            name=method,
            lr=float(lr),
            weight_decay=float(weight_decay),
            beta1=float(betas[0]),
            beta2=float(betas[1]),
            eps=None if eps is None else float(eps),
            rank=int(rank),
            update_proj_gap=int(update_proj_gap),
            scale=float(scale),
            proj_type=proj_type,
            basis=basis,
            targets=list(ATTN_MLP_TARGETS if targets is None else targets),
            extra=dict(method_kwargs),
        ),
        train=TrainConfig(
            max_steps=int(num_training_steps),
            warmup_ratio=float(warmup_ratio),
            min_lr_ratio=float(min_lr_ratio),
            schedule=schedule,
            update_in_backward=bool(update_in_backward),
        ),
        restarts=RestartsConfig(
            every=int(restarts_every),
            refactorize=refactorize,
            reset_momentum=reset_momentum,
            recovery_steps=int(recovery_steps),
        ),
    )
    return validate(cfg, "create_optimizer")


# Optimizer factory


def create_optimizer(
    model: torch.nn.Module,
    method: str,
    *,
    num_training_steps: int,
    lr: float,
    weight_decay: float = 0.0,
    warmup_ratio: float = 0.1,
    min_lr_ratio: float = 0.1,
    schedule: str = "cosine",
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float | None = None,
    rank: int = 128,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    proj_type: str = "std",
    basis: str = "default",
    targets: Sequence[str] | None = None,
    restarts_every: int = 0,
    refactorize: bool = True,
    reset_momentum: bool = True,
    recovery_steps: int = 10,
    update_in_backward: bool = False,
    **method_kwargs: Any,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """Builds ``(optimizer, lr_scheduler)`` for ``Trainer(optimizers=...)`` the way the trainer does.

    Param groups follow the trainer's rules (attention/MLP linear weights named in `targets` are
    projected by projection methods; other matrices get weight decay; vectors get none; frozen
    parameters are left out). The schedule is the trainer's `lr_factor`: linear warmup over
    ``warmup_ratio * num_training_steps`` updates, then cosine / linear / constant to
    ``min_lr_ratio * lr``, times the restart recovery ramp when restarts reset momentum.

    Call it after model surgery (`apply_factorization`) and pass the Trainer's ``max_steps`` as
    `num_training_steps`.

    Args:
        model: the model to train (its trainable parameters are grouped).
        method: an optimizer name from the registry `optimizers.METHODS`.
        num_training_steps: optimizer updates in the run (the schedule's length).
        lr: peak learning rate (eta).
        weight_decay: decoupled weight decay (lambda) for matrices.
        warmup_ratio: fraction of updates spent in linear warmup.
        min_lr_ratio: final LR as a fraction of `lr`.
        schedule: "cosine", "linear" or "constant" after warmup.
        betas: Adam's (beta1, beta2).
        eps: Adam's epsilon; None: the method's reference value (its class default).
        rank: projection rank r (projection methods).
        update_proj_gap: basis refresh period T (projection methods).
        scale: projected update scale alpha (projection methods).
        proj_type: projection side, as galore-torch (`optimizers.projection.PROJ_TYPES`).
        basis: "default" (the method's own) or a basis of `optimizers.projection.METHODS`.
        targets: attribute names of the Linear layers a projection method projects.
        restarts_every: T of the benchmark's restarts (0: none); the optimizer is then the
            `optimizers.Restarts` wrapper.
        refactorize: re-split factor pairs at restarts (Low-Rank and SLTrain models).
        reset_momentum: zero Adam moments and step counters at restarts.
        recovery_steps: length R of the LR ramp after each restart.
        update_in_backward: update each parameter (LORO: each factor pair) inside backward as
            soon as its gradient is final and free the gradient (`effpretrain.in_backward`, as
            ``train.update_in_backward``). Needs `EffPretrainCallback` in the Trainer's callbacks,
            which marks the micro-batches of the Trainer's gradient accumulation, maps
            ``max_grad_norm`` to the previous-step-norm clipping rule and logs the real
            ``grad_norm``; one process only, no fp16 (GradScaler) and no DeepSpeed.
        **method_kwargs: extra constructor options of the method (``optim.extra`` of a recipe),
            e.g. ``gamma1=0.85`` for stable_spam, ``oversample=8`` for randomized bases.

    Returns:
        The optimizer (a `Restarts` wrapper with ``restarts_every > 0``) and its LambdaLR.

    Raises:
        ValueError: unknown method (naming the choices), values out of range, or a projection
            method whose `targets` match no linear weight.
        RuntimeError: (at the Trainer's first optimizer step) ``update_in_backward`` without
            `EffPretrainCallback` in the Trainer.
    """
    cfg = build_run_config(
        model,
        method,
        num_training_steps=num_training_steps,
        lr=lr,
        weight_decay=weight_decay,
        warmup_ratio=warmup_ratio,
        min_lr_ratio=min_lr_ratio,
        schedule=schedule,
        betas=betas,
        eps=eps,
        rank=rank,
        update_proj_gap=update_proj_gap,
        scale=scale,
        proj_type=proj_type,
        basis=basis,
        targets=targets,
        restarts_every=restarts_every,
        refactorize=refactorize,
        reset_momentum=reset_momentum,
        recovery_steps=recovery_steps,
        update_in_backward=update_in_backward,
        **method_kwargs,
    )
    opt, sched = build_optimizer_and_schedule(model, cfg)
    _CONFIGS[opt] = cfg
    if update_in_backward:
        _attach_in_backward(model, opt)
    return opt, sched


def _attach_in_backward(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    # max_norm comes from TrainingArguments.max_grad_norm when the callback starts driving it.
    engine = InBackward(model.parameters(), opt)
    _ENGINES[opt] = weakref.ref(engine)

    def require_callback(*_: Any) -> None:
        # Without the callback no micro-batch is marked: the hooks stay idle, every gradient is
        # kept and this step would quietly be the normal one.
        if engine not in _DRIVEN:
            raise RuntimeError(
                "create_optimizer(update_in_backward=True) needs EffPretrainCallback() in the Trainer's "
                "callbacks (it marks the micro-batches and logs the real gradient norm)"
            )

    unwrap_optimizer(opt).register_step_pre_hook(require_callback)

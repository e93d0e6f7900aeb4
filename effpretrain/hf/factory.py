"""`create_optimizer`: an effpretrain optimizer and schedule for any model, built as `effpretrain train` builds them; the config read from a model."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
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


@dataclass
class FactorySettings:
    """`create_optimizer`'s keyword settings; each fills the `effpretrain train` config key named."""

    num_training_steps: int
    """Optimizer updates in the run, the schedule's length (``train.max_steps``)."""
    lr: float
    """Peak learning rate eta (``optim.lr``)."""
    weight_decay: float = 0.0
    """Decoupled weight decay lambda for matrices (``optim.weight_decay``)."""
    warmup_ratio: float = 0.1
    """Fraction of the updates in linear warmup (``train.warmup_ratio``)."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of `lr` (``train.min_lr_ratio``)."""
    schedule: str = "cosine"
    """``cosine``, ``linear`` or ``constant`` after the warmup (``train.schedule``)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (beta1, beta2) (``optim.beta1``, ``optim.beta2``)."""
    eps: float | None = None
    """Adam's epsilon; None: the method's reference value (``optim.eps``)."""
    rank: int = 128
    """Projection rank r of the projection methods (``optim.rank``)."""
    update_proj_gap: int = 200
    """Basis refresh period T of the projection methods (``optim.update_proj_gap``)."""
    scale: float = 0.25
    """Projected update scale alpha (``optim.scale``)."""
    proj_type: str = "std"
    """Projection side, as galore-torch (``optim.proj_type``)."""
    basis: str = "default"
    """The method's own basis, or one of `optimizers.projection.METHODS` (``optim.basis``)."""
    targets: Sequence[str] | None = None
    """The Linear attributes a projection method projects; None: attention and MLP."""
    restarts_every: int = 0
    """T of the benchmark's restarts, 0 none (``restarts.every``): the optimizer is then the
    `optimizers.Restarts` wrapper."""
    refactorize: bool = True
    """Re-split factor pairs at restarts (``restarts.refactorize``)."""
    reset_momentum: bool = True
    """Zero Adam's moments and step counters at restarts (``restarts.reset_momentum``)."""
    recovery_steps: int = 10
    """Length R of the LR ramp after a restart (``restarts.recovery_steps``)."""
    update_in_backward: bool = False
    """Update each parameter inside backward and free its gradient (``train.update_in_backward``;
    needs `EffPretrainCallback`, and `prepare_trainer` under several processes; no fp16, DeepSpeed
    or FSDP)."""
    method_kwargs: dict[str, Any] = field(default_factory=dict)
    """The method's own constructor options (``optim.extra``): every other keyword."""


def _settings(kwargs: dict[str, Any]) -> FactorySettings:
    """The keywords as `FactorySettings`; a keyword that is not a setting goes to the method."""
    names = {f.name for f in fields(FactorySettings)} - {"method_kwargs"}
    known = {k: v for k, v in kwargs.items() if k in names}
    return FactorySettings(**known, method_kwargs={k: v for k, v in kwargs.items() if k not in names})


def build_run_config(model: torch.nn.Module, method: str, **settings: Any) -> RunConfig:
    """The validated `RunConfig` that `create_optimizer` builds from (settings as there).

    The factorization section is read from the model (`factor_config`), so the trainer's rules
    that depend on it (ReLoRA merges, which pairs are refactorized) apply unchanged.

    Raises:
        effpretrain.errors.ConfigError (a ValueError): a value out of range or an unknown method,
            naming the config key and the choices.
    """
    s = _settings(settings)
    cfg = RunConfig(
        method=method,
        factor=factor_config(model),
        optim=OptimConfig(
            name=method,
            lr=float(s.lr),
            weight_decay=float(s.weight_decay),
            beta1=float(s.betas[0]),
            beta2=float(s.betas[1]),
            eps=None if s.eps is None else float(s.eps),
            rank=int(s.rank),
            update_proj_gap=int(s.update_proj_gap),
            scale=float(s.scale),
            proj_type=s.proj_type,
            basis=s.basis,
            targets=list(ATTN_MLP_TARGETS if s.targets is None else s.targets),
            extra=dict(s.method_kwargs),
        ),
        train=TrainConfig(
            max_steps=int(s.num_training_steps),
            warmup_ratio=float(s.warmup_ratio),
            min_lr_ratio=float(s.min_lr_ratio),
            schedule=s.schedule,
            update_in_backward=bool(s.update_in_backward),
        ),
        restarts=RestartsConfig(
            int(s.restarts_every), s.refactorize, s.reset_momentum, int(s.recovery_steps)
        ),
    )
    return validate(cfg, "create_optimizer")


def create_optimizer(
    model: torch.nn.Module, method: str, **settings: Any
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """Builds ``(optimizer, lr_scheduler)`` for ``Trainer(optimizers=...)`` the way the trainer does.

    Param groups follow the trainer's rules (attention/MLP linear weights named in ``targets`` are
    projected by projection methods; other matrices get weight decay; vectors get none; frozen
    parameters are left out). The schedule is the trainer's `lr_factor`: linear warmup over
    ``warmup_ratio * num_training_steps`` updates, then cosine / linear / constant to
    ``min_lr_ratio * lr``, times the restart recovery ramp when restarts reset momentum. Call it
    after model surgery (`apply_factorization`) with the Trainer's ``max_steps`` as
    ``num_training_steps``.

    Args:
        model: the model to train (its trainable parameters are grouped).
        method: an optimizer name from the registry `optimizers.METHODS`.
        **settings: `FactorySettings` (``num_training_steps`` and ``lr`` are required); any other
            keyword is the method's own constructor option (``optim.extra`` of a recipe), e.g.
            ``gamma1=0.85`` for stable_spam, ``oversample=8`` for randomized bases.

    Returns:
        The optimizer (a `Restarts` wrapper with ``restarts_every > 0``) and its LambdaLR.

    Raises:
        ValueError: unknown method (naming the choices), values out of range, or a projection
            method whose ``targets`` match no linear weight.
        RuntimeError: (at the Trainer's first optimizer step) ``update_in_backward`` without
            `EffPretrainCallback` in the Trainer.
    """
    cfg = build_run_config(model, method, **settings)
    opt, sched = build_optimizer_and_schedule(model, cfg)
    _CONFIGS[opt] = cfg
    if cfg.train.update_in_backward:
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

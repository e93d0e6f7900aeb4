"""From a RunConfig to the optimizer a run steps: param groups, optimizer, restarts, LR schedule.

Shared by both entry points: the Accelerate loop (`effpretrain.trainer`) and the HuggingFace
factory (`effpretrain.hf.create_optimizer`) call `build_optimizer_and_schedule`, so a recipe and
a `create_optimizer(...)` call with the same values train with the same groups and schedule.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import optimizers
from effpretrain import memory
from effpretrain.config import RunConfig
from effpretrain.errors import ConfigError

# ----------------------------------------------------------------------------------------------
# Schedule


def restart_ramps(cfg: RunConfig) -> bool:
    """Whether restarts re-warm the LR: after a momentum reset, or after ReLoRA's merge (whose
    factors' state is reset) - the jagged schedule."""
    from effpretrain.models import factor_spec

    r = cfg.restarts
    merges = cfg.factor.kind != "none" and factor_spec(cfg.factor.kind).merges_at_restart
    return r.every > 0 and r.recovery_steps > 0 and (r.reset_momentum or merges)


def lr_factor(step: int, cfg: RunConfig) -> float:
    """LR multiplier for optimizer step `step` (0-based).

    With W = floor(warmup_ratio * max_steps) warmup steps and progress
    p = min(1, (step - W) / max(1, max_steps - W)) after them, the factor is (step + 1) / W
    during warmup, then m + (1 - m) (1 + cos(pi p)) / 2 (cosine), 1 - (1 - m) p (linear) or 1
    (constant), with m = `min_lr_ratio`; times the restart recovery ramp when restarts re-warm
    (`restart_ramps`).
    """
    t = cfg.train
    warm = int(t.warmup_ratio * t.max_steps)
    if step < warm:
        f = (step + 1) / warm
    else:
        progress = min(1.0, (step - warm) / max(1, t.max_steps - warm))
        if t.schedule == "cosine":
            f = t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        elif t.schedule == "linear":
            f = 1 - (1 - t.min_lr_ratio) * progress
        else:
            f = 1.0
    if restart_ramps(cfg):
        from optimizers.restarts import recovery_factor

        f *= recovery_factor(step, cfg.restarts.every, cfg.restarts.recovery_steps)
    return f


# ----------------------------------------------------------------------------------------------
# Param groups and the optimizer


def build_param_groups(model: torch.nn.Module, cfg: RunConfig) -> list[dict[str, Any]]:
    """Explicit rules (PAPER.md section 1): attention/MLP linear weights are projected for
    projection methods; every other matrix gets AdamW with weight decay; vectors (norms,
    biases) get no weight decay. Frozen parameters are left out."""
    o = cfg.optim
    spec = optimizers.method_spec(o.name)
    projected_method = spec.projects
    targets = set(o.targets)
    proj, decay, no_decay = [], [], []
    for mod_name, module in model.named_modules():
        attr = mod_name.rsplit(".", 1)[-1]
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if (
                projected_method
                and isinstance(module, torch.nn.Linear)
                and attr in targets
                and pname == "weight"
            ):
                proj.append(p)
            elif p.ndim < 2:
                no_decay.append(p)
            else:
                decay.append(p)
    if projected_method and not proj:
        raise ConfigError(
            f"optim.targets={sorted(targets)} matched no linear weight to project "
            f"(method {o.name}, factor.kind={cfg.factor.kind})"
        )
    for p in proj:
        if spec.fixed_rank is None and o.rank > min(p.shape):
            raise ConfigError(
                f"optim.rank={o.rank} exceeds min(m, n)={min(p.shape)} of a projected {tuple(p.shape)} weight"
            )
    groups = []
    if proj:
        groups.append({"params": proj, "weight_decay": o.weight_decay, **memory.projection_group(o)})
    if decay:
        groups.append({"params": decay, "weight_decay": o.weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def optimizer_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """Constructor keywords: the common Adam settings, `optim.extra` (without the basis options,
    which go to projected groups) and the run length for methods that need it (the registry).
    ``optim.eps`` null passes no eps, so the method's own reference value applies (GaLore, Fira,
    APOLLO and SPAM use 1e-6, AdamW 1e-8: one fixed default would be wrong for half of them)."""
    o = cfg.optim
    kw: dict[str, Any] = {"lr": o.lr, "betas": (o.beta1, o.beta2), "weight_decay": o.weight_decay}
    if o.eps is not None:
        kw["eps"] = o.eps
    kw.update(o.extra)
    return optimizers.method_spec(o.name).constructor_kwargs(kw, total_steps=cfg.train.max_steps)


def wrap_restarts(
    opt: torch.optim.Optimizer, model: torch.nn.Module, cfg: RunConfig
) -> torch.optim.Optimizer:
    """The `restarts` section as an optimizer wrapper (shared by the trainer and the HF callback)."""
    from effpretrain.models import factor_pairs, factor_spec, relora_merge_
    from optimizers import Restarts

    r, kind = cfg.restarts, cfg.factor.kind
    spec = factor_spec(kind) if kind != "none" else None
    if spec is not None and spec.merges_at_restart:
        # ReLoRA's restart: merge B A into W0, re-init, reset only B and A's state (jagged LR in lr_factor).
        return Restarts(
            opt,
            [],
            r.every,
            refactorize=False,
            reset_momentum=False,
            hooks=[lambda: relora_merge_(model, opt)],
        )
    pairs = factor_pairs(model) if (r.refactorize and spec is not None and spec.refactorizable) else []
    if r.refactorize and not pairs and kind != "none":
        raise ConfigError(f"restarts.refactorize needs a low-rank factorization (factor.kind={kind})")
    return Restarts(opt, pairs, r.every, refactorize=bool(pairs), reset_momentum=r.reset_momentum)


def build_optimizer_and_schedule(
    model: torch.nn.Module, cfg: RunConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The run's optimizer (wrapped in `Restarts` when `restarts.every > 0`) and its LambdaLR.

    Build it after any sharding (FSDP2 replaces the parameters) and before Accelerate's
    `prepare`. The scheduler multiplies each group's LR by `lr_factor(step, cfg)`.

    Raises:
        ConfigError: the method rejects its options (`optim: ...`), targets match nothing, the
            rank exceeds a projected weight, or restarts ask for a refactorization without factors.
    """
    groups = build_param_groups(model, cfg)
    try:
        opt = optimizers.build_optimizer(cfg.optim.name, groups, **optimizer_kwargs(cfg))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"optim: {e}") from None
    if cfg.restarts.every > 0:
        opt = wrap_restarts(opt, model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    return opt, sched


def opt_telemetry(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Basis refreshes (count, seconds) and restarts, from the optimizer and any wrapper of it."""
    out: dict[str, Any] = {}
    o: Any = opt
    while o is not None:
        if hasattr(o, "refresh_count"):
            out["opt/refreshes"] = int(o.refresh_count)
            out["opt/refresh_s"] = float(getattr(o, "refresh_seconds", 0.0))
        if hasattr(o, "num_restarts"):
            out["opt/restarts"] = int(o.num_restarts)
        o = getattr(o, "optimizer", None)
    return out

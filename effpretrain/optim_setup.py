"""From a RunConfig to the optimizer a run steps: param groups, optimizer, restarts, LR schedule.

Shared by both entry points: the Accelerate loop (`effpretrain.trainer`) and the HuggingFace
factory (`effpretrain.hf.create_optimizer`) call `build_optimizer_and_schedule`, so a recipe and
a `create_optimizer(...)` call with the same values train with the same groups and schedule.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import optimizers
from effpretrain.config import RunConfig
from effpretrain.errors import ConfigError
from effpretrain.models import FACTOR_KINDS, factor_pairs, factor_spec, relora_merge_
from effpretrain.models.factorized import FactorizedLinear, warm_start_layers
from effpretrain.models.llama import model_shape
from effpretrain.run_model import build_run_model
from optimizers import Restarts
from optimizers.restarts import recovery_factor

log = logging.getLogger("effpretrain")

# ----------------------------------------------------------------------------------------------
# Full-rank warm start (ReLoRA)


#: The attention weights whose rows split into heads: Adam-mini (`MethodSpec.head_blocks`) gives them
#: one block per head (`MethodSpec.head_block_group`).
HEAD_TARGETS: tuple[str, ...] = ("q_proj", "k_proj")


def head_group(method: str, head_dim: int) -> dict[str, Any]:
    """The group options the query and key weights get under `method` (also used by the trainer):
    the registry row's `head_block_group`, empty for a method without head blocks."""
    return optimizers.method_spec(method).head_block_group(head_dim)


def projection_group(optim_cfg: Any) -> dict[str, Any]:
    """The group options a projected param gets from an OptimConfig (also used by the trainer):
    the registry row's `projection_group`."""
    return _projection_options(optimizers.method_spec(optim_cfg.name), optim_cfg)


def _projection_options(spec: optimizers.MethodSpec, o: Any) -> dict[str, Any]:
    return spec.projection_group(
        rank=o.rank,
        update_proj_gap=o.update_proj_gap,
        scale=o.scale,
        proj_type=o.proj_type,
        basis=o.basis,
        extra=o.extra,
    )


@dataclass(frozen=True)
class OptimPlan:
    """A run's optimizer method resolved once: its registry row and the options of each kind of
    param group, which the trainer's param groups (`build_param_groups`) and the estimator's tally
    (`effpretrain.memory`) both build from. `optim_plan` makes it with the one registry lookup of
    a build; nothing that holds a plan looks the method up again.

    Attributes:
        spec: the method's registry row.
        weight_decay: lambda of the decayed groups (vectors and biases get 0).
        projected: a projected target's group options (`MethodSpec.projection_group`), or None
            when the method does not project.
        heads: the query and key weights' group options (`MethodSpec.head_block_group`; empty
            without head blocks).
        bias: a linear layer's bias's group options under head blocks (`MethodSpec.bias_group`).
        matrix: a whole-matrix group's options by role (`MethodSpec.matrix_group`; empty for a
            method without whole-matrix groups).
    """

    spec: optimizers.MethodSpec
    weight_decay: float
    projected: Mapping[str, Any] | None
    heads: Mapping[str, Any] = field(default_factory=dict)
    bias: Mapping[str, Any] = field(default_factory=dict)
    matrix: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def optim_plan(optim_cfg: Any, head_dim: int, name: str | None = None) -> OptimPlan:
    """The `OptimPlan` of an OptimConfig for a model whose attention heads have `head_dim` entries
    per row block (`_head_dim`; the estimator's `ModelShape.dim`); `name` names the method when it
    is not ``optim_cfg.name`` (the estimator's `method` argument).

    Raises:
        ValueError: an unknown method (naming the choices).
    """
    o = optim_cfg
    spec = optimizers.method_spec(name or o.name)
    heads = spec.head_block_group(head_dim)
    return OptimPlan(
        spec=spec,
        weight_decay=o.weight_decay,
        projected=_projection_options(spec, o) if spec.projects else None,
        heads=heads,
        bias=spec.bias_group() if heads else {},
        matrix={role: spec.matrix_group(role) for role in ("hidden", "embedding", "head")}
        if spec.matrix_params is not None
        else {},
    )


def warm_start_steps(cfg: RunConfig, world_size: int = 1) -> int:
    """`factor.warm_start_steps` (N), after refusing the set-ups that cannot run it.

    N > 0 needs a factor kind whose registry row warm-starts (`FactorSpec.warm_starts`: ReLoRA).
    Under FSDP2 with several processes it is refused: the switch from W0 to the factors changes
    which parameters train, and that path is implemented and tested for one process and DDP only.
    N >= `train.max_steps` is allowed (a warm-start-only run) and logged: the factors never train.

    Raises:
        ConfigError: N > 0 with a kind that does not warm-start, or with FSDP2 on several processes.
    """

    n, kind = cfg.factor.warm_start_steps, cfg.factor.kind
    if not n:
        return 0
    if kind == "none" or not factor_spec(kind).warm_starts:
        able = ", ".join(k for k, spec in FACTOR_KINDS.items() if spec.warm_starts)
        raise ConfigError(
            f"factor.warm_start_steps={n} needs a factor.kind that warm-starts ({able}), not {kind}"
        )
    if world_size > 1 and cfg.dist.sharding == "fsdp2":
        raise ConfigError(
            f"factor.warm_start_steps={n} is not supported with dist.sharding=fsdp2 on {world_size} "
            "processes; use dist.sharding=ddp"
        )
    if n >= cfg.train.max_steps:
        log.warning(
            "factor.warm_start_steps=%d >= train.max_steps=%d: the factors never train",
            n,
            cfg.train.max_steps,
        )
    return n


# ----------------------------------------------------------------------------------------------
# Schedule


def restart_ramps(cfg: RunConfig) -> bool:
    """Whether restarts re-warm the LR: after a momentum reset, or after ReLoRA's merge (whose
    factors' state is reset) - the jagged schedule."""

    r = cfg.restarts
    merges = cfg.factor.kind != "none" and factor_spec(cfg.factor.kind).merges_at_restart
    return r.every > 0 and r.recovery_steps > 0 and (r.reset_momentum or merges)


def _restart_ramp(step: int, cfg: RunConfig) -> float:
    """The recovery ramp's multiplier for update `step` + 1 (1 where there is none).

    Without a warm start: `recovery_factor(step, T, R)` when restarts re-warm. With a warm start of
    N steps: 1 during it; the switch at the end of step N counts as a restart (the factors start
    from fresh state), so with s = step - N the ramp is that of a restart at s = 0 (floor at s = 0,
    back on the schedule at s = R) and the restarts' own ramps follow at s = k T.
    """

    r, n = cfg.restarts, cfg.factor.warm_start_steps
    if not n:
        return recovery_factor(step, r.every, r.recovery_steps) if restart_ramps(cfg) else 1.0
    s, ramp = step - n, r.recovery_steps
    if restart_ramps(cfg) and s >= r.every:
        return recovery_factor(s, r.every, ramp)
    if 0 <= s < ramp:
        return recovery_factor(ramp + s, ramp, ramp)  # one period R after a restart at s = 0
    return 1.0


def lr_factor(step: int, cfg: RunConfig) -> float:
    """LR multiplier for optimizer step `step` (0-based).

    With W = floor(warmup_ratio * max_steps) warmup steps and progress
    p = min(1, (step - W) / max(1, max_steps - W)) after them, the factor is (step + 1) / W
    during warmup, then m + (1 - m) (1 + cos(pi p)) / 2 (cosine), 1 - (1 - m) p (linear) or 1
    (constant), with m = `min_lr_ratio`; times the restart recovery ramp when restarts re-warm
    (`restart_ramps`), and after a warm start's switch (`_restart_ramp`). The global schedule runs
    over the whole run, warm start included.
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
    return f * _restart_ramp(step, cfg)


# ----------------------------------------------------------------------------------------------
# Param groups and the optimizer


def _head_dim(model: torch.nn.Module) -> int:
    """The model's attention head size (1 for a model without a transformers config)."""
    c = getattr(model, "config", None)
    if c is None or not getattr(c, "num_attention_heads", None):
        return 1
    return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


def build_param_groups(model: torch.nn.Module, cfg: RunConfig) -> list[dict[str, Any]]:
    """Explicit rules (docs/benchmark.md): attention/MLP linear weights are projected for
    projection methods; a whole-matrix method's weights (`MethodSpec.matrix_params`, e.g. Muon's
    attention/MLP weights, every matrix for SCALE) get ``matrix=True`` groups, one per role; every
    other matrix gets AdamW with weight decay; vectors (norms, biases) get no weight decay.
    Frozen parameters are left out. For a method with head blocks (`MethodSpec.head_blocks`:
    Adam-mini) the query and key linear weights get a group of their own carrying the head size
    (`head_group`), and every linear layer's bias one of its own (`MethodSpec.bias_group`: plain
    Adam, as the reference). A method that steps factor pairs (`MethodSpec.steps_factor_pairs`:
    LORO) gets every (B, A) pair in one marked group first.

    With a warm start (`factor.warm_start_steps`) the groups are the same in both phases, so a
    checkpoint's optimizer state loads whichever phase wrote it: B and A are in the decay group
    even while frozen, and every W0 is in a last, plain group (the run's hyper-parameters and weight
    decay, never projected). A parameter trains only while it requires grad; the optimizer skips
    the others (no gradient) and makes no state for them.
    """

    return _param_groups(model, cfg, optim_plan(cfg.optim, _head_dim(model)))


def _param_groups(model: torch.nn.Module, cfg: RunConfig, plan: OptimPlan) -> list[dict[str, Any]]:
    """`build_param_groups` from a resolved `plan`."""
    warm = warm_start_layers(model) if cfg.factor.warm_start_steps else []
    proj, head, matrix, decay, no_decay, bias = _sort_params(model, cfg, warm, plan)
    _check_projected(proj, cfg, plan.spec)
    wd = plan.weight_decay
    groups = []
    if plan.spec.steps_factor_pairs:
        groups.append(_factor_pair_group(model, cfg, decay, wd))
    if proj:
        groups.append({"params": proj, "weight_decay": wd, **(plan.projected or {})})
    if head:
        groups.append({"params": head, "weight_decay": wd, **plan.heads})
    for role, params in matrix.items():
        groups.append({"params": params, "weight_decay": wd, **plan.matrix[role]})
    if decay:
        groups.append({"params": decay, "weight_decay": wd})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if bias:
        groups.append({"params": bias, "weight_decay": 0.0, **plan.bias})
    if warm:
        groups.append({"params": [layer.weight for layer in warm], "weight_decay": wd})
    return groups


def check_param_groups(cfg: RunConfig) -> None:
    """Builds the run's model on the meta device and its param groups (`build_param_groups`), so
    targets, ranks and factor options that cannot work are refused before any data is read or a
    tokenizer trained. The vocabulary is the preset's or config's: the groups do not depend on it.
    """
    with torch.device("meta"):
        model, _ = build_run_model(cfg, model_shape(cfg.model).vocab)
    build_param_groups(model, cfg)


def _sort_params(
    model: torch.nn.Module, cfg: RunConfig, warm: list[Any], plan: OptimPlan
) -> tuple[list, list, dict[str, list], list, list, list]:
    """Every trainable parameter (and a warm start's factors) by rule: projected, head-blocked,
    whole-matrix (by role), decayed matrix, undecayed vector, and (with head blocks) a linear
    layer's bias; a warm start's W0s are left out.

    Each parameter is sorted once, where it is first found: a matrix that two modules share (tied
    input and output embeddings) gets one group entry, so one update and one optimizer state.

    Raises:
        ConfigError: a module named in ``optim.targets`` is not a linear layer (`_check_target`).
    """
    spec, heads = plan.spec, bool(plan.heads)
    targets = set(cfg.optim.targets)
    w0s = {id(layer.weight) for layer in warm}
    phased = w0s | {id(p) for layer in warm for p in layer.factor_pair()}
    seen: set[int] = set()
    proj, head, bias, decay, no_decay = [], [], [], [], []
    matrix: dict[str, list[torch.nn.Parameter]] = {}  # whole-matrix groups by role (registry)
    for mod_name, module in model.named_modules():
        attr = mod_name.rsplit(".", 1)[-1]
        if attr in targets:
            _check_target(mod_name, module, cfg)
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen or id(p) in w0s or not (p.requires_grad or id(p) in phased):
                continue
            seen.add(id(p))
            target = isinstance(module, torch.nn.Linear) and attr in targets and pname == "weight"
            role = spec.matrix_role(
                target=target, embedding=isinstance(module, torch.nn.Embedding), ndim=p.ndim
            )
            if spec.projects and target:
                proj.append(p)
            elif heads and isinstance(module, torch.nn.Linear) and attr in HEAD_TARGETS and pname == "weight":
                head.append(p)
            elif heads and isinstance(module, torch.nn.Linear) and pname == "bias":
                bias.append(p)
            elif role is not None:
                matrix.setdefault(role, []).append(p)
            elif p.ndim < 2:
                no_decay.append(p)
            else:
                decay.append(p)
    if spec.matrix_params is not None and "hidden" not in matrix:
        raise ConfigError(
            f"optim.targets={sorted(targets)} matched no linear weight to step whole "
            f"(method {cfg.optim.name}, factor.kind={cfg.factor.kind})"
        )
    return proj, head, matrix, decay, no_decay, bias


def _check_target(name: str, module: torch.nn.Module, cfg: RunConfig) -> None:
    """A module that ``optim.targets`` names must be a linear layer: a `torch.nn.Linear` (weight
    out x in), or a factorized layer that replaced one. Anything else (transformers' ``Conv1D``,
    whose weight is stored in x out) is refused rather than trained under another rule."""
    if isinstance(module, (torch.nn.Linear, FactorizedLinear)):
        return
    kind = f"{type(module).__module__}.{type(module).__qualname__}"
    raise ConfigError(
        f"optim.targets names {name!r}, a {kind}: method {cfg.optim.name} steps only torch.nn.Linear "
        "weights there; choose targets that are nn.Linear modules"
    )


def _check_projected(proj: list[torch.Tensor], cfg: RunConfig, spec: optimizers.MethodSpec) -> None:
    """ConfigError when a projection method's targets match nothing or its rank exceeds a matrix."""
    o = cfg.optim
    if spec.projects and not proj:
        raise ConfigError(
            f"optim.targets={sorted(set(o.targets))} matched no linear weight to project "
            f"(method {o.name}, factor.kind={cfg.factor.kind})"
        )
    for p in proj:
        if spec.fixed_rank is None and o.rank > min(p.shape):
            raise ConfigError(
                f"optim.rank={o.rank} exceeds min(m, n)={min(p.shape)} of a projected {tuple(p.shape)} weight"
            )


def _factor_pair_group(
    model: torch.nn.Module, cfg: RunConfig, decay: list[torch.Tensor], weight_decay: float
) -> dict[str, Any]:
    """For a method that `steps_factor_pairs` (LORO): every factorized layer's B and A, in that
    order, in one group marked `optimizers.FACTOR_PAIRS_KEY`, taken out of `decay`.

    Raises:
        ConfigError: the model has no (B, A) pair (a factor kind without refactorizable pairs).
    """

    kind = cfg.factor.kind
    if kind == "none" or not factor_spec(kind).refactorizable:
        raise ConfigError(
            f"optim.name={cfg.optim.name} steps (B, A) factor pairs; factor.kind={kind} has none"
        )
    pairs = [p for pair in factor_pairs(model) for p in pair]
    paired = {id(p) for p in pairs}
    decay[:] = [p for p in decay if id(p) not in paired]
    return {"params": pairs, "weight_decay": weight_decay, optimizers.FACTOR_PAIRS_KEY: True}


def optimizer_kwargs(cfg: RunConfig, spec: optimizers.MethodSpec | None = None) -> dict[str, Any]:
    """Constructor keywords: the common Adam settings, `optim.extra` (without the basis options,
    which go to projected groups), the run length for methods that need it and `dist.whole_matrix`
    for methods with whole-matrix steps (the registry).
    ``optim.eps`` null passes no eps, so the method's own reference value applies (GaLore, Fira,
    APOLLO and SPAM use 1e-6, AdamW 1e-8: one fixed default would be wrong for half of them).
    `spec`: the method's registry row when the caller has resolved it (`OptimPlan.spec`)."""
    o = cfg.optim
    kw: dict[str, Any] = {"lr": o.lr, "betas": (o.beta1, o.beta2), "weight_decay": o.weight_decay}
    if o.eps is not None:
        kw["eps"] = o.eps
    kw.update(o.extra)
    spec = spec or optimizers.method_spec(o.name)
    if spec.whole_matrix_steps:
        kw["whole_matrix"] = cfg.dist.whole_matrix
    kw.update(spec.restart_kwargs(cfg.restarts.every))
    return spec.constructor_kwargs(kw, total_steps=cfg.train.max_steps)


def wrap_restarts(
    opt: torch.optim.Optimizer, model: torch.nn.Module, cfg: RunConfig
) -> torch.optim.Optimizer:
    """The `restarts` section as an optimizer wrapper (shared by the trainer and the HF callback)."""

    r, kind = cfg.restarts, cfg.factor.kind
    spec = factor_spec(kind) if kind != "none" else None
    if spec is not None and spec.merges_at_restart:
        # ReLoRA's restart: merge B A into W0, re-init, reset only B and A's state (jagged LR in lr_factor).
        # After a warm start of N steps the merges follow updates N + k every.
        return Restarts(
            opt,
            [],
            r.every,
            refactorize=False,
            reset_momentum=False,
            hooks=[lambda: relora_merge_(model, opt)],
            start=cfg.factor.warm_start_steps,
        )
    pairs = factor_pairs(model) if (r.refactorize and spec is not None and spec.refactorizable) else []
    if r.refactorize and not pairs and kind != "none":
        raise ConfigError(
            f"restarts.refactorize=true but factor.kind={kind} cannot be refactorized "
            "(B A is not its weight); set restarts.refactorize=false"
        )
    return Restarts(opt, pairs, r.every, refactorize=bool(pairs), reset_momentum=r.reset_momentum)


def build_optimizer_and_schedule(
    model: torch.nn.Module, cfg: RunConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The run's optimizer (wrapped in `Restarts` when `restarts.every > 0`) and its LambdaLR.

    Build it after any sharding (FSDP2 replaces the parameters) and before Accelerate's
    `prepare`. The scheduler multiplies each group's LR by `lr_factor(step, cfg)`.

    Raises:
        ConfigError: the method rejects its options (`optim: ...`), targets match nothing, the
            rank exceeds a projected weight, restarts ask for a refactorization without factors,
            or a warm start is asked of a kind that has none (`warm_start_steps`).
    """
    warm_start_steps(cfg)
    plan = optim_plan(cfg.optim, _head_dim(model))
    groups = _param_groups(model, cfg, plan)
    try:
        opt = plan.spec.build(groups, **optimizer_kwargs(cfg, plan.spec))
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

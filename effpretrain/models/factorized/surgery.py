"""Model surgery: replacing the target linears, factor pairs, merges, and ReLoRA's full-rank warm start."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from effpretrain.models.factorized.layers import TARGETS, FactorizedLinear, ReLoRALinear, sparse_nnz
from effpretrain.models.factorized.registry import FACTOR_KINDS, factor_spec, pretrained_kinds
from effpretrain.models.factorized.sltrain import SLTrainLinear
from optimizers.momentum_reset import prune_, reset_, unwrap_optimizer

logger = logging.getLogger("effpretrain")


def _param_counts(model: nn.Module) -> tuple[int, int]:
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def apply_factorization(
    model: nn.Module,
    kind: str,
    rank: int,
    alpha: float,
    targets: Sequence[str] = TARGETS,
    density: float = 0.03,
    seed: int = 0,
    pretrained: bool = False,
) -> dict[str, Any]:
    """Replaces, in place, every nn.Linear whose attribute name is in `targets` by a factorized layer.

    Works on transformers' LlamaForCausalLM (the default targets are its attention and MLP
    projections; embeddings, norms and lm_head are untouched) and on any module tree. All checks
    run before anything is replaced, so a failure leaves the model unchanged. New parameters are
    created on the replaced weight's device and dtype, initialised from torch's global RNG (seed it
    for reproducibility); LoRA/ReLoRA keep the original weight object as the frozen W0. SLTrain
    supports are drawn from a generator seeded by crc32(f"{seed}/{module name}"), so they are
    reproducible and distinct per layer. Logs (logger "effpretrain") what it replaced and the
    parameter counts before and after.

    Args:
        model: the model to modify.
        kind: a `FACTOR_KINDS` name ("lowrank", "lora", "relora", "sltrain", "cola", "cola_m").
        rank: r, at most min(m, n) of every target.
        alpha: the scale numerator (s = alpha / r).
        targets: attribute names of the Linear modules to replace.
        density, seed: SLTrain's delta, and the base seed of its supports.
        pretrained: the weights are a pretrained model's (`model.init`): each new layer starts
            from its weight by the kind's `FactorSpec.pretrained_start` rule (a kind without one
            is refused).

    Returns:
        {"kind", "rank", "alpha", "density" (sltrain only), "replaced": [module names],
        "params_before", "params_after", "trainable_params", "frozen_params", "index_elements"}.

    Raises:
        ValueError: unknown kind; rank < 1; rank > min(m, n) of a target (naming it); no module
            matched `kind`/`targets`.
    """
    spec = factor_spec(kind)
    if pretrained and not spec.pretrained_start:
        raise ValueError(f"{kind} defines no start from pretrained weights ({pretrained_kinds()} do)")
    found = _checked_targets(model, kind, rank, density, targets)
    params_before, trainable_before = _param_counts(model)
    for name, lin in found:
        w = lin.weight
        kw: dict[str, Any] = {"bias": lin.bias, "device": w.device, "dtype": w.dtype}
        if spec.sparse:
            kw.update(density=density, seed=zlib.crc32(f"{seed}/{name}".encode()))
        if spec.frozen_dense:
            kw["weight"] = w
        new = spec.layer(lin.in_features, lin.out_features, rank, alpha, **kw)
        if pretrained and spec.pretrained_start == "svd":
            new.from_dense_(w)
        _replace(model, name, new)
    params_after, trainable_after = _param_counts(model)
    _log_surgery(kind, rank, alpha, density if spec.sparse else None, found, spec.layer)
    logger.info(
        "apply_factorization: params %d -> %d, trainable %d -> %d",
        params_before,
        params_after,
        trainable_before,
        trainable_after,
    )
    report = _surgery_report(model, kind, rank, alpha, found, (params_before, params_after, trainable_after))
    if spec.sparse:
        report["density"] = float(density)
    return report


def _surgery_report(
    model: nn.Module,
    kind: str,
    rank: int,
    alpha: float,
    found: list[tuple[str, nn.Linear]],
    counts: tuple[int, int, int],
) -> dict[str, Any]:
    before, after, trainable = counts
    return {
        "kind": kind,
        "rank": rank,
        "alpha": float(alpha),
        "replaced": [name for name, _ in found],
        "params_before": before,
        "params_after": after,
        "trainable_params": trainable,
        "frozen_params": after - trainable,
        "index_elements": sum(
            m.sparse_index.numel() for m in model.modules() if isinstance(m, SLTrainLinear)
        ),
    }


def _checked_targets(
    model: nn.Module, kind: str, rank: int, density: float, targets: Sequence[str] | str
) -> list[tuple[str, nn.Linear]]:
    """The Linear modules to replace, every check done first (a failure changes nothing)."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if factor_spec(kind).sparse:
        sparse_nnz(1, 1, density)  # validates density before any surgery
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    named = [(name, mod) for name, mod in model.named_modules() if name.rpartition(".")[2] in targets]
    other = [(name, mod) for name, mod in named if not isinstance(mod, (nn.Linear, FactorizedLinear))]
    if other:
        name, mod = other[0]
        raise ValueError(
            f"apply_factorization(kind={kind!r}): {name} is a {type(mod).__module__}.{type(mod).__qualname__}, "
            "not torch.nn.Linear; only nn.Linear modules can be factorized"
        )
    found = [(name, mod) for name, mod in named if isinstance(mod, nn.Linear)]
    if not found:
        raise ValueError(
            f"apply_factorization(kind={kind!r}) replaced nothing: no nn.Linear named one of {list(targets)} "
            f"in {type(model).__name__}"
        )
    for name, mod in found:
        if rank > min(mod.out_features, mod.in_features):
            raise ValueError(
                f"rank {rank} exceeds min(m, n)={min(mod.out_features, mod.in_features)} of {name}"
            )
    return found


def _log_surgery(
    kind: str, rank: int, alpha: float, density: float | None, found: list[tuple[str, nn.Linear]], cls: type
) -> None:
    per_target: dict[str, int] = {}
    for name, _ in found:
        key = name.rpartition(".")[2]
        per_target[key] = per_target.get(key, 0) + 1
    logger.info(
        "apply_factorization: %s (rank=%d, alpha=%g%s) replaced %d Linear layers (%s)",
        kind,
        rank,
        alpha,
        f", density={density:g}" if density is not None else "",
        len(found),
        ", ".join(f"{k} x{v}" for k, v in per_target.items()),
    )
    for name, _ in found:
        logger.debug("apply_factorization: %s -> %s", name, cls.__name__)


def factorized_layers(model: nn.Module) -> list[tuple[str, FactorizedLinear]]:
    """(name, layer) for every factorized layer of `model`, in module order."""
    return [(name, mod) for name, mod in model.named_modules() if isinstance(mod, FactorizedLinear)]


def factor_pairs(model: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """(B, A) of every factorized layer, for optimizers.refactorization.refactorize_ / Restarts."""
    return [layer.factor_pair() for _, layer in factorized_layers(model)]


@torch.no_grad()
def merge_factorized_(model: nn.Module) -> int:
    """Replaces every factorized layer by a plain nn.Linear holding its dense_weight() (for export).

    The new Linear has the same outputs up to the rounding of (B A) x vs B (A x) and keeps the
    original bias parameter. Returns the number of layers replaced.

    Raises:
        TypeError: a layer has no dense equivalent (CoLA); nothing is replaced then.
    """
    layers = factorized_layers(model)
    kinds = tuple(spec.layer for spec in FACTOR_KINDS.values() if not spec.dense_equivalent)
    bad = [(name, layer) for name, layer in layers if isinstance(layer, kinds)]
    if bad:
        raise TypeError(f"{bad[0][0]} ({type(bad[0][1]).__name__}) has no dense weight to merge")
    for name, layer in layers:
        w = layer.dense_weight()
        # Built on the meta device so no throwaway weight is allocated and initialised.
        lin = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
        lin.weight = nn.Parameter(w)
        lin.bias = layer.bias
        _replace(model, name, lin)
    return len(layers)


@torch.no_grad()
def relora_merge_(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    prune_ratio: float | None = None,
) -> int:
    """ReLoRA restart: merge every ReLoRALinear (W0 += s B A; A Kaiming, B = 0), then fix its state.

    The merge always happens first, so no update is lost. With an optimizer, the state of the
    merged B and A is then either reset (prune_ratio None: moments and step zeroed,
    optimizers.momentum_reset.reset_) or magnitude-pruned (ReLoRA's choice, prune_ratio 0.999: keep
    the largest 0.1% of each moment, optimizers.momentum_reset.prune_). Other parameters' state is
    untouched. Pair with a jagged LR (optimizers.restarts.recovery_factor).

    Returns:
        The number of layers merged.
    """
    layers = [m for _, m in factorized_layers(model) if isinstance(m, ReLoRALinear)]
    for layer in layers:
        layer.merge_and_reinit_()
    if optimizer is not None and layers:
        params: Iterable[Tensor] = [p for layer in layers for p in layer.factor_pair()]
        if prune_ratio is None:
            reset_(optimizer, params=params)
        else:
            prune_(optimizer, prune_ratio, params=params)
    return len(layers)


# Full-rank warm start (ReLoRA): W0 trains first, then the factors; only requires_grad changes.


def warm_start_layers(model: nn.Module) -> list[FactorizedLinear]:
    """The factorized layers of `model` whose kind warm-starts (`FactorSpec.warm_starts`)."""
    kinds = tuple(spec.layer for spec in FACTOR_KINDS.values() if spec.warm_starts)
    return [layer for _, layer in factorized_layers(model) if isinstance(layer, kinds)]


def warm_start_params(model: nn.Module) -> list[nn.Parameter]:
    """W0 of every warm-starting layer: what the warm start trains (one plain param group)."""
    return [layer.weight for layer in warm_start_layers(model)]


def warming_up(model: nn.Module) -> bool:
    """Whether `model` is in the full-rank warm-start phase (its W0 are trainable)."""
    return any(w.requires_grad for w in warm_start_params(model))


def begin_warm_start_(model: nn.Module) -> int:
    """Enters the warm-start phase: every warm-starting layer's W0 trainable, its B and A frozen.

    Call it on a freshly factorized model (or one restored before its switch), where B = 0: the
    factor branch then adds exactly nothing, y = W0 x + b, and W0 trains as the dense model's
    weight would. Returns the number of layers.
    """
    layers = warm_start_layers(model)
    for layer in layers:
        layer.weight.requires_grad_(True)
        for p in layer.factor_pair():
            p.requires_grad_(False)
    return len(layers)


@torch.no_grad()
def end_warm_start_(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """The switch out of the warm start: W0 frozen again, B and A trainable.

    W0's gradient and its optimizer state are deleted, so its m and v memory is freed. B and A were
    frozen, so they never had a gradient and no optimizer made state for them: they start from
    fresh state (their state is not touched here, which also keeps a resumed run's restored state
    when this is applied on resuming past the switch). Returns the number of layers.
    """
    layers = warm_start_layers(model)
    state = unwrap_optimizer(optimizer).state if optimizer is not None else {}
    for layer in layers:
        layer.weight.requires_grad_(False)
        layer.weight.grad = None
        state.pop(layer.weight, None)
        for p in layer.factor_pair():
            p.requires_grad_(True)
    return len(layers)

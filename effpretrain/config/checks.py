"""Validation: every leaf's declared constraints, then the rules that join several keys."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import optimizers
from effpretrain.config.schema import RunConfig
from effpretrain.config.types import Check, OneOf
from effpretrain.errors import ConfigError
from effpretrain.models import FACTOR_KINDS, factor_spec
from effpretrain.models.factorized.registry import pretrained_kinds
from effpretrain.models.llama import init_folder_for_tokenizer

# Validation: every leaf's declared constraints, then the rules that join several keys.


def _show(value: Any) -> str:
    """`repr` for an error message, shortened: a bad value may be a whole file's worth."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's str conversion limit
        return "<a number too large to print>"
    return text if len(text) <= 80 else text[:77] + "..."


def _not_one_of(source: str, key: str, value: Any, choices: Sequence[Any]) -> ConfigError:
    return ConfigError(f"{source}: {key}={_show(value)} is not one of {', '.join(map(str, choices))}")


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any, type, str]]:
    """(dotted key, value, type hint, owning dataclass, field name) of every non-section field,
    in declaration order."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value, hints[f.name], type(obj), f.name


def _check(key: str, value: Any, tp: Any, source: str) -> None:
    """Raises ConfigError if `value` breaks a constraint declared in `tp` (choices, ranges)."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        _check(key, value, base, source)
        for m in meta:
            if isinstance(m, OneOf) and value not in m.names():
                raise _not_one_of(source, key, value, m.names())
            if isinstance(m, Check):
                try:
                    ok = bool(m.test(value))
                except TypeError:  # a wrong type set in code, not through the loader
                    ok = False
                if not ok:
                    raise ConfigError(f"{source}: {key}={_show(value)} must be {m.text}")
    elif origin is Literal:
        if value not in typing.get_args(tp):
            raise _not_one_of(source, key, value, typing.get_args(tp))
    elif origin in (Union, types.UnionType):
        if value is not None:  # an optional field: its other member's constraints apply
            for arg in typing.get_args(tp):
                if arg is not type(None):
                    _check(key, value, arg, source)
    elif origin is list:
        (inner,) = typing.get_args(tp)
        for i, v in enumerate(value):
            _check(f"{key}[{i}]", v, inner, source)
    elif tp is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: {key}={_show(value)} must be a finite number")


#: Constructor keywords that a typed `optim` key sets: in `optim.extra` they would silently win
#: over that key (the recipe would say one value and the run use another).
_EXTRA_SHADOWS = {
    "lr": "optim.lr",
    "betas": "optim.beta1 and optim.beta2",
    "eps": "optim.eps",
    "weight_decay": "optim.weight_decay",
    "rank": "optim.rank",
    "update_proj_gap": "optim.update_proj_gap",
    "scale": "optim.scale",
    "proj_type": "optim.proj_type",
    "basis": "optim.basis",
}


def validate(cfg: RunConfig, source: str = "config") -> RunConfig:
    """Checks choices and ranges; raises ConfigError naming the key and `source`."""
    for key, value, tp, *_ in _leaves(cfg):
        _check(key, value, tp, source)
    shadowed = sorted(set(cfg.optim.extra) & set(_EXTRA_SHADOWS))
    if shadowed:
        k = shadowed[0]
        raise ConfigError(
            f"{source}: optim.extra.{k} would override {_EXTRA_SHADOWS[k]}; set that key instead"
        )
    if cfg.data.source == "files" and not cfg.data.path:
        raise ConfigError(f"{source}: data.path is required when data.source=files")
    for key, spec in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path)):
        pattern = any(c in spec for c in "*?[")  # a glob is matched when the data is opened
        if cfg.data.source == "files" and spec and not pattern and not Path(spec).expanduser().exists():
            raise ConfigError(f"{source}: {key} not found: {spec}")
    if cfg.data.source == "hub" and not cfg.data.name:
        raise ConfigError(f"{source}: data.name is required when data.source=hub")
    if cfg.train.activation_checkpointing == "auto" and cfg.train.memory_budget_gb is None:
        raise ConfigError(f"{source}: train.activation_checkpointing=auto needs train.memory_budget_gb")
    _check_method_needs(cfg, source)
    _check_in_backward_refresh(cfg, source)
    _check_weight_quant(cfg, source)
    _check_init(cfg, source)
    if cfg.restarts.every and cfg.restarts.refactorize and cfg.factor.kind != "none":
        spec = factor_spec(cfg.factor.kind)
        if not (spec.refactorizable or spec.merges_at_restart):
            raise ConfigError(
                f"{source}: restarts.refactorize=true but factor.kind={cfg.factor.kind} cannot be refactorized "
                "(B A is not its weight); set restarts.refactorize=false"
            )
    return cfg


def _check_method_needs(cfg: RunConfig, source: str) -> None:
    """What a method's registry row asks of the rest of the config: (B, A) pairs of a factorized
    model (`MethodSpec.steps_factor_pairs`), a restart period (`MethodSpec.restart_period_arg`)."""

    spec, kind = optimizers.method_spec(cfg.optim.name), cfg.factor.kind
    if spec.steps_factor_pairs and (kind == "none" or not FACTOR_KINDS[kind].refactorizable):
        able = ", ".join(k for k, f in FACTOR_KINDS.items() if f.refactorizable)
        raise ConfigError(
            f"{source}: optim.name={cfg.optim.name} steps the (B, A) factor pairs of a factorized model: "
            f"set factor.kind to one of {able} (got {kind})"
        )
    if spec.restart_period_arg in cfg.optim.extra:
        raise ConfigError(
            f"{source}: optim.extra.{spec.restart_period_arg} would disagree with restarts.every, which "
            f"{cfg.optim.name} takes it from; set restarts.every instead"
        )
    if spec.restart_period_arg and cfg.restarts.every < 1:
        raise ConfigError(
            f"{source}: optim.name={cfg.optim.name} takes its {spec.restart_period_arg} from restarts.every: "
            "set restarts.every >= 1"
        )


def _check_in_backward_refresh(cfg: RunConfig, source: str) -> None:
    """``train.in_backward_refresh=first_micro`` acts only where low-rank accumulators do:
    updates in backward, no clipping, no FSDP2 (whose accumulators are full shards)."""
    t = cfg.train
    if t.in_backward_refresh == "accumulated":
        return
    why = (
        "needs train.update_in_backward=true"
        if not t.update_in_backward
        else "needs train.grad_clip=0 (low-rank accumulators)"
        if t.grad_clip > 0
        else "does not apply under dist.sharding=fsdp2 (its accumulators are full shards)"
        if cfg.dist.sharding == "fsdp2"
        else ""
    )
    if why:
        raise ConfigError(f"{source}: train.in_backward_refresh={t.in_backward_refresh} {why}")


def stochastic_rounding(cfg: RunConfig) -> bool:
    """`train.stochastic_rounding` resolved: `auto` is on exactly for INT8 weights."""
    sr = cfg.train.stochastic_rounding
    return cfg.train.weight_quant == "int8" if sr == "auto" else bool(sr)


def _check_init(cfg: RunConfig, source: str) -> None:
    """`model.init` (continued pretraining): what composes with it, and `data.tokenizer: auto`
    resolved to the tokenizer it means (the resolved config names it)."""
    init, kind = cfg.model.init, cfg.factor.kind
    if cfg.data.tokenizer == "auto":
        tok = init_folder_for_tokenizer(init) if init else "builtin-bpe"
        if tok is None:
            raise ConfigError(
                f"{source}: model.init={init} holds no tokenizer; set data.tokenizer to the model's tokenizer"
            )
        cfg.data.tokenizer = tok
    if not init:
        return
    if cfg.model.config:
        raise ConfigError(f"{source}: model.init implies the model's config; leave model.config empty")
    if kind != "none" and not FACTOR_KINDS[kind].pretrained_start:
        raise ConfigError(
            f"{source}: factor.kind={kind} defines no start from pretrained weights (model.init); "
            f"use one of {pretrained_kinds()}, or factor.kind=none"
        )
    if cfg.dist.sharding == "fsdp2" and (kind != "none" or cfg.train.weight_quant != "none"):
        what = f"factor.kind={kind}" if kind != "none" else f"train.weight_quant={cfg.train.weight_quant}"
        raise ConfigError(
            f"{source}: model.init under dist.sharding=fsdp2 loads each rank's shards into the plain "
            f"model; {what} is not supported there yet (use dist.sharding=ddp)"
        )


def _check_weight_quant(cfg: RunConfig, source: str) -> None:
    """INT8 weights compose with everything but compilation (their matmul is a Python-level
    function of the codes, which a compiled block would have to trace)."""
    if cfg.train.weight_quant == "int8" and cfg.train.compile:
        raise ConfigError(
            f"{source}: train.weight_quant=int8 does not compose with train.compile yet; set one"
        )

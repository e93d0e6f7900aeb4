"""Strict typed filling of the dataclasses from plain dicts (a YAML recipe's, a checkpoint's)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Annotated, Any, Literal, Union

from effpretrain.config.checks import _not_one_of, _show
from effpretrain.config.schema import RunConfig
from effpretrain.config.types import BOOL_AS_INT
from effpretrain.errors import ConfigError

# Strict typed filling of dataclasses from plain dicts.

#: Ints are 64-bit everywhere they end up (torch, numpy, checkpoints' JSON readers).
_INT_LIMIT = 2**63


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _plain(value: Any, key: str, source: str) -> Any:
    """A free-form value (`optim.extra`): plain YAML data only, since it is hashed as JSON and saved
    in checkpoints (no dates, sets or binary)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_plain(v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {
            _coerce(k, str, f"{key} key", source): _plain(v, f"{key}.{k}", source) for k, v in value.items()
        }
    raise ConfigError(
        f"{source}: {key}={_show(value)} has the wrong type (expected numbers, strings, lists or mappings)"
    )


def _scalar(value: Any, tp: Any, key: str, source: str) -> Any:
    if tp is bool and isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    # bool is an int subclass in Python; YAML's true/false is never a number here.
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        if not -_INT_LIMIT <= value < _INT_LIMIT:
            raise ConfigError(f"{source}: {key}={_show(value)} is out of range (a 64-bit integer)")
        return value
    if tp is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:  # YAML 1.1 reads 1e-3 (no dot) as a string
            number = float(value)
        except ValueError:
            number = None
        except OverflowError:  # an int too large for a float
            number = math.inf
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{source}: {key}={_show(value)} must be a finite number")
            return number
    raise ConfigError(f"{source}: {key}={_show(value)} has the wrong type (expected {_type_name(tp)})")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """`value` as type `tp` (the field's hint), or ConfigError; Literal choices checked here too."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        if isinstance(value, bool) and BOOL_AS_INT in meta:
            return int(value)
        return _coerce(value, base, key, source)
    if tp is Any:
        return _plain(value, key, source)
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{source}: {key}={_show(value)} has the wrong type (expected null)")
    if origin is Literal:
        choices = typing.get_args(tp)
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        raise _not_one_of(source, key, value, choices)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key, source)
            except ConfigError:
                continue
        raise ConfigError(f"{source}: {key}={_show(value)} has the wrong type (expected {tp})")
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key}={_show(value)} has the wrong type (expected a list)")
        return [_coerce(v, inner, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}={_show(value)} has the wrong type (expected a mapping)")
        return {
            _coerce(k, key_tp, f"{key} key", source): _coerce(v, value_tp, f"{key}.{k}", source)
            for k, v in value.items()
        }
    return _scalar(value, tp, key, source)


#: Keys that were removed, and what replaces them: a recipe still carrying one gets this one line
#: instead of a bare "unknown key" (never a silent translation: the meaning changed).
REPLACED_KEYS = {
    "train.eval_batches": "train.eval_tokens (validation target tokens, the same set for any number "
    "of processes; e.g. eval_tokens: 16384 for a tiny run, 10000000 as the benchmark)",
}


def _fill(obj: Any, data: Any, prefix: str, source: str) -> None:
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(f"{source}: {where} must be a mapping, got {_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted in REPLACED_KEYS:
            raise ConfigError(f"{source}: {dotted} was replaced by {REPLACED_KEYS[dotted]}")
        if key not in fields:
            raise ConfigError(f"{source}: unknown key {dotted!r} (known: {', '.join(fields)})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _fill(current, value, f"{dotted}.", source)
        else:
            setattr(obj, key, _coerce(value, hints[key], dotted, source))


def from_dict(data: dict[str, Any], source: str = "config") -> RunConfig:
    cfg = RunConfig()
    _fill(cfg, data or {}, "", source)
    return cfg

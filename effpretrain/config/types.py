"""Constraints declared on field types (ranges, registry names), read generically by `validate` and the config reference."""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import optimizers
from effpretrain.models import FACTOR_KINDS, PRESETS
from optimizers import projection

ATTN_MLP_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# Constraints declared on field types, read generically by `validate` and `config_table`.


@dataclass(frozen=True)
class Check:
    """A range a numeric field must lie in: ``test(value)`` holds, else "must be {text}"."""

    text: str
    test: Callable[[Any], bool]


@dataclass(frozen=True)
class OneOf:
    """A name from a registry, read at validation time (registries may grow at run time).

    Attributes:
        names: returns the valid names now.
        where: the registry, as the config table states it.
        listed: the table also lists today's names (for presets; not for methods, whose list
            grows with every registered method and lives in the README's Methods table).
    """

    names: Callable[[], Sequence[str]]
    where: str
    listed: bool = False


#: Marks an int field that also takes YAML ``true``/``false`` as 1/0 (a switch with a count).
BOOL_AS_INT = "bool-as-int"

POSITIVE = Check("> 0", lambda v: v > 0)
NON_NEGATIVE = Check(">= 0", lambda v: v >= 0)
CHECKPOINTING = Check("(an int >= 0, or `auto`)", lambda v: v == "auto" or (isinstance(v, int) and v >= 0))
AUTO_OR_BOOL = Check("`auto`, true or false", lambda v: v == "auto" or isinstance(v, bool))
FRACTION = Check("in [0, 1]", lambda v: 0 <= v <= 1)
BETA = Check("in [0, 1)", lambda v: 0 <= v < 1)
# numpy's seed range: accelerate's set_seed seeds numpy too.
SEED = Check("in [0, 2**32)", lambda v: 0 <= v < 2**32)

PositiveInt = Annotated[int, POSITIVE]
PositiveFloat = Annotated[float, POSITIVE]
NonNegativeInt = Annotated[int, NON_NEGATIVE]
NonNegativeFloat = Annotated[float, NON_NEGATIVE]
Fraction = Annotated[float, FRACTION]
Beta = Annotated[float, BETA]
Seed = Annotated[int, SEED]
Precision = Literal["fp32", "bf16-mixed", "bf16-pure"]
#: The canonical precision names, shared by `train.precision` and the memory estimator.
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)


def _method_names() -> list[str]:
    return sorted(optimizers.METHODS)


def _factor_kinds() -> list[str]:

    return ["none", *FACTOR_KINDS]


def _presets() -> list[str]:

    return list(PRESETS)


def _proj_types() -> list[str]:
    return list(projection.PROJ_TYPES)


def _bases() -> list[str]:
    return ["default", *projection.METHODS]


ProjType = Annotated[str, OneOf(_proj_types, "a side of `optimizers.projection.PROJ_TYPES`", listed=True)]
Basis = Annotated[str, OneOf(_bases, "a basis of `optimizers.projection.METHODS`, or `default`", listed=True)]
MethodName = Annotated[str, OneOf(_method_names, "a name in `optimizers.METHODS` (see Methods)")]
FactorKind = Annotated[str, OneOf(_factor_kinds, "`none` or a name in `effpretrain.models.FACTOR_KINDS`")]
Preset = Annotated[str, OneOf(_presets, "a name in `effpretrain.models.PRESETS`", listed=True)]

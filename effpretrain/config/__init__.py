"""The run configuration: dataclasses are the one schema, YAML recipes only fill them.

Each field is one YAML key (``section.key``); the docstring right under it says what the key
means, and its type says which values it takes: ``Literal[...]`` for a fixed set of choices,
``Annotated[..., Check]`` for a range, ``Annotated[str, OneOf]`` for a name in a registry
(`optimizers.METHODS`, `effpretrain.models.FACTOR_KINDS`, `effpretrain.models.PRESETS`), read when
validating, so a method registered at run time is a valid choice. The config reference
(docs/reference/config.md) is generated from the same source (`config_table`).

Loading is strict: an unknown key, a value of the wrong type or out of range, a recipe that is
not a readable UTF-8 YAML mapping raise `ConfigError` naming the key and the file it came from.
Overrides use dotted keys, ``--set optim.lr=3e-4``, with values parsed as YAML.
"""

__all__ = [
    "ATTN_MLP_TARGETS",
    "PRECISIONS",
    "ConfigError",
    "DataConfig",
    "DistConfig",
    "FactorConfig",
    "ModelConfig",
    "OptimConfig",
    "RestartsConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "config_hash",
    "config_table",
    "dump_yaml",
    "field_docs",
    "from_dict",
    "load_config",
    "to_dict",
    "validate",
]

from effpretrain.config.checks import validate
from effpretrain.config.fill import from_dict
from effpretrain.config.recipes import apply_overrides, config_hash, dump_yaml, load_config, to_dict
from effpretrain.config.schema import (
    DataConfig,
    DistConfig,
    FactorConfig,
    ModelConfig,
    OptimConfig,
    RestartsConfig,
    RunConfig,
    TrainConfig,
)
from effpretrain.config.table import config_table, field_docs
from effpretrain.config.types import ATTN_MLP_TARGETS, PRECISIONS
from effpretrain.errors import ConfigError

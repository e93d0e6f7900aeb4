"""YAML: recipes, override values, and the resolved config written back."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from effpretrain.config.checks import _show, validate
from effpretrain.config.fill import _fill, from_dict
from effpretrain.config.schema import RunConfig
from effpretrain.errors import ConfigError

# YAML: recipes and override values.


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML
    keeps the last value silently, so a recipe would not say what runs)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may override its keys
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable: the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"duplicate key {key!r}",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep)


def _parse_yaml(text: str, source: str, what: str) -> Any:
    """`text` as YAML data, or ConfigError ("{source}: {what} (line L, column C: problem)")."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{source}: {what} ({where}{e.problem or e.context})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: {what} ({str(e).splitlines()[0]})") from None
    # Values YAML matches but Python refuses: a date 2024-13-45, an int of 5000 digits.
    except (ValueError, OverflowError) as e:
        raise ConfigError(f"{source}: {what} ({e})") from None
    except RecursionError:
        raise ConfigError(f"{source}: {what} (nested too deeply)") from None


def _read_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe's top-level mapping; ConfigError if it is missing, unreadable, not UTF-8 text,
    not YAML, empty, or not a mapping."""
    p, source = Path(path), str(path)
    try:
        if p.is_dir():
            raise ConfigError(f"recipe {source} is a directory, not a file")
        if not p.exists():
            raise ConfigError(f"recipe not found: {source}")
        if not p.is_file():  # a FIFO or device would block or never end
            raise ConfigError(f"recipe {source} is not a regular file")
        raw = p.read_bytes()
    except (OSError, ValueError) as e:  # permissions, a name too long or with a NUL byte
        raise ConfigError(f"cannot read recipe {source}: {getattr(e, 'strerror', None) or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{source}: not UTF-8 text (byte {e.start}: {raw[e.start : e.start + 1]!r})"
        ) from None
    data = _parse_yaml(text, source, "not valid YAML")
    if data is None:
        raise ConfigError(f"{source}: recipe is empty (write {{}} for all defaults)")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a recipe must be a mapping of sections, got {_show(data)}")
    return data


def apply_overrides(cfg: RunConfig, overrides: list[str], source: str = "--set") -> RunConfig:
    """Applies ``section.key=value`` strings; values are parsed as YAML."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{source}: {_show(item)} is not of the form section.key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        value = _parse_yaml(raw, source, f"cannot parse value of {key!r}") if raw != "" else ""
        nested: dict[str, Any] = {}
        cur = nested
        parts = key.split(".")
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = value
        _fill(cfg, nested, "", f"{source} {key}")
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Loads a recipe (or the defaults when `path` is None), applies overrides, validates."""
    if path is None:
        cfg, source = RunConfig(), "defaults"
    else:
        source = str(path)
        cfg = from_dict(_read_recipe(path), source)
        if not cfg.method:
            cfg.method = Path(path).stem
    apply_overrides(cfg, overrides or [])
    if not cfg.method:
        cfg.method = cfg.optim.name if cfg.factor.kind == "none" else cfg.factor.kind
    return validate(cfg, source if not overrides else f"{source} (+ --set)")


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_hash(cfg: RunConfig) -> str:
    """Short stable hash of the resolved config (for results tables and resume checks)."""
    blob = json.dumps(to_dict(cfg), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)

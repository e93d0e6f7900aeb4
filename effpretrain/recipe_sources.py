"""The published hyper-parameters of the paper-scale recipes and where each comes from.

`recipes/sources.yaml` is the table: for every paper recipe (`recipes/llama_<size>/<name>.yaml`)
the value of each hyper-parameter that decides whether a run reproduces the benchmark (rank,
alpha or scale, learning rate, eps, clipping, density, restart period, ...) and its source (the
benchmark's code, the method's own script or code, or a paper), with disagreeing sources listed
as overrides. `check_recipe` compares a loaded recipe with it; `tests/test_recipe_sources.py`
runs it on every paper recipe, so a recipe cannot drift from its sources unnoticed.

Keys are `section.field` of the recipe (`optim.rank`, `factor.alpha`, `train.grad_clip`), or
`optimizer.<name>` for what the optimizer is finally constructed with, class defaults included
(`optimizer.eps`: a recipe that leaves `optim.eps` null gets the method's reference eps, and the
table checks that value, not the absence of a key).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml

import optimizers
from effpretrain.config import RunConfig, validate
from effpretrain.errors import ConfigError
from effpretrain.memory import projection_group
from effpretrain.models import FACTOR_KINDS
from effpretrain.optim_setup import optimizer_kwargs

#: The table, beside the recipes it describes.
SOURCES_FILE = Path(__file__).resolve().parent.parent / "recipes" / "sources.yaml"
#: Model presets of the benchmark's four sizes: the directories `recipes/<preset>/`.
PAPER_PRESETS = ("llama_60m", "llama_130m", "llama_350m", "llama_1b")
#: Prefix of keys read from the constructed optimizer rather than from the recipe.
OPTIMIZER_PREFIX = "optimizer."


def load_sources(path: str | Path = SOURCES_FILE) -> dict[str, Any]:
    """The table as a dict (`sources`, `common`, `recipes`); every entry's `source` (and each
    override's) must name one of `sources`, or ConfigError."""
    table = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    known = set(table["sources"])
    groups = {"common": table["common"], **table["recipes"]}
    for name, blocks in groups.items():
        for block, entries in blocks.items():
            for key, entry in entries.items():
                for e in [entry, *entry.get("overrides", [])]:
                    if e["source"] not in known:
                        raise ConfigError(f"{path}: {name}/{block}/{key}: unknown source {e['source']!r}")
    return table


def expected_values(table: Mapping[str, Any], name: str, preset: str) -> dict[str, dict[str, Any]]:
    """key -> entry ({value, source, ...}) for recipe `name` at `preset`: `common`'s `all` and
    `preset` blocks, then the recipe's (later wins)."""
    if name not in table["recipes"]:
        raise ConfigError(f"recipes/{preset}/{name}.yaml has no entry in {SOURCES_FILE.name}")
    out: dict[str, dict[str, Any]] = {}
    for blocks in (table["common"], table["recipes"][name]):
        out.update(blocks.get("all", {}))
        out.update(blocks.get(preset, {}))
    return out


def optimizer_settings(cfg: RunConfig) -> dict[str, Any]:
    """What the run's optimizer is constructed with: its defaults (class signature, registry
    defaults, the toolkit's keywords from the config) as the built optimizer reports them, with a
    projected group's options (e.g. APOLLO's `scale_front`) for a projecting method."""

    groups: list[dict[str, Any]] = [{"params": [torch.nn.Parameter(torch.zeros(2, 2))]}]
    if optimizers.method_spec(cfg.optim.name).projects:  # as the trainer builds a projected group
        groups.append({"params": [torch.nn.Parameter(torch.zeros(2, 2))], **projection_group(cfg.optim)})
    opt = optimizers.build_optimizer(cfg.optim.name, groups, **optimizer_kwargs(cfg))
    return {**opt.defaults, **opt.param_groups[0], **opt.param_groups[-1]}


def resolved_value(cfg: RunConfig, key: str, settings: Mapping[str, Any] | None = None) -> Any:
    """The recipe's value of `key` (see the module docstring); KeyError if it has none."""
    if key.startswith(OPTIMIZER_PREFIX):
        settings = optimizer_settings(cfg) if settings is None else settings
        return settings[key.removeprefix(OPTIMIZER_PREFIX)]
    obj: Any = cfg
    for part in key.split("."):
        if not hasattr(obj, part):
            raise KeyError(key)
        obj = getattr(obj, part)
    return obj


def required_keys(cfg: RunConfig, settings: Mapping[str, Any]) -> set[str]:
    """The keys the table must give for this recipe: learning rate, eps and clipping always; rank,
    scale and refresh gap for a projecting optimizer; rank and alpha for a factorized model,
    density for a sparse one; the restart period and ramp when the run restarts; a reset period
    the optimizer keeps itself (Stable-SPAM, SPAM); APOLLO's `scale_front`; a warm start where the
    factor kind has one."""
    keys = {"optim.lr", "optimizer.eps", "train.grad_clip", "optim.weight_decay", "train.max_steps"}
    if optimizers.method_spec(cfg.optim.name).projects:
        keys |= {"optim.rank", "optim.scale", "optim.update_proj_gap"}
    kind = cfg.factor.kind
    if kind != "none":
        spec = FACTOR_KINDS[kind]
        keys |= {"factor.rank", "factor.alpha"}
        if spec.sparse:
            keys.add("factor.density")
        if getattr(spec, "warm_starts", False):
            keys.add("factor.warm_start_steps")
    if cfg.restarts.every or (kind != "none" and FACTOR_KINDS[kind].merges_at_restart):
        keys |= {"restarts.every", "restarts.recovery_steps"}
    keys |= {f"{OPTIMIZER_PREFIX}{k}" for k in ("reset_interval", "scale_front") if k in settings}
    return keys


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


def check_recipe(cfg: RunConfig, name: str, table: Mapping[str, Any]) -> list[str]:
    """Every disagreement between recipe `name` (loaded as `cfg`) and the table, one line each
    (empty: the recipe is what its sources say). A required key (`required_keys`) the table does
    not give is a disagreement too, so a new hyper-parameter cannot go unsourced."""

    preset = cfg.model.preset
    want = expected_values(table, name, preset)
    try:  # e.g. an optim.extra key that would override the checked optim key
        validate(cfg, f"{preset}/{name}")
    except ConfigError as e:
        return [str(e)]
    settings = optimizer_settings(cfg)
    problems = [
        f"{preset}/{name}: {key} has no entry in {SOURCES_FILE.name}"
        for key in sorted(required_keys(cfg, settings) - set(want))
    ]
    for key, entry in want.items():
        try:
            got = resolved_value(cfg, key, settings)
        except KeyError:
            problems.append(f"{preset}/{name}: {key} is not a setting of this recipe")
            continue
        if not _same(got, entry["value"]):
            problems.append(
                f"{preset}/{name}: {key} = {got!r}, but {entry['source']} gives {entry['value']!r}"
            )
    return problems

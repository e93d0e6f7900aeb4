"""Every paper-scale recipe matches recipes/sources.yaml, the table of published hyper-parameters
with their sources, and the check catches a change to any value the table gives."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from effpretrain.config import RunConfig, load_config
from effpretrain.errors import ConfigError
from effpretrain.recipe_sources import (
    OPTIMIZER_PREFIX,
    PAPER_PRESETS,
    SOURCES_FILE,
    check_recipe,
    expected_values,
    load_sources,
)

RECIPES = SOURCES_FILE.parent
PAPER = sorted(p for preset in PAPER_PRESETS for p in (RECIPES / preset).glob("*.yaml"))
TABLE = load_sources()


def _id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def test_every_paper_recipe_has_a_table_entry_and_back():
    assert len(PAPER) == 4 * 18
    names = {p.stem for p in PAPER}
    assert names == set(TABLE["recipes"]), "recipes without a table entry, or table entries without recipes"
    for preset in PAPER_PRESETS:
        assert {p.stem for p in (RECIPES / preset).glob("*.yaml")} == names, preset


@pytest.mark.parametrize("path", PAPER, ids=_id)
def test_paper_recipe_matches_its_sources(path):
    assert check_recipe(load_config(path), path.stem, TABLE) == []


def _changed(value):
    """A different value of the same type (and still valid for the field)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if not value:
        return 1.0
    return value / 2 if value < 1 else value * 2  # a decay rate stays in [0, 1)


def _mutate(cfg: RunConfig, key: str, value) -> RunConfig:
    """`cfg` with `key` changed the way a recipe edit would change it."""
    cfg = copy.deepcopy(cfg)
    if key == "optimizer.eps":
        cfg.optim.eps = _changed(value)
    elif key.startswith(OPTIMIZER_PREFIX):  # a constructor keyword: set through optim.extra
        cfg.optim.extra = {**cfg.optim.extra, key.removeprefix(OPTIMIZER_PREFIX): _changed(value)}
    else:
        section, field = key.split(".")
        sub = getattr(cfg, section)
        setattr(cfg, section, dataclasses.replace(sub, **{field: _changed(getattr(sub, field))}))
    return cfg


@pytest.mark.parametrize("path", PAPER, ids=_id)
def test_changing_any_sourced_value_is_caught(path):
    cfg = load_config(path)
    want = expected_values(TABLE, path.stem, cfg.model.preset)
    # The list must be among the checked keys wherever it applies.
    assert {"optim.lr", "optimizer.eps", "train.grad_clip"} <= set(want)
    for key, entry in want.items():
        problems = check_recipe(_mutate(cfg, key, entry["value"]), path.stem, TABLE)
        assert any(p.split(": ", 1)[1].startswith(f"{key} =") for p in problems), (key, problems)


def test_a_changed_rank_names_the_key_the_value_and_the_source():
    cfg = load_config(RECIPES / "llama_350m" / "galore.yaml")
    cfg.optim.rank = 256  # GaLore's own script: the benchmark's 1.59 GB needs 384
    assert check_recipe(cfg, "galore", TABLE) == [
        "llama_350m/galore: optim.rank = 256, but benchmark-memory gives 384"
    ]


@pytest.mark.parametrize("key", ["lr", "weight_decay", "scale", "eps", "rank"])
def test_an_optim_extra_key_that_would_override_a_checked_value_is_refused(key):
    # optim.extra reaches the constructor after the typed keys: {lr: 0.5} there would train at 0.5
    # while optim.lr still reads 0.01.
    cfg = load_config(RECIPES / "llama_60m" / "galore.yaml")
    cfg.optim.extra = {key: 0.5}
    assert check_recipe(cfg, "galore", TABLE) == [
        f"llama_60m/galore: optim.extra.{key} would override optim.{key}; set that key instead"
    ]


def test_a_hyper_parameter_the_table_does_not_source_is_reported():
    table = copy.deepcopy(TABLE)
    del table["recipes"]["sltrain"]["all"]["factor.density"]
    cfg = load_config(RECIPES / "llama_60m" / "sltrain.yaml")
    assert check_recipe(cfg, "sltrain", table) == [
        "llama_60m/sltrain: factor.density has no entry in sources.yaml"
    ]


def test_eps_left_null_is_the_method_reference_value():
    from effpretrain.recipe_sources import optimizer_settings

    expected = {"adamw": 1e-8, "stable_spam": 1e-8, "galore_8bit": 1e-8}
    for name in ("adamw", "stable_spam", "spam", "galore", "galore_8bit", "fira", "apollo", "apollo_mini"):
        cfg = RunConfig()
        cfg.optim = dataclasses.replace(cfg.optim, name=name)
        assert cfg.optim.eps is None
        assert optimizer_settings(cfg)["eps"] == expected.get(name, 1e-6), name


def test_an_unknown_source_name_is_refused(tmp_path):
    table = copy.deepcopy(TABLE)
    table["recipes"]["adamw"]["all"]["optim.lr"]["source"] = "a-blog"
    import yaml

    path = tmp_path / "sources.yaml"
    path.write_text(yaml.safe_dump(table))
    with pytest.raises(ConfigError, match="adamw/all/optim.lr: unknown source 'a-blog'"):
        load_sources(path)

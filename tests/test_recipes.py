"""Every recipe under recipes/ loads: run recipes through effpretrain's strict loader (and the
registries and the estimator), launcher configs through Accelerate's own loader.

The paper-scale recipes are too large to train here; these checks catch what would otherwise
fail only at start-up on a GPU cluster: an unknown key, a method or factor kind no longer
registered, an `optim.extra` keyword the optimizer does not take, a rank larger than the model.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from _common import ROOT

import optimizers
from effpretrain import memory
from effpretrain.config import load_config
from effpretrain.models import FACTOR_KINDS
from effpretrain.models.llama import model_shape

RECIPES = ROOT / "recipes"
LAUNCHER_DIR = RECIPES / "accelerate"
ALL = sorted(RECIPES.rglob("*.yaml"))
LAUNCHERS = [p for p in ALL if LAUNCHER_DIR in p.parents]
SOURCES = RECIPES / "sources.yaml"  # the table of published values (tests/test_recipe_sources.py)
RUNS = [p for p in ALL if LAUNCHER_DIR not in p.parents and p != SOURCES]


def _id(path: Path) -> str:
    return str(path.relative_to(RECIPES))


def test_every_recipe_is_checked():
    # 21 tiny recipes and 18 per paper scale (60m, 130m, 350m, 1b); the launcher configs.
    assert len(RUNS) >= 21 + 4 * 18 and len(LAUNCHERS) >= 5
    assert not list(RECIPES.rglob("*.yml")), "recipes use the .yaml suffix (this test globs it)"


@pytest.mark.parametrize("path", RUNS, ids=_id)
def test_run_recipe_loads_and_resolves(path):
    cfg = load_config(path)
    spec = optimizers.method_spec(cfg.optim.name)
    cls = spec.cls  # the class imports

    # optim.extra: constructor keywords the class takes, or basis options of a projecting method.
    extra = dict(cfg.optim.extra)
    basis_options = set(extra) & set(optimizers.PROJECTION_GROUP_EXTRAS)
    assert spec.projects or not basis_options, f"{sorted(basis_options)}: {spec.name} does not project"
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = set(spec.constructor_kwargs(extra, total_steps=cfg.train.max_steps)) - set(params)
        assert not unknown, f"optim.extra {sorted(unknown)}: not arguments of {cls.__name__}"

    # Every attention/MLP weight has the hidden size as one side, so a rank must fit in it.
    hidden = model_shape(cfg.model).hidden  # a preset's, or a continued run's source model's
    if spec.projects:
        rank = spec.fixed_rank or cfg.optim.rank
        assert rank <= hidden, f"optim.rank={rank} exceeds the model's hidden size {hidden}"
    if cfg.factor.kind != "none":
        factor = FACTOR_KINDS[cfg.factor.kind]
        assert cfg.factor.rank <= hidden, f"factor.rank={cfg.factor.rank} exceeds hidden size {hidden}"
        # The trainer refuses restarts that refactorize a kind that cannot be (and does not merge).
        if cfg.restarts.every and cfg.restarts.refactorize:
            assert factor.refactorizable or factor.merges_at_restart, cfg.factor.kind

    est = memory.estimate_from_config(
        cfg, cfg.data.vocab_size if cfg.data.tokenizer == "builtin-bpe" else None
    )
    assert est.total > est.weights > 0


def _launch_options() -> dict[str, object]:
    from accelerate.commands.launch import launch_command_parser

    return {a.dest: a for a in launch_command_parser()._actions}


@pytest.mark.parametrize("path", LAUNCHERS, ids=_id)
def test_accelerate_config_loads(path):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    # Accelerate's own loader: unknown top-level keys and bad distributed_type values raise.
    loaded = load_config_from_file(str(path))
    assert isinstance(loaded, ClusterConfig)
    options = _launch_options()
    # The loader does not check nested FSDP keys; `accelerate launch` would ignore a misspelt one.
    for key in loaded.fsdp_config:
        name = key if key.startswith("fsdp_") else f"fsdp_{key}"
        assert name in options, f"fsdp_config.{key} is not an accelerate launch option"
    choices = options["mixed_precision"].choices
    assert loaded.mixed_precision in choices, f"mixed_precision {loaded.mixed_precision!r} not in {choices}"
    assert loaded.num_processes >= 1 and loaded.num_machines >= 1

"""The plan: one run per recipe, seed and swept learning rate, at an equal token budget."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leaderboard.common import GRIDS, MIN_STEPS, MIN_TOKENS_PER_STEP, RECIPES, ROOT, BadInput

# Planning: which runs, at how many steps


def steps_for_tokens(tokens: int, batch_size: int, grad_accum: int, seq_len: int, world_size: int = 1) -> int:
    """Optimizer steps that reach at least `tokens` tokens: ceil(tokens / tokens per step).

    Rounding up means every method trains on the same whole number of steps and at least the
    budget; the actual token count is recorded beside the budget.
    """
    if tokens <= 0:
        raise BadInput(f"--tokens must be > 0, got {tokens}")
    per_step = batch_size * grad_accum * seq_len * world_size
    return max(1, math.ceil(tokens / per_step))


def eval_every_for(steps: int, points: int) -> int:
    """Eval interval giving about `points` evaluations; the trainer always evaluates the last step."""
    return max(1, math.ceil(steps / max(1, points)))


@dataclass(frozen=True)
class RunSpec:
    """One planned training run of the grid."""

    name: str  # <method>-<model>[-sweep-lr<label>]-seed<k>: the run's folder under DIR/runs
    recipe: str  # path relative to the repository root where possible
    method: str
    model: str
    seed: int
    token_budget: int
    steps: int
    overrides: tuple[str, ...]
    config_hash: str
    phase: str = "final"  # "sweep" (a short learning-rate trial) or "final" (the full budget)
    lr: float | None = None  # the run's peak learning rate (optim.lr after overrides)
    lr_label: str | None = None  # the sweep point that gave it ("x0.5", "3e-3"); None off the sweep
    tokens_per_step: int = 0


@dataclass(frozen=True)
class LrPoint:
    """One point of ``--sweep lr=...``: a multiple of the recipe's ``optim.lr`` or an absolute lr."""

    label: str
    multiplier: float | None = None
    value: float | None = None

    def lr(self, recipe_lr: float) -> float:
        return (
            float(self.value) if self.value is not None else float(recipe_lr) * float(self.multiplier or 1.0)
        )


def parse_sweep(text: str) -> list[LrPoint]:
    """``lr=x0.25,x0.5,x1,x2,x4`` (multiples of each recipe's lr) or ``lr=1e-3,3e-3`` (absolute)."""
    key, sep, values = text.partition("=")
    if key.strip() != "lr" or not sep:
        raise BadInput(f"--sweep: expected lr=x0.5,x1,x2 or lr=1e-3,3e-3, got {text!r}")
    points: list[LrPoint] = []
    for item in (v.strip() for v in values.split(",")):
        if not item:
            continue
        try:
            number = float(item[1:] if item.startswith("x") else item)
        except ValueError:
            raise BadInput(f"--sweep: {item!r} is neither xMULTIPLIER nor a number") from None
        if not math.isfinite(number) or number <= 0:
            raise BadInput(f"--sweep: {item!r} must be a positive number")
        is_mult = item.startswith("x")
        points.append(
            LrPoint(item, multiplier=number if is_mult else None, value=None if is_mult else number)
        )
    if not points or len({p.label for p in points}) != len(points):
        raise BadInput(f"--sweep: expected distinct points, got {text!r}")
    return points


def grid_recipes(grid: str, recipes_root: Path = RECIPES) -> list[Path]:
    """The recipe files of a named grid: every `<model>/*.yaml` of its model folders that exist."""
    if grid not in GRIDS:
        raise BadInput(f"--grid {grid!r} is not one of {', '.join(GRIDS)}")
    found = [p for folder in GRIDS[grid] for p in sorted((recipes_root / folder).glob("*.yaml"))]
    if not found:
        raise BadInput(f"--grid {grid}: no recipes under {', '.join(f'recipes/{f}/' for f in GRIDS[grid])}")
    return found


def _display_path(path: Path) -> str:
    """Relative to the repository root when inside it (results carry no machine paths)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path.resolve())


def plan_runs(
    recipes: Sequence[Path],
    tokens: int,
    seeds: Sequence[int] = (0,),
    methods: Iterable[str] | None = None,
    extra_overrides: Sequence[str] = (),
    eval_points: int = 4,
    *,
    sweep: Sequence[LrPoint] | None = None,
    lrs: Mapping[tuple[str, str], float] | None = None,
) -> list[RunSpec]:
    """Loads each recipe and builds its equal-token runs, one per seed (and sweep point).

    Args:
        recipes: recipe YAML files.
        tokens: token budget per run.
        seeds: values of ``train.seed``.
        methods: keep only recipes whose method (the recipe's stem unless it sets ``method``) is
            listed; None keeps all.
        extra_overrides: ``key=value`` overrides applied to every run before the budget.
        eval_points: about how many evaluations each run makes.
        sweep: plan the learning-rate sweep instead: one run per point and seed, phase "sweep".
        lrs: final runs at these learning rates, by (model, method); a recipe whose (model,
            method) is missing is left out (its sweep chose nothing). None: the recipes' own lr.

    Returns:
        The runs, in recipe order, then sweep point order, then seed order.
    """
    from effpretrain.config import load_config
    from effpretrain.errors import ConfigError

    wanted = set(methods) if methods is not None else None
    specs: list[RunSpec] = []
    for recipe in recipes:
        try:
            base = load_config(recipe, list(extra_overrides))
        except ConfigError as e:
            raise BadInput(str(e)) from None
        if wanted is not None and base.method not in wanted:
            continue
        points = _lr_points(base, sweep, lrs)
        t = base.train
        steps = steps_for_tokens(tokens, t.batch_size, t.grad_accum, base.data.seq_len)
        for label, lr in points:
            for seed in seeds:
                overrides = (
                    *extra_overrides,
                    *((f"optim.lr={lr!r}",) if lr != base.optim.lr else ()),
                    f"train.max_steps={steps}",
                    f"train.eval_every={eval_every_for(steps, eval_points)}",
                    "train.save_every=0",  # only the final checkpoint: mid-run saves only cost time here
                    f"train.seed={seed}",
                )
                specs.append(_spec(recipe, overrides, label, seed, tokens, steps, sweep is not None))
    _check_plan(specs, wanted, lrs)
    return specs


def _check_plan(specs: Sequence[RunSpec], wanted: set[str] | None, lrs: object) -> None:
    """Refuses a plan in which two runs share a name, or (outside the final phase, `lrs` None)
    a wanted method has no recipe."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise BadInput(f"two recipes give the same run name {twice!r}: set a distinct `method` in one")
    if wanted is not None:
        missing = wanted - {s.method for s in specs}
        if missing and lrs is None:
            raise BadInput(f"--methods: no recipe for {', '.join(sorted(missing))}")


def _lr_points(
    base: Any, sweep: Sequence[LrPoint] | None, lrs: Mapping[tuple[str, str], float] | None
) -> list[tuple[str | None, float]]:
    """(sweep label, lr) of each run of a recipe: the sweep's points, the chosen lr (none when the
    sweep chose nothing for it), or the recipe's own lr."""
    if sweep is not None:
        return [(p.label, p.lr(base.optim.lr)) for p in sweep]
    if lrs is not None:
        key = (base.model.preset, base.method)
        return [(None, lrs[key])] if key in lrs else []
    return [(None, base.optim.lr)]


def _spec(
    recipe: Path,
    overrides: tuple[str, ...],
    label: str | None,
    seed: int,
    tokens: int,
    steps: int,
    sweep: bool,
) -> RunSpec:
    from effpretrain.config import config_hash, load_config

    cfg = load_config(recipe, list(overrides))
    trial = f"-sweep-lr{label}" if label is not None else ""
    return RunSpec(
        name=f"{cfg.method}-{cfg.model.preset}{trial}-seed{seed}",
        recipe=_display_path(recipe),
        method=cfg.method,
        model=cfg.model.preset,
        seed=seed,
        token_budget=tokens,
        steps=steps,
        overrides=overrides,
        config_hash=config_hash(cfg),
        phase="sweep" if sweep else "final",
        lr=cfg.optim.lr,
        lr_label=label,
        tokens_per_step=cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len,
    )


def budget_warnings(specs: Iterable[RunSpec]) -> list[str]:
    """The budget floors a plan misses: tokens per step below `MIN_TOKENS_PER_STEP` (any phase) and
    final runs of fewer than `MIN_STEPS` steps (a sweep is short on purpose)."""
    out = []
    for phase in ("sweep", "final"):
        ss = [s for s in specs if s.phase == phase]
        small = sorted({s.tokens_per_step for s in ss if s.tokens_per_step < MIN_TOKENS_PER_STEP})
        if small:
            out.append(
                f"{phase} runs train {', '.join(f'{t:,}' for t in small)} tokens per step, below the floor of "
                f"{MIN_TOKENS_PER_STEP:,} (raise train.batch_size or data.seq_len)"
            )
        short = sorted({s.steps for s in ss if s.steps < MIN_STEPS})
        if short and phase == "final":
            out.append(
                f"final runs take {', '.join(map(str, short))} steps, below the floor of {MIN_STEPS} "
                "(raise --tokens)"
            )
    return out

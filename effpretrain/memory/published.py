"""The estimator beside the published memory table (the benchmark's published memory table, Glentis et al. 2025; docs/memory.md): `leaderboard.py --paper`.

Every figure is computed from the paper-scale recipe that trains it, ``recipes/<size>/<method>.yaml``
(its optimizer, rank, factorization, density and precision, through `effpretrain.config.load_config`),
so the table and the recipes cannot disagree: a recipe whose rank does not give the published figure
shows a difference.

The benchmark's counting: 2 bytes x (weight elements + optimizer-state elements) in bf16, gradients
and activations not counted, GB = 1e9 bytes, vocabulary 32,000 (the benchmark's LLaMA configs). Our
estimate holds every state tensor's exact bytes (scalars included: AdamW's fp32 step, Stable-SPAM's
three fp32 EMAs, under 1 MB at 1B). Where the method's official code holds state that ours does not
(`Published.official_keeps_basis`), the comparison adds it, and the table shows what effpretrain
actually holds beside it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optimizers
from effpretrain.config import load_config
from effpretrain.errors import ConfigError
from effpretrain.memory import estimate_from_config, model_param_shapes, precision, projection_group
from effpretrain.models.factorized import FACTOR_KINDS
from effpretrain.models.llama import PRESETS
from optimizers import projection

#: The paper-scale recipes (a source checkout's recipes/ folder).
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
#: The four paper sizes, each a preset and a recipes/ folder.
PAPER_PRESETS = ("llama_60m", "llama_130m", "llama_350m", "llama_1b")

#: Where the published figures come from.
MINIMALIST = (
    "OptimAI-Lab/Minimalist_LLM_Pretraining README and arXiv 2506.16659 "
    "(the benchmark's authors, same setup as arXiv 2505.22922)"
)
BENCHMARK = "arXiv 2505.22922 (the benchmark, OptimAI-Lab/Memory_Efficient_Pretraining)"


@dataclass(frozen=True)
class Published:
    """One method's published bf16 weight + optimizer memory and how its source counted it.

    Attributes:
        gb: preset -> GB (1e9 bytes), for the sizes the source gives.
        source: where the figures come from.
        official_keeps_basis: the official code keeps the projection matrix P (min(m, n) x r per
            projected matrix, ``projection.basis_shape``) in its optimizer state, while ours
            regenerates it from a seed and stores none: the benchmark's count is ours plus P.
        note: how the published count differs from what the method's rule holds, where it does.
    """

    gb: Mapping[str, float]
    source: str
    official_keeps_basis: bool = False
    note: str = ""


def _sizes(*gb: float) -> dict[str, float]:
    return dict(zip(PAPER_PRESETS, gb, strict=True))


#: Published memory per recipe stem (the recipe's file name): the benchmark authors' table.
#: A method is printed once a method of that name is registered (with its recipes).
PUBLISHED: dict[str, Published] = {
    "adamw": Published(_sizes(0.35, 0.81, 2.21, 8.04), MINIMALIST),
    "stable_spam": Published(_sizes(0.35, 0.81, 2.21, 8.04), MINIMALIST),  # AdamW's state
    "muon": Published(
        _sizes(0.23, 0.54, 1.47, 5.36),
        MINIMALIST,
        note="published = twice the weights (one buffer per parameter); Muon as specified keeps "
        "AdamW's two moments for embeddings and head",
    ),
    "galore": Published(_sizes(0.28, 0.61, 1.59, 4.76), MINIMALIST),  # 350M: rank 384
    "fira": Published(_sizes(0.28, 0.61, 1.59, 4.76), MINIMALIST),
    "swan": Published(_sizes(0.25, 0.46, 1.00, 3.20), MINIMALIST),
    # apollo-torch's GradientProjector keeps ``ortho_matrix`` (P) on each parameter's state.
    "apollo": Published(_sizes(0.28, 0.61, 1.59, 4.76), MINIMALIST, official_keeps_basis=True),
    "apollo_mini": Published(_sizes(0.25, 0.46, 1.00, 3.20), MINIMALIST, official_keeps_basis=True),
    "scale": Published(_sizes(0.15, 0.32, 0.80, 2.81), MINIMALIST),
    "lowrank": Published({"llama_1b": 3.66}, BENCHMARK),  # rank 512
}


def _registered(name: str) -> bool:
    return name in optimizers.METHODS or name in FACTOR_KINDS


def published_methods() -> list[str]:
    """The `PUBLISHED` methods registered now (`optimizers.METHODS` or `FACTOR_KINDS`), in order."""
    return [name for name in PUBLISHED if _registered(name)]


def skipped_methods() -> list[str]:
    """One note per `PUBLISHED` method that is not registered (so not printed)."""
    return [
        f"{name}: published {' / '.join(f'{gb:.2f}' for gb in p.gb.values())} GB; "
        f"no method {name!r} is registered"
        for name, p in PUBLISHED.items()
        if not _registered(name)
    ]


def paper_methods(recipes_root: Path = RECIPES) -> list[str]:
    """`published_methods()`, then every other recipe stem of the paper folders, sorted."""
    first = published_methods()
    others = {p.stem for preset in PAPER_PRESETS for p in (recipes_root / preset).glob("*.yaml")}
    return first + sorted(others - set(first) - set(PUBLISHED))


def _rank(cfg: Any) -> int | str:
    """The rank the recipe trains at: the factor rank, or a projecting method's (fixed) rank."""

    if cfg.factor.kind != "none":
        return cfg.factor.rank
    if optimizers.method_spec(cfg.optim.name).projects:
        return projection_group(cfg.optim)["rank"]
    return "-"


def basis_bytes(cfg: Any) -> int:
    """Bytes of the projection matrices P of a projecting recipe's targets (0 for any other):
    ``prod(projection.basis_shape)`` elements per projected matrix, at the parameters' dtype."""

    spec = optimizers.method_spec(cfg.optim.name)
    if cfg.factor.kind != "none" or not spec.projects:
        return 0
    g = spec.cls.resolve_group(projection_group(cfg.optim))
    size = precision(cfg.train.precision).params.itemsize
    total = 0
    for s in model_param_shapes(cfg.model.preset):
        if s.linear in cfg.optim.targets:
            side = projection.choose_side(s.shape, g["proj_type"])
            total += math.prod(projection.basis_shape(s.shape, int(g["rank"]), side, g["basis"])) * size
    return total


def _estimate_row(row: dict[str, Any], path: Path, published: Published | None) -> None:
    """Fills `row`'s rank and byte counts from the recipe at `path` (an error note if it cannot)."""

    if not path.is_file():
        row["error"] = f"no recipe {row['recipe']}"
        return
    try:
        cfg = load_config(path)
        row["rank"] = _rank(cfg)
        est = estimate_from_config(cfg, PRESETS[cfg.model.preset].vocab)
        held = est.weights_plus_optimizer
        extra = basis_bytes(cfg) if published is not None and published.official_keeps_basis else 0
        if len(est.detail.get("phases", {})) > 1:  # a warm start: the peak phase is shown
            after = {k: v for k, v in est.detail["phases"].items() if k != est.detail["phase"]}
            row["phase_note"] = f"{est.detail['phase']} phase (the peak); " + ", ".join(
                f"{k}: {(p['weights'] + p['optimizer_state']) / 1e9:.3f}" for k, p in after.items()
            )
    except ConfigError as e:
        row["error"] = str(e).replace(str(path), row["recipe"])
        return
    except ImportError as e:  # a method whose backend is not installed here: n/a, go on
        row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        return
    row["held_bytes"], row["counted_bytes"] = held, held + extra
    row["held_gb"], row["gb"] = held / 1e9, (held + extra) / 1e9


def paper_memory_table(
    methods: Sequence[str] | None = None, recipes_root: Path = RECIPES
) -> list[dict[str, Any]]:
    """The estimate of every method (recipe stem) at every paper size, beside the published figure.

    Each row: ``method``, ``model``, ``recipe``, ``rank`` (the recipe's; "-" for a dense method),
    ``gb`` (the benchmark's counting, `counted_bytes` / 1e9), ``held_gb`` (what effpretrain holds,
    `held_bytes` / 1e9), ``paper_gb``, ``diff_gb`` = gb - paper_gb, ``source``; ``gb`` is None,
    with an ``error``, when the recipe is missing or does not load, or the method's backend cannot
    be imported.

    Args:
        methods: recipe stems, default `paper_methods(recipes_root)`.
        recipes_root: the folder holding ``<preset>/<method>.yaml``.
    """
    rows = []
    for method in paper_methods(recipes_root) if methods is None else methods:
        published = PUBLISHED.get(method)
        for preset in PAPER_PRESETS:
            paper = published.gb.get(preset) if published is not None else None
            row: dict[str, Any] = {
                "method": method,
                "model": preset,
                "recipe": f"recipes/{preset}/{method}.yaml",
                "rank": "-",
                "gb": None,
                "held_gb": None,
                "paper_gb": paper,
                "source": published.source if paper is not None else None,
                "published_note": published.note if published is not None else "",
            }
            _estimate_row(row, recipes_root / preset / f"{method}.yaml", published)
            row["diff_gb"] = row["gb"] - paper if row["gb"] is not None and paper is not None else None
            rows.append(row)
    return rows


def _gb(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _note(row: dict[str, Any]) -> str:
    if row.get("error"):
        return row["error"]
    extra = (row.get("counted_bytes") or 0) - (row.get("held_bytes") or 0)
    if extra:
        return f"official code keeps P (+{_decimal(extra)}); effpretrain regenerates it from a seed"
    return row.get("phase_note", "") or row.get("published_note", "")


def _decimal(n: int) -> str:
    """Bytes in decimal units, three significant figures (7.34 MB, 57.3 kB)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def format_paper_table(rows: Sequence[dict[str, Any]], skipped: Sequence[str] = ()) -> str:
    """Markdown: one line per method and size, the benchmark's count vs published, with the
    difference and what effpretrain holds; the sources and `skipped` notes below."""
    sources = list(dict.fromkeys(r["source"] for r in rows if r["source"]))
    lines = [
        "| method | model | rank | benchmark's count | published | difference | effpretrain holds "
        "| source | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        # round then add 0.0: a difference under half a MB prints as +0.000, not -0.000
        diff = f"{round(r['diff_gb'], 3) + 0.0:+.3f}" if r["diff_gb"] is not None else "-"
        src = f"[{sources.index(r['source']) + 1}]" if r["source"] else "-"
        gb = "n/a" if r["gb"] is None else _gb(r["gb"])
        lines.append(
            f"| {r['method']} | {r['model']} | {r['rank']} | {gb} | {_gb(r['paper_gb'], 2)} | {diff} "
            f"| {_gb(r['held_gb'])} | {src} | {_note(r)} |"
        )
    lines += [""] + [f"[{i}] {s}" for i, s in enumerate(sources, 1)]
    if skipped:
        lines += ["", "Not printed:"] + [f"- {s}" for s in skipped]
    return "\n".join(lines)

"""The plots of the final runs: memory against perplexity (with the Pareto front), validation curves, the memory breakdown."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leaderboard.collect import ResultRow, write_jsonl
from leaderboard.fmt import _Group, _groups, pareto_front
from leaderboard.render import render_markdown

# Plots


def plot_all(rows: Sequence[ResultRow], out: Path) -> list[str]:
    """Writes the three PNGs into `out` from the rows; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(rows)
    if not groups:
        return []
    methods = sorted({g.method for gs in groups.values() for g in gs})
    # tab20 plus a marker per block of 20 keeps every method distinguishable.
    style = _Style(
        colors={m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(methods)},
        markers={m: "os^Dv<>p"[(i // 20) % 8] for i, m in enumerate(methods)},
        methods=methods,
    )
    written = []
    for name, draw in (
        ("memory_vs_ppl.png", _memory_vs_ppl),
        ("val_curves.png", _val_curves),
        ("memory_breakdown.png", _memory_breakdown),
    ):
        fig = draw(plt, groups, style)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(name)
    return written


@dataclass(frozen=True)
class _Style:
    colors: dict[str, Any]
    markers: dict[str, str]
    methods: list[str]


def _memory_vs_ppl(plt: Any, groups: dict[str, list[_Group]], style: _Style) -> Any:
    """Memory vs perplexity, estimated and measured, with the Pareto front per model."""
    models, colors = list(groups), style.colors
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), squeeze=False)
    panels = (("estimated", "total", "estimated memory"), ("measured", "peak", "measured peak tensor memory"))
    for ax, (key, sub, title) in zip(axes[0], panels):
        for mi, model in enumerate(models):
            gs = [g for g in groups[model] if g.mean(key, sub) is not None]  # old rows: not measured
            if not gs:
                continue
            pts = [((g.mean(key, sub) or 0) / 1e6, g.ppl) for g in gs]
            labels: dict[tuple[float, float], list[str]] = {}
            for g, (x, y) in zip(gs, pts):
                ax.errorbar(x, y, yerr=g.ppl_std or 0, fmt="os^Dv"[mi % 5], color=colors[g.method], capsize=3)
                # Methods that land on the same point (e.g. variants whose periodic event never
                # fired) share one label instead of printing over each other.
                labels.setdefault((round(x, 1), round(y, 1)), []).append(g.method)
            for (x, y), names in labels.items():
                text = ", ".join(names) + (f" ({model})" if len(models) > 1 else "")
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
            front = [pts[i] for i in pareto_front(pts)]
            # A staircase: each front point is the best perplexity available up to the next one's memory.
            label = "Pareto front" if mi == 0 else None
            ax.step(*zip(*front), "--", where="post", color="grey", lw=1, label=label)
        ax.set(xlabel=f"{title} (MB)", ylabel="validation perplexity", title=f"{title} vs perplexity")
        ax.legend(loc="best", fontsize=8)
    return fig


def _val_curves(plt: Any, groups: dict[str, list[_Group]], style: _Style) -> Any:
    """Validation curves: mean over seeds at each token count, one panel per model."""
    models, colors, markers = list(groups), style.colors, style.markers
    fig, axes = plt.subplots(1, len(models), figsize=(8 * len(models), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for g in groups[model]:
            pts: dict[int, list[float]] = {}
            for r in g.rows:
                for tok, ppl in r.get("val_curve") or []:
                    pts.setdefault(int(tok), []).append(ppl)
            if pts:
                xs = sorted(pts)
                ys = [statistics.fmean(pts[x]) for x in xs]
                ax.plot(xs, ys, marker=markers[g.method], color=colors[g.method], label=g.method)
        ax.set(xlabel="tokens", ylabel="validation perplexity", title=f"{model}: validation perplexity")
        ax.set_yscale("log")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _memory_breakdown(plt: Any, groups: dict[str, list[_Group]], style: _Style) -> Any:
    """Estimated memory breakdown: stacked bars per method, one panel per model."""
    models, methods = list(groups), style.methods
    parts = (
        ("weights", "weights"),
        ("grads", "gradients"),
        ("optimizer_state", "optimizer state"),
        ("activations", "activations"),
    )
    width = min(14.0, max(6.0, 0.6 * len(methods) + 2))
    fig, axes = plt.subplots(1, len(models), figsize=(width * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        gs = sorted(groups[model], key=lambda g: g.method)
        bottom = [0.0] * len(gs)
        for key, label in parts:
            vals = [(g.mean("estimated", key) or 0) / 1e6 for g in gs]
            ax.bar([g.method for g in gs], vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set(ylabel="MB (estimated)", title=f"{model}: estimated memory breakdown")
        ax.tick_params(axis="x", rotation=40, labelsize=8)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def publish(rows: Sequence[ResultRow], out: Path, plots: bool = True) -> None:
    """Writes results.jsonl, the plots and LEADERBOARD.md into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(rows, out / "results.jsonl")
    names = plot_all(rows, out) if plots else []
    (out / "LEADERBOARD.md").write_text(render_markdown(rows, plots=names))

"""Cell formatting and grouping of result rows by method (mean and spread over seeds)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from leaderboard.collect import ResultRow

# Rendering: a pure function of the rows


def _sig3(x: float) -> str:
    """Three significant figures with trailing zeros kept (11.0, 1.50, 262), so columns line up."""
    a = abs(x)
    decimals = 2 if a < 10 else 1 if a < 100 else 0
    text = f"{x:.{decimals}f}"
    # Rounding can carry into the next decade (9.999 -> 10.00): format again at its own width.
    return _sig3(float(text)) if decimals and abs(float(text)) >= (10 if decimals == 2 else 100) else text


def fmt_bytes(n: float | None) -> str:
    """Decimal units (the paper's GB = 1e9 bytes), three significant figures."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale * 0.9995:  # what rounds to 1000 of a unit is shown as 1.00 of the next
            return f"{_sig3(n / scale)} {unit}"
    return f"{n:.0f} B"


def fmt_count(x: float | None) -> str:
    """FLOPs and the like: three significant figures with a K/M/G/T suffix."""
    if x is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale * 0.9995:
            return f"{_sig3(x / scale)} {unit}"
    return _sig3(x)


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return ""
    return f" ({value / base:.2f}x)"


def _mean(xs: Iterable[float | None]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def _finite_ppl(r: ResultRow) -> bool:
    v = r.get("final_val_ppl")
    return isinstance(v, (int, float)) and math.isfinite(v)


def _is_ok(r: ResultRow) -> bool:
    """A finished run with a finite final perplexity (a diverged run is listed with the failures)."""
    return r.get("status") == "ok" and _finite_ppl(r)


def _phase(r: ResultRow) -> str:
    return r.get("phase") or "final"


@dataclass
class _Group:
    """The final runs of one (model, method) over seeds, reduced to what the table shows."""

    model: str
    method: str
    rows: list[ResultRow]

    def mean(self, key: str, sub: str | None = None) -> float | None:
        return _mean((r.get(key) or {}).get(sub) if sub else r.get(key) for r in self.rows)

    @property
    def ppl(self) -> float:
        return statistics.fmean(r["final_val_ppl"] for r in self.rows)

    @property
    def ppl_std(self) -> float | None:
        vals = [r["final_val_ppl"] for r in self.rows]
        return statistics.stdev(vals) if len(vals) > 1 else None

    @property
    def spread(self) -> float:
        """The seed spread used by `compare`: the sample standard deviation, 0 for one seed."""
        return self.ppl_std or 0.0

    def ppl_text(self) -> str:
        sd = f" ± {self.ppl_std:.2f}" if self.ppl_std is not None else ""
        return f"{self.ppl:.2f}{sd} (n={len(self.rows)})"

    @property
    def low_memory(self) -> bool:
        """Low-rank or projected: a factorized model, or an optimizer that projects (optim_rank)."""
        return any(
            r.get("factor") not in (None, "none") or r.get("optim_rank") is not None for r in self.rows
        )


def _groups(rows: Sequence[ResultRow]) -> dict[str, list[_Group]]:
    """Final, finished runs grouped by model, then by method; models ordered by size, methods by
    perplexity."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if _is_ok(r) and _phase(r) == "final":
            by.setdefault((r["model"], r["method"]), []).append(r)
    models: dict[str, list[_Group]] = {}
    for (model, method), rs in sorted(by.items()):
        models.setdefault(model, []).append(_Group(model, method, sorted(rs, key=lambda r: r["run"])))
    size = {m: min(r.get("params") or 0 for g in gs for r in g.rows) for m, gs in models.items()}
    return {
        m: sorted(models[m], key=lambda g: (g.ppl, g.method))
        for m in sorted(models, key=lambda m: (size[m], m))
    }


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower is better on both), by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front

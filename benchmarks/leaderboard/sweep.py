"""The learning-rate sweep: the choice per method (a pure function of the sweep rows) and its table."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from leaderboard.collect import ResultRow
from leaderboard.fmt import _is_ok, _phase

# Learning-rate sweep: the choice is a pure function of the sweep rows


@dataclass(frozen=True)
class LrChoice:
    """The sweep of one (model, method): every lr tried with its perplexity (None: the run failed or
    diverged; several seeds are averaged), and the chosen lr (None when no run finished)."""

    model: str
    method: str
    trials: tuple[tuple[float, float | None], ...]  # (lr, mean final val ppl), by lr
    lr: float | None
    ppl: float | None

    @property
    def edge(self) -> str | None:
        """ "lowest" / "highest" when the chosen lr is at that end of the grid (widen it), else None."""
        lrs = [lr for lr, _ in self.trials]
        if self.lr is None:
            return None
        return "lowest" if self.lr == min(lrs) else "highest" if self.lr == max(lrs) else None


def select_lrs(rows: Iterable[ResultRow]) -> dict[tuple[str, str], LrChoice]:
    """The best learning rate per (model, method) from its sweep rows (``phase: "sweep"``): the
    lowest mean final validation perplexity over the lr's finished runs, ties to the smaller lr."""
    by: dict[tuple[str, str], dict[float, list[float]]] = {}
    for r in rows:
        if _phase(r) != "sweep" or r.get("lr") is None:
            continue
        trials = by.setdefault((r["model"], r["method"]), {})
        trials.setdefault(float(r["lr"]), [])
        if _is_ok(r):
            trials[float(r["lr"])].append(float(r["final_val_ppl"]))
    out = {}
    for key, trials in sorted(by.items()):
        pairs = tuple((lr, statistics.fmean(v) if v else None) for lr, v in sorted(trials.items()))
        done = [(ppl, lr) for lr, ppl in pairs if ppl is not None]
        best = min(done) if done else (None, None)
        out[key] = LrChoice(key[0], key[1], pairs, best[1], best[0])
    return out


def fmt_lr(lr: float | None) -> str:
    return "-" if lr is None else f"{lr:.3g}"


def _sweep_section(rows: Sequence[ResultRow], model: str) -> list[str]:
    choices = [c for c in select_lrs(rows).values() if c.model == model]
    if not choices:
        return []
    out = [
        f"### {model}: learning-rate sweep",
        "",
        "Final validation perplexity of each lr on the sweep budget; the chosen lr (**bold**, the lowest"
        " perplexity, ties to the smaller lr) is the one the final runs train with.",
        "",
        "| method | lr: val ppl | chosen lr | note |",
        "|---|---|---|---|",
    ]
    for c in sorted(choices, key=lambda c: c.method):
        cells = []
        for lr, ppl in c.trials:
            text = f"{fmt_lr(lr)}: {'failed' if ppl is None else f'{ppl:.2f}'}"
            cells.append(f"**{text}**" if lr == c.lr else text)
        notes = []
        if c.edge:
            notes.append(f"edge of grid ({c.edge} lr): widen it")
        failed = sum(ppl is None for _, ppl in c.trials)
        if failed:
            notes.append(f"{failed} failed or diverged")
        if c.lr is None:
            notes.append("no finished run: no final runs")
        out.append(f"| {c.method} | {'; '.join(cells)} | {fmt_lr(c.lr)} | {', '.join(notes) or '-'} |")
    return out + [""]

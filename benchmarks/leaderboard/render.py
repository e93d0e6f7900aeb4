"""LEADERBOARD.md: a pure function of the result rows."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from leaderboard.claims import _claims_section, compare
from leaderboard.collect import MEASURED_KEYS, ResultRow
from leaderboard.common import BASELINE, MIN_STEPS, MIN_TOKENS_PER_STEP, PLOTS
from leaderboard.fmt import _Group, _groups, _is_ok, _mean, _phase, _ratio, _sig3, fmt_bytes, fmt_count
from leaderboard.sweep import _sweep_section, fmt_lr

# The markdown


def _refresh_cell(g: _Group) -> str:
    """Refresh/restart counts, and the time they took as a share of optimizer time when the
    telemetry has it (opt/step_s), else of training time (tokens / tokens_per_s)."""
    tel = [r.get("telemetry") or {} for r in g.rows]
    parts = []
    refreshes = _mean(t.get("opt/refreshes") for t in tel)
    restarts = _mean(t.get("opt/restarts") for t in tel)
    spent = [(t.get("opt/refresh_s") or 0.0) + (r.get("restart_s") or 0.0) for t, r in zip(tel, g.rows)]
    timed = any("opt/refresh_s" in t for t in tel) or any(r.get("restart_s") is not None for r in g.rows)
    if refreshes is not None:
        parts.append(f"{refreshes:.0f} refreshes")
    if restarts is not None:
        parts.append(f"{restarts:.0f} restarts")
    if not parts:
        return "-"
    if timed:
        if all("opt/step_s" in t for t in tel):
            base, what = sum(t["opt/step_s"] for t in tel), "opt"
        else:
            base, what = sum(r.get("train_s") or 0.0 for r in g.rows), "train"
        share = f", {100 * sum(spent) / base:.1f}% of {what}" if base else ""
        parts.append(f"{statistics.fmean(spent):.2f} s{share}")
    return ", ".join(parts)


def _time_cell(g: _Group) -> str:
    """Mean seconds in training steps / evaluation / basis refreshes / restarts ("-": not recorded)."""
    vals = [
        g.mean("train_s"),
        g.mean("eval_s"),
        _mean((r.get("telemetry") or {}).get("opt/refresh_s") for r in g.rows),
        g.mean("restart_s"),
    ]
    return " / ".join("-" if v is None else _sig3(v) for v in vals)


def _serial_cell(g: _Group) -> str:
    serial = [r.get("serial") for r in g.rows if r.get("serial") is not None]
    if not serial:
        return "-"
    s = serial[0]
    return f"{s['per_update']:.3g}" + (f" ({s['detail']})" if s.get("detail") else "")


def _versus_cell(g: _Group, base: _Group | None) -> str:
    if base is None or g is base:
        return "-"
    diff, _, within = compare(g, base)
    return f"{diff:+.2f}" + (" (within noise)" if within else "")


# Set per run by the grid itself (budget, eval points, seed, lr): not worth repeating in the header.
_GRID_KEYS = ("train.max_steps", "train.eval_every", "train.save_every", "train.seed", "optim.lr")


def _common_overrides(rows: Sequence[ResultRow]) -> list[str]:
    """The user's --set overrides shared by every row, in the first row's order."""
    lists = [[o for o in r.get("overrides") or [] if not o.startswith(_GRID_KEYS)] for r in rows]
    return [o for o in lists[0] if all(o in other for other in lists[1:])] if lists else []


def _budget_lines(rows: Sequence[ResultRow]) -> list[str]:
    """Per phase: tokens per step, steps and tokens per run, seeds; and the floors they miss."""
    out, warn = [], []
    for phase in ("sweep", "final"):
        rs = [r for r in rows if _is_ok(r) and _phase(r) == phase and r.get("steps")]
        if not rs:
            continue
        per_step = sorted({int(r["tokens"]) // int(r["steps"]) for r in rs})
        steps = sorted({int(r["steps"]) for r in rs})
        tokens = sorted({int(r["tokens"]) for r in rs})
        budgets = sorted({int(r["token_budget"]) for r in rs if r.get("token_budget")})
        seeds = sorted({r["seed"] for r in rs if r.get("seed") is not None})
        out.append(
            f"- {phase.capitalize()} runs: {', '.join(f'{t:,}' for t in per_step)} tokens per step x"
            f" {', '.join(map(str, steps))} steps = {', '.join(f'{t:,}' for t in tokens)} tokens per run"
            f" (budget {', '.join(f'{b:,}' for b in budgets) or '-'}, equal for every method);"
            f" seeds {', '.join(map(str, seeds)) or '-'}"
        )
        low = [t for t in per_step if t < MIN_TOKENS_PER_STEP]
        if low:
            warn.append(
                f"{phase} runs train {', '.join(f'{t:,}' for t in low)} tokens per step (floor {MIN_TOKENS_PER_STEP:,})"
            )
        short = [s for s in steps if s < MIN_STEPS]
        if short and phase == "final":
            warn.append(f"final runs take {', '.join(map(str, short))} steps (floor {MIN_STEPS})")
    out += [
        f"- **Warning: below the budget floor**: {w}; rankings this short reflect warm-up and noise"
        for w in warn
    ]
    return out


def _header(rows: Sequence[ResultRow], ok: Sequence[ResultRow], bad: Sequence[dict[str, Any]]) -> list[str]:
    hardware = sorted({r.get("hardware") or "unknown" for r in rows})
    commits = sorted({r.get("git_commit") or "unknown" for r in ok})
    dates = sorted(r["date"] for r in rows if r.get("date"))
    final = [r for r in ok if _phase(r) == "final"]
    out = ["# effpretrain leaderboard", ""]
    out.append(f"- Hardware: {'; '.join(hardware) or 'unknown'}")
    out += _budget_lines(rows)
    out.append(
        f"- Runs: {len(final)} final and {len(ok) - len(final)} sweep runs finished, {len(bad)} failed"
    )
    common = _common_overrides(ok)
    if common:
        out.append(f"- Overrides on every run: {' '.join(f'`{o}`' for o in common)}")
    out.append(
        f"- Commit: {', '.join(commits) or '-'}; dates: {dates[0] + ' .. ' + dates[-1] if dates else '-'}"
    )
    return out + [""]


def _ranked_cells(rank: int, g: _Group, base: _Group | None) -> list[str]:
    """The first cells of a ranked row: rank, method, lr(s), perplexity over seeds, vs baseline."""
    lrs = sorted({r["lr"] for r in g.rows if r.get("lr") is not None})
    return [
        str(rank),
        g.method,
        ", ".join(fmt_lr(lr) for lr in lrs) or "-",
        g.ppl_text(),
        _versus_cell(g, base),
    ]


def _model_table(model: str, groups: Sequence[_Group], baseline: str) -> list[str]:
    base = next((g for g in groups if g.method == baseline), None)

    def rel(g: _Group, key: str, sub: str | None = None) -> str:
        v = g.mean(key, sub)
        text = fmt_bytes(v) if key != "tokens_per_s" else ("-" if v is None else f"{v:,.0f}")
        return text + _ratio(v, base.mean(key, sub) if base else None)

    versus = f"{baseline} on {model}" if base else f"nothing (no {baseline} run)"
    out = [
        f"## {model}",
        "",
        f"Final runs, ranked by mean validation perplexity. Ratios are relative to {versus}.",
        "",
    ]
    out.append(
        f"| # | method | lr | val ppl | vs {baseline} | peak tensor memory | optimizer state "
        "| weights / grads / activations / temporaries | est. memory | tokens/s "
        "| time (s): train / eval / refresh / restart | FLOPs/token | serial calls/update | refreshes / restarts |"
    )
    out.append("|" + "---|" * 14)
    for rank, g in enumerate(groups, 1):
        cells = [
            *_ranked_cells(rank, g, base),
            rel(g, "measured", "peak"),
            rel(g, "measured", "optimizer_state"),
            " / ".join(fmt_bytes(g.mean("measured", k)) for k in MEASURED_KEYS[:2] + MEASURED_KEYS[3:5]),
            rel(g, "estimated", "total"),
            rel(g, "tokens_per_s"),
            _time_cell(g),
            fmt_count(g.mean("flops_per_token")),
            _serial_cell(g),
            _refresh_cell(g),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out + [""]


COLUMN_NOTES = [
    "- **lr**: the peak learning rate of the final runs (the sweep's choice when there was a sweep).",
    "- **val ppl**: final validation perplexity, mean ± sample standard deviation over seeds (n runs).",
    "- **vs adamw**: the mean perplexity minus the baseline's; `(within noise)` by the rule of the claims"
    " section.",
    "- **peak tensor memory**, **optimizer state** and **weights / grads / activations / temporaries**:"
    " measured on the run's measured steps (`train.memory_steps`, `effpretrain.memory_measure`), the"
    " largest over them: live tensor bytes at the step's peak (CUDA's allocator on GPU, tensor"
    " accounting on CPU: the Python/torch runtime is not counted), the optimizer's state tensors, the"
    " weights and gradients, what autograd saves for backward, and the rest of the peak; `-` for runs"
    " recorded before these were measured.",
    "- **est. memory**: the analytic estimate (`effpretrain.memory.estimate`) of weights + gradients +"
    " optimizer state + activations at the run's batch, sequence length and precision.",
    "- **tokens/s**: training throughput (tokens / time in training steps, evaluation excluded); runs"
    " that ran side by side (`--jobs`) shared the cores, so ratios mean most on an otherwise idle machine.",
    "- **time**: mean seconds in training steps, in evaluation, in basis refreshes (part of the"
    " training steps) and in restarts (refactorization + momentum reset, also part of them); `-`: not"
    " recorded.",
    "- **FLOPs/token**: analytic training FLOPs of the matrix multiplies (6 per weight for dense"
    " layers, the factorized layers' own cost, 12 L h T for attention; see `flops_per_token`).",
    "- **serial calls/update**: sequential decompositions (QR, SVD, eigh, LU, Newton-Schulz iterations)"
    " one weight matrix's update waits on, amortised over refresh and restart periods (`serial_cost`).",
    "- **refreshes / restarts**: basis refreshes (GaLore-family) and restarts (refactorization + momentum"
    " reset) from the runs' telemetry, and the time they took as a share of optimizer time (`opt`) when"
    " recorded, else of training time (`train`); `-` where the method has none.",
    "- `(0.52x)`: the value divided by the same model's baseline value.",
    "",
]


def render_markdown(rows: Sequence[ResultRow], baseline: str = BASELINE, plots: Iterable[str] = ()) -> str:
    """LEADERBOARD.md from results rows: deterministic for the same rows (sorted, fixed formats).

    Sections: the header (hardware, budgets per phase and the floors they miss, commits), per
    model the ranked table of final runs and its learning-rate sweep, the claims (`CLAIMS`,
    `evaluate_claims`), the failed runs, column notes and the plots.

    Args:
        rows: results.jsonl rows (`collect_run`'s format).
        baseline: the method every ratio and difference is relative to, per model.
        plots: image file names (relative to the markdown) to embed at the end.
    """
    ok = [r for r in rows if _is_ok(r)]
    bad = sorted((r for r in rows if not _is_ok(r)), key=lambda r: r["run"])
    out = _header(rows, ok, bad)
    groups = _groups(ok)
    for model in list(groups) + sorted({r["model"] for r in ok if r.get("model") not in groups}):
        if model in groups:
            out += _model_table(model, groups[model], baseline)
        out += _sweep_section(rows, model)
    out += _claims_section(ok)
    if bad:
        out += ["## Failed runs", "", "| run | status | error |", "|---|---|---|"]
        for r in bad:
            status = r.get("status") if r.get("status") != "ok" else "diverged"
            err = (r.get("error") or "").splitlines()[0] if r.get("error") else ""
            if status == "diverged":
                err = f"final val ppl {r.get('final_val_ppl')}"
            out.append(f"| {r['run']} | {status} | {err.replace('|', '/')} |")
        out.append("")
    out += ["Columns:", "", *COLUMN_NOTES]
    for name in plots:
        out += [f"![{PLOTS.get(name, name)}]({name})", ""]
    return "\n".join(out)

"""The benchmark's claims, checked against the final runs: reproduced, not reproduced, within noise, not measured."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from leaderboard.collect import ResultRow
from leaderboard.fmt import _Group, _groups, fmt_bytes, pareto_front

# Seeds and claims: comparisons with the seed spread, verdicts from the rows alone

#: The "within noise" rule of every comparison (stated in LEADERBOARD.md).
NOISE_RULE = (
    "two methods differ within noise when |mean_a - mean_b| <= max(sd_a, sd_b), sd the sample standard"
    " deviation of a method's final perplexity over its seeds (0 for a single seed, whose spread is unknown)"
)
VERDICTS = ("reproduced", "not reproduced", "within noise", "not measured")


def compare(a: _Group, b: _Group) -> tuple[float, float, bool]:
    """(mean_a - mean_b, noise = max(sd_a, sd_b), within noise) for the final perplexities."""
    diff, noise = a.ppl - b.ppl, max(a.spread, b.spread)
    return diff, noise, abs(diff) <= noise


@dataclass(frozen=True)
class Claim:
    """One of the benchmark's claims, as data: the renderer and the tests read `CLAIMS`.

    Attributes:
        key: short name.
        statement: the claim in words.
        kind: "best" (the best of `methods` has a lower mean perplexity than every other method),
            "below" (in every pair (a, b) of `pairs`, a's mean perplexity is below b's) or "pareto"
            (every one of `methods` and at least one low-rank/projected method lie on the
            (measured peak memory, perplexity) Pareto front).
        methods: see `kind`; for "best" the first one must have been run.
        pairs: see `kind`.
    """

    key: str
    statement: str
    kind: str
    methods: tuple[str, ...] = ()
    pairs: tuple[tuple[str, str], ...] = ()


CLAIMS: tuple[Claim, ...] = (
    Claim(
        "full_rank_best",
        "Tuned full-rank training is the best: full-rank AdamW (or Stable-SPAM) has the lowest perplexity",
        "best",
        methods=("adamw", "stable_spam"),
    ),
    Claim(
        "fira_apollo_over_galore",
        "Fira and APOLLO reach a lower perplexity than GaLore at equal memory",
        "below",
        pairs=(("fira", "galore"), ("apollo", "galore")),
    ),
    Claim(
        "lowrank_restarts",
        "Low-Rank + weight refactorization + momentum reset beats Low-Rank",
        "below",
        pairs=(("lowrank_restarts", "lowrank"),),
    ),
    Claim(
        "sltrain_restarts",
        "SLTrain + restarts beats SLTrain",
        "below",
        pairs=(("sltrain_restarts", "sltrain"),),
    ),
    Claim(
        "pareto",
        "The memory Pareto front holds low-rank/projected methods and full-rank AdamW",
        "pareto",
        methods=("adamw",),
    ),
)


def _verdict(diff: float, within: bool) -> str:
    """For "a below b" with diff = mean_a - mean_b."""
    return "within noise" if within else "reproduced" if diff < 0 else "not reproduced"


def _combine(verdicts: Sequence[str]) -> str:
    if "not reproduced" in verdicts:
        return "not reproduced"
    return "reproduced" if all(v == "reproduced" for v in verdicts) else "within noise"


def _claim_best(claim: Claim, by: dict[str, _Group]) -> tuple[str, str]:
    ours = [by[m] for m in claim.methods if m in by]
    others = [g for m, g in by.items() if m not in claim.methods]
    if claim.methods[0] not in by or not others:
        return "not measured", f"needs {claim.methods[0]} and another method"
    a, b = min(ours, key=lambda g: (g.ppl, g.method)), min(others, key=lambda g: (g.ppl, g.method))
    diff, noise, within = compare(a, b)
    return _verdict(diff, within), (
        f"best of {'/'.join(claim.methods)}: {a.method} {a.ppl_text()}; best other: {b.method} {b.ppl_text()};"
        f" difference {diff:+.2f}, noise {noise:.2f}"
    )


def _claim_below(claim: Claim, by: dict[str, _Group]) -> tuple[str, str]:
    missing = sorted({m for pair in claim.pairs for m in pair} - set(by))
    if missing:
        return "not measured", f"no finished runs of {', '.join(missing)}"
    verdicts, evidence = [], []
    for a, b in claim.pairs:
        diff, noise, within = compare(by[a], by[b])
        verdicts.append(_verdict(diff, within))
        evidence.append(
            f"{a} {by[a].ppl_text()} vs {b} {by[b].ppl_text()}: difference {diff:+.2f}, noise {noise:.2f}"
            f" ({verdicts[-1]})"
        )
    return _combine(verdicts), "; ".join(evidence)


def _claim_pareto(claim: Claim, groups: Sequence[_Group]) -> tuple[str, str]:
    gs = [g for g in groups if g.mean("measured", "peak") is not None]
    names = {g.method for g in gs}
    low = [g for g in gs if g.low_memory]
    if not set(claim.methods) <= names or not low:
        return (
            "not measured",
            f"needs measured memory of {', '.join(claim.methods)} and a low-rank/projected method",
        )
    pts = [(g.mean("measured", "peak") or 0.0, g.ppl) for g in gs]
    front = {gs[i].method for i in pareto_front(pts)}

    def status(g: _Group) -> str:
        if g.method in front:
            return "reproduced"
        mem = g.mean("measured", "peak") or 0.0
        beaten = [
            h
            for h in gs
            if (h.mean("measured", "peak") or 0.0) <= mem and h.ppl < g.ppl - max(g.spread, h.spread)
        ]
        return "not reproduced" if beaten else "within noise"

    need = [status(next(g for g in gs if g.method == m)) for m in claim.methods]
    low_status = sorted((status(g) for g in low), key=VERDICTS.index)[0]
    shown = sorted((g for g in gs if g.method in front), key=lambda g: g.mean("measured", "peak") or 0.0)
    evidence = "front (measured peak memory, ppl): " + ", ".join(
        f"{g.method} ({fmt_bytes(g.mean('measured', 'peak'))}, {g.ppl:.2f})" for g in shown
    )
    where = {
        "reproduced": "on the front",
        "within noise": "off it within noise",
        "not reproduced": "dominated",
    }
    evidence += "; " + ", ".join(f"{m}: {where[v]}" for m, v in zip(claim.methods, need))
    evidence += f"; low-rank/projected on the front: {', '.join(sorted(g.method for g in low if g.method in front)) or 'none'}"
    return _combine([*need, low_status]), evidence


def evaluate_claims(rows: Sequence[ResultRow], claims: Sequence[Claim] = CLAIMS) -> list[dict[str, str]]:
    """Every claim's verdict (`VERDICTS`) and evidence per model, from the final runs alone.

    Returns:
        ``{"model", "claim", "statement", "verdict", "evidence"}`` per model and claim, in
        `claims` order within each model.
    """
    out = []
    for model, groups in _groups(rows).items():
        by = {g.method: g for g in groups}
        for c in claims:
            if c.kind == "best":
                verdict, evidence = _claim_best(c, by)
            elif c.kind == "below":
                verdict, evidence = _claim_below(c, by)
            elif c.kind == "pareto":
                verdict, evidence = _claim_pareto(c, groups)
            else:
                raise ValueError(f"claim {c.key}: unknown kind {c.kind!r}")
            out.append(
                {
                    "model": model,
                    "claim": c.key,
                    "statement": c.statement,
                    "verdict": verdict,
                    "evidence": evidence,
                }
            )
    return out


def _claims_section(rows: Sequence[ResultRow]) -> list[str]:
    results = evaluate_claims(rows)
    if not results:
        return []
    out = [
        "## Claims",
        "",
        "The benchmark's claims checked against the final runs above, generated from the rows (`CLAIMS` in"
        f" benchmarks/leaderboard.py): lower perplexity is better; {NOISE_RULE}.",
        "",
    ]
    return out + _claim_table(results)


def _claim_table(claims: Sequence[dict[str, str]]) -> list[str]:
    """The claims table, one row per `evaluate_claims` result (model, statement, verdict, evidence),
    and a blank line."""
    out = ["| model | claim | verdict | numbers |", "|---|---|---|---|"]
    out += [f"| {c['model']} | {c['statement']} | **{c['verdict']}** | {c['evidence']} |" for c in claims]
    return out + [""]

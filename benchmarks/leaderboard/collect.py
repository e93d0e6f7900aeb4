"""Collecting the runs into result rows (results.jsonl): summary, curves, telemetry, budgets, provenance."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypedDict

from leaderboard.common import BASELINE, ERROR_FILE, RUN_RECORD, TELEMETRY_KEYS, TIMING_FILE

# Collecting: one results row per run


def cpu_description() -> str:
    """CPU model name and core count (`effpretrain.reporting.cpu_description`, imported late: this
    script keeps the toolkit out of its start-up)."""
    from effpretrain.reporting import cpu_description as describe

    return describe()


def _vocab_size(summary: dict[str, Any], cfg: Any) -> int:
    """The trained vocabulary: summary.json's ``vocab_size``; for a run from before it was
    recorded, from the parameter count (only embedding and head depend on it)."""
    if "vocab_size" in summary:
        return int(summary["vocab_size"])
    from effpretrain.memory import estimate
    from effpretrain.models.llama import PRESETS

    f = cfg.factor
    one = estimate(
        cfg.model.preset,
        BASELINE,  # any method: parameter counts do not depend on it
        vocab_size=1,
        factor_kind=f.kind,
        factor_rank=f.rank,
        density=f.density,
        factor_targets=f.targets,
    ).params
    h = PRESETS[cfg.model.preset].hidden
    v, rem = divmod(int(summary["params"]) - one, 2 * h)
    return v + 1 if rem == 0 else int(cfg.data.vocab_size)


def read_metrics(path: Path) -> tuple[list[list[float]], dict[str, float]]:
    """The validation curve [[tokens, val_ppl], ...] (one point per step, the last one logged
    wins after a resume) and the last optimizer telemetry found in a metrics.jsonl."""
    curve: dict[int, list[float]] = {}
    telemetry: dict[str, float] = {}
    if not path.is_file():
        return [], telemetry
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if rec.get("event") == "eval" and "val_ppl" in rec:
            curve[int(rec["step"])] = [int(rec.get("tokens", 0)), float(rec["val_ppl"])]
        for k in TELEMETRY_KEYS:
            if k in rec:
                telemetry[k] = rec[k]
    return [curve[s] for s in sorted(curve)], telemetry


# Copied from summary.json into each results row as they are.
_SUMMARY_KEYS = tuple(
    "method optimizer factor model params trainable_params steps tokens final_val_loss final_val_ppl "
    "tokens_per_s wall_s peak_memory_bytes optimizer_state_bytes weight_bytes grad_bytes device "
    "world_size precision torch transformers git_commit config_hash".split()
)


# summary.json's measured memory (`memory_measured.max`, effpretrain.memory_measure), bytes per
# category; runs written before it have none (shown as "-").
MEASURED_KEYS = ("weights", "gradients", "optimizer_state", "activations", "temporaries", "peak")


class ResultRow(TypedDict, total=False):
    """One line of results.jsonl: a run's plan, its outcome and its provenance (`collect_run`).
    Every step reads rows through these keys; a run that failed has the plan's keys, ``status``
    and ``error`` only."""

    run: str  # the run folder's name
    method: str | None
    model: str | None
    seed: int | None
    recipe: str | None
    token_budget: int | None
    config_hash: str | None
    overrides: list[str]
    cpu: str
    phase: str  # "final" or "sweep"
    lr: float | None
    lr_label: str | None  # the sweep point ("x0.5", or an absolute value)
    status: str  # "ok", "error" or "incomplete"
    error: str
    hardware: str
    date: str
    # From summary.json (`_SUMMARY_KEYS`):
    optimizer: str
    factor: str
    params: int
    trainable_params: int
    steps: int
    tokens: int
    final_val_loss: float
    final_val_ppl: float
    tokens_per_s: float
    wall_s: float
    peak_memory_bytes: int
    optimizer_state_bytes: int
    weight_bytes: int
    grad_bytes: int
    device: str
    world_size: int
    precision: str
    torch: str
    transformers: str
    git_commit: str
    estimated: dict[str, int | None]
    measured: dict[str, int | None]  # `MEASURED_KEYS`
    telemetry: dict[str, float]  # `TELEMETRY_KEYS`
    eval_s: float | None
    restart_s: float | None
    val_curve: list[list[float]]  # [[tokens, val_ppl], ...]
    train_s: float | None
    # From the run's config.yaml:
    seq_len: int
    serial: dict[str, Any]  # `serial_cost`
    factor_rank: int | None
    optim_rank: int | None
    flops_per_token: float


def collect_run(run_dir: Path) -> ResultRow | None:
    """The results row of one run folder (None if it holds no leaderboard record and no summary)."""
    spec = json.loads((run_dir / RUN_RECORD).read_text()) if (run_dir / RUN_RECORD).is_file() else {}
    summary_path = run_dir / "summary.json"
    if not spec and not summary_path.is_file():
        return None
    row = _planned(run_dir, spec)
    if not summary_path.is_file():
        err = run_dir / ERROR_FILE
        row["status"] = "error" if err.is_file() else "incomplete"
        row["error"] = err.read_text().strip() if err.is_file() else "no summary.json (interrupted?)"
        row["hardware"] = row["cpu"]
        row["date"] = _mtime_iso(err if err.is_file() else run_dir)
        return row
    summary = json.loads(summary_path.read_text())
    if summary.get("final_val_ppl") is None:
        row.update(status="error", error="summary.json has no final_val_ppl", hardware=row["cpu"])
        row["date"] = _mtime_iso(summary_path)
        return row
    _add_outcome(row, run_dir, summary)
    row["date"] = _mtime_iso(summary_path)
    cfg_path = run_dir / "config.yaml"
    if cfg_path.is_file():
        _add_config(row, cfg_path, summary)
    return row


def _planned(run_dir: Path, spec: dict[str, Any]) -> ResultRow:
    """The plan's keys, from the run's leaderboard record."""
    return {
        "run": run_dir.name,
        "method": spec.get("method"),
        "model": spec.get("model"),
        "seed": spec.get("seed"),
        "recipe": spec.get("recipe"),
        "token_budget": spec.get("token_budget"),
        "config_hash": spec.get("config_hash"),
        "overrides": list(spec.get("overrides") or []),
        "cpu": spec.get("cpu") or cpu_description(),
        "phase": spec.get("phase") or "final",
        "lr": spec.get("lr"),
        "lr_label": spec.get("lr_label"),
    }


def _add_outcome(row: ResultRow, run_dir: Path, summary: dict[str, Any]) -> None:
    """A finished run's summary, measured memory, telemetry, timing and validation curve."""
    row.update({k: summary.get(k) for k in _SUMMARY_KEYS if k in summary})  # type: ignore[typeddict-item]
    row["status"] = "ok"
    row["seed"] = row["seed"] if row["seed"] is not None else summary.get("seed")
    row["token_budget"] = row["token_budget"] or summary.get("tokens")
    est = summary.get("estimated", {})
    row["estimated"] = {
        k: est.get(k) for k in ("weights", "grads", "optimizer_state", "activations", "total")
    }
    measured = (summary.get("memory_measured") or {}).get("max")
    if measured:
        row["measured"] = {k: measured.get(k) for k in MEASURED_KEYS}
    device = str(summary.get("device", ""))
    row["hardware"] = row["cpu"] if device.startswith("cpu") or not device else device
    curve, telemetry = read_metrics(run_dir / "metrics.jsonl")
    telemetry.update({k: summary[k] for k in TELEMETRY_KEYS if k in summary})
    row["telemetry"] = telemetry
    if (run_dir / TIMING_FILE).is_file():
        timing = json.loads((run_dir / TIMING_FILE).read_text())
        row["eval_s"] = timing.get("eval_s")
        if "opt/restarts" in telemetry:  # a run without restarts has no restart time, not 0 s
            row["restart_s"] = timing.get("restart_s")
    row["val_curve"] = curve
    row["train_s"] = summary["tokens"] / summary["tokens_per_s"] if summary.get("tokens_per_s") else None


def _add_config(row: ResultRow, cfg_path: Path, summary: dict[str, Any]) -> None:
    """What the run's resolved config says: sequence length, lr, serial cost, ranks, FLOPs/token."""
    import yaml

    from effpretrain.config import from_dict
    from effpretrain.flops import flops_per_token

    cfg = from_dict(yaml.safe_load(cfg_path.read_text()), str(cfg_path))
    f = cfg.factor
    row["seq_len"] = cfg.data.seq_len
    row["lr"] = row["lr"] if row["lr"] is not None else cfg.optim.lr
    row["serial"] = serial_cost(cfg)
    row["factor_rank"] = f.rank if f.kind != "none" else None
    row["optim_rank"] = cfg.optim.rank if _projects(cfg.optim.name) else None
    per_step = summary["tokens"] // max(1, summary["steps"])
    row["flops_per_token"] = flops_per_token(
        cfg.model.preset,
        _vocab_size(summary, cfg),
        cfg.data.seq_len,
        f.kind,
        f.rank,
        factor_targets=f.targets,
        tokens_per_step=per_step,
    )


#: Sequential decomposition calls (QR, SVD, eigh, LU) of one basis refresh, by basis kind
#: (optimizers/projection.py): an exact thin SVD is one; the randomized SVD normalises its sketch
#: once per power round (q LU, with a QR fallback), then a Householder QR of W, the eigh of a small
#: Gram and one QR (q + 3; 2 without power rounds); Gaussian and identity bases decompose nothing.
BASIS_CALLS: dict[str, Callable[[int], int]] = {
    "svd": lambda q: 1,
    "randomized_svd": lambda q: q + 3 if q > 0 else 2,
    "random": lambda q: 0,
    "identity": lambda q: 0,
}
#: A weight refactorization (`optimizers.refactorization.balanced_factors`): two thin QRs and an SVD.
REFACTORIZE_CALLS = 3
#: An exact step of a method that steps (B, A) pairs jointly (LORO): two thin QRs of the factors,
#: then a refactorization of the 2r-wide product.
EXACT_PAIR_STEP_CALLS = 2 + REFACTORIZE_CALLS


def serial_cost(cfg: Any) -> dict[str, Any]:
    """Sequential decomposition calls per optimizer update, for one weight matrix, amortised over
    refresh and restart periods: the step's chain of QR / SVD / eigh / LU / Newton-Schulz calls
    that cannot run in parallel with each other (the seed papers' serial-FLOPs concern).

    From the registry and the config, never a method name: a projecting method's basis refresh
    (`BASIS_CALLS` of its basis, every ``update_proj_gap`` updates), a matrix rule's Newton-Schulz
    iterations (its group option ``ns_steps``: Muon 5, SWAN 10), restarts that refactorize a
    refactorizable factorization (`REFACTORIZE_CALLS` every ``restarts.every``) and a pair-stepping
    method's exact steps (`EXACT_PAIR_STEP_CALLS` every restart period).

    Returns:
        ``{"per_update": float, "detail": str}``; per_update 0.0 and detail "" for a method with none.
    """
    import optimizers
    from effpretrain.models import factor_spec

    spec = optimizers.method_spec(cfg.optim.name)
    o, every = cfg.optim, cfg.restarts.every
    parts: list[tuple[float, str]] = []
    if spec.projects:
        defaults = getattr(spec.cls, "PROJECTION_DEFAULTS", {})
        basis = o.basis if o.basis != "default" else defaults.get("basis", "svd")
        q = int(o.extra.get("power_iters", defaults.get("power_iters", 1)))
        calls = BASIS_CALLS.get(basis, lambda q: 1)(q)
        if calls:
            parts.append((calls / o.update_proj_gap, f"{calls} per refresh / {o.update_proj_gap}"))
    ns = o.extra.get("ns_steps", getattr(spec.cls, "MATRIX_DEFAULTS", {}).get("ns_steps"))
    if spec.matrix_params is not None and ns:
        parts.append((float(ns), f"{ns} Newton-Schulz"))
    if (
        every > 0
        and cfg.restarts.refactorize
        and cfg.factor.kind != "none"
        and factor_spec(cfg.factor.kind).refactorizable
    ):
        parts.append((REFACTORIZE_CALLS / every, f"{REFACTORIZE_CALLS} per restart / {every}"))
    if spec.steps_factor_pairs and spec.restart_period_arg and every > 0:
        parts.append((EXACT_PAIR_STEP_CALLS / every, f"{EXACT_PAIR_STEP_CALLS} per exact step / {every}"))
    return {"per_update": float(sum(p for p, _ in parts)), "detail": " + ".join(d for _, d in parts)}


def _projects(name: str) -> bool:
    import optimizers

    return name in optimizers.METHODS and optimizers.METHODS[name].projects


def _mtime_iso(path: Path) -> str:
    t = dt.datetime.fromtimestamp(path.stat().st_mtime, tz=dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def collect(out: Path, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Rows of the given runs (default: every folder under out/runs), sorted by run name."""
    runs = out / "runs"
    dirs = [runs / n for n in names] if names is not None else sorted(p for p in runs.glob("*") if p.is_dir())
    rows = [r for r in (collect_run(d) for d in dirs if d.is_dir()) if r is not None]
    return sorted(rows, key=lambda r: r["run"])


def gather_rows(out: Path, names: Iterable[str], previous: Iterable[dict[str, Any]] = ()) -> list[ResultRow]:
    """The results rows of the runs `names` plus every other row of `previous` (an earlier
    results.jsonl: nothing recorded is dropped), sorted by run name.

    A run's folder gives its row when it holds a finished run (or when `previous` has no ok row
    of it); otherwise the previous row stands: with the run folders deleted, the committed rows
    are the results.
    """
    rows = {r["run"]: r for r in previous}
    for name in names:
        _merge_run(rows, out / "runs" / name)
    return [rows[k] for k in sorted(rows)]


def _merge_run(rows: dict[str, dict[str, Any]], run_dir: Path) -> None:
    """`gather_rows`'s rule for one run folder: its row replaces the recorded one unless only the
    recorded one is a finished run."""
    row = collect_run(run_dir) if run_dir.is_dir() else None
    if row is not None and (
        row.get("status") == "ok" or (rows.get(run_dir.name) or {}).get("status") != "ok"
    ):
        rows[run_dir.name] = row


def write_jsonl(rows: Iterable[ResultRow], path: Path) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

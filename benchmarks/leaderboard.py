"""Leaderboard: runs a grid of recipes at equal tokens and publishes memory, speed and perplexity.

    python benchmarks/leaderboard.py --grid tiny --tokens 200000 --out DIR [--seeds 0,1]
        [--methods adamw,galore] [--recipes recipes/tiny/adamw.yaml ...] [--set key=value ...]
    python benchmarks/leaderboard.py --out DIR          # re-collect and re-render what DIR holds
    python benchmarks/leaderboard.py --paper            # estimator vs the paper's memory table

Each recipe runs once per seed, as ``DIR/runs/<method>-<model>-seed<k>/``, with
``train.max_steps = ceil(tokens / (batch_size * grad_accum * seq_len))`` so that every method sees the
same number of tokens; evaluation is spread over a few points of the run (``--eval-points``). A run
whose ``summary.json`` exists is skipped, so an interrupted grid resumes where it stopped (a run
stopped mid-way with a complete checkpoint is resumed from it). A run that crashes is recorded as
an error and the grid goes on.

Runs are trained by `effpretrain.trainer.train` in a forked copy of this process (Linux): the fork
shares the already imported torch/transformers (no per-run import cost), isolates crashes (even a
segfault), and gives every run its own measured peak memory, which on CPU is the process's peak
RSS, a high-water mark that would otherwise carry over from one run to the next. The parent does
not initialise CUDA itself (a forked child could not use it then); should something have done so,
runs are trained in-process. ``--in-process`` trains in this process always (then the measured
peak of a run is at least that of the runs before it).

Outputs in DIR: ``results.jsonl`` (one line per run: the run's summary plus hardware, commit, date,
config hash, token budget, FLOPs per token, optimizer telemetry and the validation curve),
``LEADERBOARD.md`` (a pure function of those rows) and three plots: ``memory_vs_ppl.png``
(with the Pareto front), ``val_curves.png`` and ``memory_breakdown.png``.

Exit codes: 0 all runs finished; 1 some run failed (recorded in the results); 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import shutil
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
GRIDS = {"tiny": ("tiny",), "paper": ("llama_60m", "llama_130m", "llama_350m", "llama_1b")}
BASELINE = "adamw"
RUN_RECORD = "leaderboard_run.json"  # the planned spec, written into each run dir
ERROR_FILE = "leaderboard_error.txt"  # written by the grid when a run fails
PLOTS = {
    "memory_vs_ppl.png": "memory vs validation perplexity (Pareto front)",
    "val_curves.png": "validation perplexity vs tokens",
    "memory_breakdown.png": "estimated memory breakdown",
}
TELEMETRY_KEYS = ("opt/refreshes", "opt/refresh_s", "opt/restarts", "opt/restart_s", "opt/step_s")


class BadInput(ValueError):
    """A bad argument or path: reported in one line, exit code 2."""


# ----------------------------------------------------------------------------------------------
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

    name: str  # <method>-<model>-seed<k>: the run's folder under DIR/runs
    recipe: str  # path relative to the repository root where possible
    method: str
    model: str
    seed: int
    token_budget: int
    steps: int
    overrides: tuple[str, ...]
    config_hash: str


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
) -> list[RunSpec]:
    """Loads each recipe and builds its equal-token runs, one per seed.

    Args:
        recipes: recipe YAML files.
        tokens: token budget per run.
        seeds: values of ``train.seed``.
        methods: keep only recipes whose method (the recipe's stem unless it sets ``method``) is
            listed; None keeps all.
        extra_overrides: ``key=value`` overrides applied to every run before the budget.
        eval_points: about how many evaluations each run makes.

    Returns:
        The runs, in recipe order then seed order.
    """
    from effpretrain.config import config_hash, load_config
    from effpretrain.errors import ConfigError

    wanted = set(methods) if methods is not None else None
    specs: list[RunSpec] = []
    seen: set[str] = set()
    for recipe in recipes:
        try:
            base = load_config(recipe, list(extra_overrides))
        except ConfigError as e:
            raise BadInput(str(e)) from None
        if wanted is not None and base.method not in wanted:
            continue
        t = base.train
        steps = steps_for_tokens(tokens, t.batch_size, t.grad_accum, base.data.seq_len)
        for seed in seeds:
            overrides = (
                *extra_overrides,
                f"train.max_steps={steps}",
                f"train.eval_every={eval_every_for(steps, eval_points)}",
                "train.save_every=0",  # only the final checkpoint: mid-run saves only cost time here
                f"train.seed={seed}",
            )
            cfg = load_config(recipe, list(overrides))
            name = f"{cfg.method}-{cfg.model.preset}-seed{seed}"
            if name in seen:
                raise BadInput(f"two recipes give the same run name {name!r}: set a distinct `method` in one")
            seen.add(name)
            specs.append(
                RunSpec(
                    name=name,
                    recipe=_display_path(recipe),
                    method=cfg.method,
                    model=cfg.model.preset,
                    seed=seed,
                    token_budget=tokens,
                    steps=steps,
                    overrides=overrides,
                    config_hash=config_hash(cfg),
                )
            )
    if wanted is not None:
        missing = wanted - {s.method for s in specs}
        if missing:
            raise BadInput(f"--methods: no recipe for {', '.join(sorted(missing))}")
    return specs


# ----------------------------------------------------------------------------------------------
# Running: skip finished runs, isolate failures, show progress

Runner = Callable[[RunSpec, Path], None]


def train_spec(spec: RunSpec, run_dir: Path) -> None:
    """Trains one planned run into `run_dir` in this process (resuming from its checkpoint if any)."""
    from effpretrain import checkpoint as ckpt
    from effpretrain.config import load_config
    from effpretrain.trainer import train

    recipe = Path(spec.recipe)
    cfg = load_config(recipe if recipe.is_absolute() else ROOT / recipe, list(spec.overrides))
    resume = "auto" if ckpt.complete_checkpoints(run_dir / "checkpoints") else None
    summary = train(cfg, run_dir, resume=resume)
    if "stopped_by_signal" in summary:
        raise KeyboardInterrupt


def forked_runner(spec: RunSpec, run_dir: Path) -> None:
    """Runs `train_spec` in a forked child; raises RuntimeError with the child's error if it fails."""
    import multiprocessing as mp

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # A forked child cannot use CUDA once the parent initialised it: train here instead.
        return train_spec(spec, run_dir)
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(spec, run_dir, send), name=f"leaderboard-{spec.name}")
    child.start()
    send.close()  # the child holds the only write end now: EOF as soon as it dies
    interrupted = False

    def forward_sigterm(signum: int, _frame: Any) -> None:
        # An orphaned child would train on: pass the signal on, it saves a checkpoint and stops.
        nonlocal interrupted
        interrupted = True
        os.kill(child.pid, signum)

    try:
        old_handler = signal.signal(signal.SIGTERM, forward_sigterm)
    except ValueError:  # not the main thread: signals stay with whoever owns them
        old_handler = None
    msg: tuple[str, str] | None = None
    try:
        while msg is None:
            try:
                msg = recv.recv()
            except EOFError:
                break
            except KeyboardInterrupt:
                # Ctrl-C reaches the child too; it finishes its step and saves a checkpoint: wait for it.
                interrupted = True
        child.join()
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
    if interrupted or (msg is not None and msg[0] == "stopped"):
        raise KeyboardInterrupt
    if msg is None:
        code = child.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        raise RuntimeError(f"training process died without a result ({how})")
    if msg[0] == "error":
        raise RuntimeError(msg[1])


def prewarm_imports() -> None:
    """Imports here, once, what every training run imports, so that forked runs inherit it.

    Only on CPU builds of torch: there nothing can initialise CUDA before the fork, which a CUDA
    child could not survive. (On GPU the few seconds per run matter little.)
    """
    import torch

    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        return
    import accelerate  # noqa: F401
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    import transformers.modeling_layers  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401


def _child_main(spec: RunSpec, run_dir: Path, conn: Any) -> None:
    code = 0
    try:
        train_spec(spec, run_dir)
        conn.send(("ok", ""))
    except KeyboardInterrupt:
        conn.send(("stopped", ""))
    except BaseException as e:  # every failure is reported to the parent, none propagates
        code = 1
        tb = traceback.format_exc(limit=-3)
        conn.send(("error", f"{type(e).__name__}: {e}".strip() + "\n" + tb))
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip the parent's atexit handlers and buffered-IO flushes that the fork inherited.
        os._exit(code)


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _prepare_run_dir(spec: RunSpec, run_dir: Path) -> None:
    """A run dir with a complete checkpoint is resumed; any other leftover (a crash) starts clean."""
    from effpretrain import checkpoint as ckpt

    if run_dir.exists() and not ckpt.complete_checkpoints(run_dir / "checkpoints"):
        shutil.rmtree(run_dir)  # else a fresh run would append to a crashed run's metrics.jsonl
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    # The CPU is recorded now: a later re-collect may happen on another machine.
    record = dataclasses.asdict(spec) | {"cpu": cpu_description()}
    (run_dir / RUN_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def run_grid(
    specs: Sequence[RunSpec],
    out: Path,
    runner: Runner | None = None,
    log: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, list[str]]:
    """Runs every spec whose ``summary.json`` is missing; returns the names done/skipped/failed.

    A failure (any exception from `runner`) is written to the run's ``leaderboard_error.txt`` and
    the grid continues; KeyboardInterrupt stops the grid after the current run saved a checkpoint.

    Args:
        specs: the planned runs.
        out: the grid's folder; run k goes to ``out/runs/<spec.name>``.
        runner: trains one spec into a folder; default `forked_runner` on Linux, else `train_spec`.
        log: where progress lines go.
        clock: seconds, for elapsed time and ETA.
    """
    result: dict[str, list[str]] = {"done": [], "skipped": [], "failed": []}
    todo = [s for s in specs if not (out / "runs" / s.name / "summary.json").is_file()]
    if runner is None:
        runner = forked_runner if sys.platform.startswith("linux") else train_spec
    if runner is forked_runner and todo:
        prewarm_imports()
    n, start, ran = len(specs), clock(), 0
    log(f"leaderboard: {n} runs, {n - len(todo)} already finished, {len(todo)} to run")
    for i, spec in enumerate(specs, 1):
        run_dir = out / "runs" / spec.name
        if (run_dir / "summary.json").is_file():
            stale = _stale_note(spec, run_dir)
            log(f"[{i}/{n}] {spec.name}: skipped (summary.json exists){stale}")
            result["skipped"].append(spec.name)
            continue
        elapsed = clock() - start
        left = len(todo) - ran
        eta = f", ETA {_fmt_duration(elapsed / ran * left)}" if ran else ""
        took = f"elapsed {_fmt_duration(elapsed)}{eta}"
        log(f"[{i}/{n}] {spec.name}: {spec.steps} steps ({spec.recipe}), {took}")
        _prepare_run_dir(spec, run_dir)
        t0 = clock()
        try:
            runner(spec, run_dir)
        except KeyboardInterrupt:
            log(f"[{i}/{n}] {spec.name}: interrupted; run the same command again to resume")
            raise
        except Exception as e:
            msg = str(e).strip() or type(e).__name__
            (run_dir / ERROR_FILE).write_text(msg + "\n")
            log(f"[{i}/{n}] {spec.name}: FAILED after {_fmt_duration(clock() - t0)}: {msg.splitlines()[0]}")
            result["failed"].append(spec.name)
        else:
            log(f"[{i}/{n}] {spec.name}: done in {_fmt_duration(clock() - t0)}")
            result["done"].append(spec.name)
        ran += 1
    log(
        f"leaderboard: {len(result['done'])} ran, {len(result['skipped'])} skipped, "
        f"{len(result['failed'])} failed, in {_fmt_duration(clock() - start)}"
    )
    return result


def _stale_note(spec: RunSpec, run_dir: Path) -> str:
    try:
        old = json.loads((run_dir / "summary.json").read_text()).get("config_hash")
    except (OSError, ValueError):
        return ""
    if old and old != spec.config_hash:
        return f"; WARNING: it was made with another config ({old} != {spec.config_hash}); delete it to rerun"
    return ""


# ----------------------------------------------------------------------------------------------
# Collecting: one results row per run


def cpu_description() -> str:
    """CPU model name and core count (`effpretrain.reporting.cpu_description`, imported late: this
    script keeps the toolkit out of its start-up)."""
    from effpretrain.reporting import cpu_description as describe

    return describe()


def _vocab_size(summary: dict[str, Any], cfg: Any) -> int:
    """The trained vocabulary, from the parameter count: only embedding and head depend on it."""
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


def collect_run(run_dir: Path) -> dict[str, Any] | None:
    """The results row of one run folder (None if it holds no leaderboard record and no summary)."""
    spec = json.loads((run_dir / RUN_RECORD).read_text()) if (run_dir / RUN_RECORD).is_file() else {}
    summary_path = run_dir / "summary.json"
    if not spec and not summary_path.is_file():
        return None
    row: dict[str, Any] = {
        "run": run_dir.name,
        "method": spec.get("method"),
        "model": spec.get("model"),
        "seed": spec.get("seed"),
        "recipe": spec.get("recipe"),
        "token_budget": spec.get("token_budget"),
        "config_hash": spec.get("config_hash"),
        "overrides": list(spec.get("overrides") or []),
        "cpu": spec.get("cpu") or cpu_description(),
    }
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
    row.update({k: summary.get(k) for k in _SUMMARY_KEYS if k in summary})
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
    row["date"] = _mtime_iso(summary_path)
    curve, telemetry = read_metrics(run_dir / "metrics.jsonl")
    telemetry.update({k: summary[k] for k in TELEMETRY_KEYS if k in summary})
    row["telemetry"] = telemetry
    row["val_curve"] = curve
    row["train_s"] = summary["tokens"] / summary["tokens_per_s"] if summary.get("tokens_per_s") else None
    cfg_path = run_dir / "config.yaml"
    if cfg_path.is_file():
        import yaml

        from effpretrain.config import from_dict
        from effpretrain.flops import flops_per_token

        cfg = from_dict(yaml.safe_load(cfg_path.read_text()), str(cfg_path))
        f = cfg.factor
        row["seq_len"] = cfg.data.seq_len
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
    return row


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


def write_jsonl(rows: Iterable[dict[str, Any]], path: Path) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------
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


@dataclass
class _Group:
    """The rows of one (model, method) over seeds, reduced to what the table shows."""

    model: str
    method: str
    rows: list[dict[str, Any]]

    def mean(self, key: str, sub: str | None = None) -> float | None:
        return _mean((r.get(key) or {}).get(sub) if sub else r.get(key) for r in self.rows)

    @property
    def ppl(self) -> float:
        return statistics.fmean(r["final_val_ppl"] for r in self.rows)

    @property
    def ppl_std(self) -> float | None:
        vals = [r["final_val_ppl"] for r in self.rows]
        return statistics.stdev(vals) if len(vals) > 1 else None


def _groups(rows: Sequence[dict[str, Any]]) -> dict[str, list[_Group]]:
    """ok rows grouped by model, then by method; models ordered by size, methods by perplexity."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("status") == "ok":
            by.setdefault((r["model"], r["method"]), []).append(r)
    models: dict[str, list[_Group]] = {}
    for (model, method), rs in sorted(by.items()):
        models.setdefault(model, []).append(_Group(model, method, sorted(rs, key=lambda r: r["run"])))
    size = {m: min(r.get("params") or 0 for g in gs for r in g.rows) for m, gs in models.items()}
    return {
        m: sorted(models[m], key=lambda g: (g.ppl, g.method))
        for m in sorted(models, key=lambda m: (size[m], m))
    }


def _refresh_cell(g: _Group) -> str:
    """Refresh/refactorization count and time, as a share of optimizer time when the telemetry has
    it (opt/step_s), else of training time (tokens / tokens_per_s)."""
    tel = [r.get("telemetry") or {} for r in g.rows]
    parts = []
    refreshes = _mean(t.get("opt/refreshes") for t in tel)
    restarts = _mean(t.get("opt/restarts") for t in tel)
    spent = [(t.get("opt/refresh_s") or 0.0) + (t.get("opt/restart_s") or 0.0) for t in tel]
    timed = any("opt/refresh_s" in t or "opt/restart_s" in t for t in tel)
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


# Set per run by the grid itself (budget, eval points, seed): not worth repeating in the header.
_GRID_KEYS = ("train.max_steps", "train.eval_every", "train.save_every", "train.seed")


def _common_overrides(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The user's --set overrides shared by every row, in the first row's order."""
    lists = [[o for o in r.get("overrides") or [] if not o.startswith(_GRID_KEYS)] for r in rows]
    return [o for o in lists[0] if all(o in other for other in lists[1:])] if lists else []


def render_markdown(
    rows: Sequence[dict[str, Any]], baseline: str = BASELINE, plots: Iterable[str] = ()
) -> str:
    """LEADERBOARD.md from results rows: deterministic for the same rows (sorted, fixed formats).

    Args:
        rows: results.jsonl rows (`collect_run`'s format).
        baseline: the method every ratio is relative to, per model.
        plots: image file names (relative to the markdown) to embed at the end.
    """
    ok = [r for r in rows if r.get("status") == "ok"]
    bad = sorted((r for r in rows if r.get("status") != "ok"), key=lambda r: r["run"])
    hardware = sorted({r.get("hardware") or "unknown" for r in rows})
    budgets = sorted({int(r["token_budget"]) for r in rows if r.get("token_budget")})
    commits = sorted({r.get("git_commit") or "unknown" for r in ok})
    dates = sorted(r["date"] for r in rows if r.get("date"))
    seeds = sorted({r["seed"] for r in ok if r.get("seed") is not None})
    out = ["# effpretrain leaderboard", ""]
    out.append(f"- Hardware: {'; '.join(hardware) or 'unknown'}")
    budget = ", ".join(f"{b:,}" for b in budgets) or "unknown"
    out.append(f"- Token budget: {budget} tokens per run (equal for every method)")
    out.append(f"- Runs: {len(ok)} finished, {len(bad)} failed; seeds {', '.join(map(str, seeds)) or '-'}")
    common = _common_overrides(ok)
    if common:
        out.append(f"- Overrides on every run: {' '.join(f'`{o}`' for o in common)}")
    out.append(
        f"- Commit: {', '.join(commits) or '-'}; dates: {dates[0] + ' .. ' + dates[-1] if dates else '-'}"
    )
    out.append("")
    header = (
        "| # | method | model | val ppl | est. memory | peak tensor memory | optimizer state "
        "| weights / grads / activations / temporaries | tokens/s | FLOPs/token | refresh / refactorization |"
    )
    for model, groups in _groups(ok).items():
        base = next((g for g in groups if g.method == baseline), None)

        def rel(g: _Group, key: str, sub: str | None = None, _base: _Group | None = base) -> str:
            v = g.mean(key, sub)
            text = fmt_bytes(v) if key != "tokens_per_s" else ("-" if v is None else f"{v:,.0f}")
            return text + _ratio(v, _base.mean(key, sub) if _base else None)

        tokens = sorted({int(r["tokens"]) for g in groups for r in g.rows if r.get("tokens")})
        steps = sorted({int(r["steps"]) for g in groups for r in g.rows if r.get("steps")})
        out += [f"## {model}", ""]
        versus = f"{baseline} on {model}" if base else f"nothing (no {baseline} run)"
        out.append(
            f"Steps per run: {', '.join(map(str, steps))}; tokens trained per run: "
            f"{', '.join(f'{t:,}' for t in tokens)}. Ratios are relative to {versus}."
        )
        out += ["", header, "|" + "---|" * 11]
        for rank, g in enumerate(groups, 1):
            ppl = f"{g.ppl:.2f}" + (f" ± {g.ppl_std:.2f}" if g.ppl_std is not None else "")
            cells = [
                str(rank),
                g.method,
                model,
                ppl + f" (n={len(g.rows)})",
                rel(g, "estimated", "total"),
                rel(g, "measured", "peak"),
                rel(g, "measured", "optimizer_state"),
                " / ".join(fmt_bytes(g.mean("measured", k)) for k in MEASURED_KEYS[:2] + MEASURED_KEYS[3:5]),
                rel(g, "tokens_per_s"),
                fmt_count(g.mean("flops_per_token")),
                _refresh_cell(g),
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    if bad:
        out += ["## Failed runs", "", "| run | status | error |", "|---|---|---|"]
        for r in bad:
            err = (r.get("error") or "").splitlines()[0] if r.get("error") else ""
            out.append(f"| {r['run']} | {r.get('status')} | {err.replace('|', '/')} |")
        out.append("")
    out += [
        "Columns:",
        "",
        "- **val ppl**: final validation perplexity, mean ± sample standard deviation over seeds (n runs).",
        "- **est. memory**: the analytic estimate (`effpretrain.memory.estimate`) of weights + gradients +"
        " optimizer state + activations at the run's batch, sequence length and precision.",
        "- **peak tensor memory**, **optimizer state** and **weights / grads / activations / temporaries**:"
        " measured on the run's measured steps (`train.memory_steps`, `effpretrain.memory_measure`), the"
        " largest over them: live tensor bytes at the step's peak (CUDA's allocator on GPU, tensor"
        " accounting on CPU: the Python/torch runtime is not counted), the optimizer's state tensors, the"
        " weights and gradients, what autograd saves for backward, and the rest of the peak; `-` for runs"
        " recorded before these were measured.",
        "- **tokens/s**: training throughput (tokens / time in training steps, evaluation excluded); runs"
        " are timed one after another, so ratios mean something only on an otherwise idle machine.",
        "- **FLOPs/token**: analytic training FLOPs of the matrix multiplies (6 per weight for dense"
        " layers, the factorized layers' own cost, 12 L h T for attention; see `flops_per_token`).",
        "- **refresh / refactorization**: basis refreshes (GaLore-family) and restarts (refactorization +"
        " momentum reset) from the runs' telemetry, and the time they took as a share of optimizer time"
        " (`opt`) when recorded, else of training time (`train`); `-` where the method has none.",
        "- `(0.52x)`: the value divided by the same model's baseline value.",
        "",
    ]
    for name in plots:
        out += [f"![{PLOTS.get(name, name)}]({name})", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Plots


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower is better on both), by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def plot_all(rows: Sequence[dict[str, Any]], out: Path) -> list[str]:
    """Writes the three PNGs into `out` from the rows; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(rows)
    if not groups:
        return []
    models = list(groups)
    methods = sorted({g.method for gs in groups.values() for g in gs})
    # tab20 plus a marker per block of 20 keeps every method distinguishable.
    colors = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(methods)}
    markers = {m: "os^Dv<>p"[(i // 20) % 8] for i, m in enumerate(methods)}
    written = []

    # Memory vs perplexity, estimated and measured, with the Pareto front per model.
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
    fig.tight_layout()
    fig.savefig(out / "memory_vs_ppl.png", dpi=100)
    plt.close(fig)
    written.append("memory_vs_ppl.png")

    # Validation curves: mean over seeds at each token count, one panel per model.
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
    fig.tight_layout()
    fig.savefig(out / "val_curves.png", dpi=100)
    plt.close(fig)
    written.append("val_curves.png")

    # Estimated memory breakdown: stacked bars per method, one panel per model.
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
    fig.tight_layout()
    fig.savefig(out / "memory_breakdown.png", dpi=100)
    plt.close(fig)
    written.append("memory_breakdown.png")
    return written


def publish(rows: Sequence[dict[str, Any]], out: Path, plots: bool = True) -> None:
    """Writes results.jsonl, the plots and LEADERBOARD.md into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(rows, out / "results.jsonl")
    names = plot_all(rows, out) if plots else []
    (out / "LEADERBOARD.md").write_text(render_markdown(rows, plots=names))


# ----------------------------------------------------------------------------------------------
# CLI


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Run a grid of recipes at equal tokens and publish a leaderboard (or --paper).",
        epilog="With only --out: re-collect DIR/runs (or read DIR/results.jsonl) and re-render.",
    )
    ap.add_argument(
        "--grid", choices=sorted(GRIDS), help="tiny: recipes/tiny/*.yaml; paper: recipes/llama_*/"
    )
    ap.add_argument(
        "--recipes", nargs="+", type=Path, default=[], help="recipe files (instead of / beside --grid)"
    )
    ap.add_argument("--tokens", type=int, help="token budget per run (required to run a grid)")
    ap.add_argument("--out", type=Path, help="output folder (runs/, results.jsonl, LEADERBOARD.md, plots)")
    ap.add_argument("--seeds", default="0", help="comma-separated train.seed values (default 0)")
    ap.add_argument("--methods", help="comma-separated methods (recipe stems) to keep")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override applied to every run, e.g. --set data.seq_len=64",
    )
    ap.add_argument(
        "--eval-points", type=int, default=4, help="about how many evaluations per run (default 4)"
    )
    ap.add_argument(
        "--in-process", action="store_true", help="train in this process instead of a fork per run"
    )
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument(
        "--paper",
        action="store_true",
        help="print the estimator-vs-published memory table of the paper recipes (markdown) and exit",
    )
    return ap.parse_args(argv)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"{flag}: expected comma-separated integers, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.paper:
        print(paper_report())
        return 0
    if args.out is None:
        raise BadInput("--out DIR is required (or use --paper)")
    out: Path = args.out
    if not args.grid and not args.recipes:
        # Render only: from the run folders if present, else from an existing results.jsonl.
        if (out / "runs").is_dir():
            rows = collect(out)
        elif (out / "results.jsonl").is_file():
            rows = read_jsonl(out / "results.jsonl")
        else:
            raise BadInput(f"{out}: no runs/ and no results.jsonl; pass --grid or --recipes to run a grid")
        publish(rows, out, plots=not args.no_plots)
        print(f"leaderboard: rendered {len(rows)} rows into {out / 'LEADERBOARD.md'}")
        return 0
    if args.tokens is None:
        raise BadInput("--tokens BUDGET is required to run a grid")
    recipes = grid_recipes(args.grid) if args.grid else []
    for r in args.recipes:
        if not r.is_file():
            raise BadInput(f"recipe not found: {r}")
        recipes.append(r)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    specs = plan_runs(
        recipes, args.tokens, _int_list(args.seeds, "--seeds"), methods, args.overrides, args.eval_points
    )
    result = run_grid(specs, out, runner=train_spec if args.in_process else None)
    rows = collect(out, [s.name for s in specs])
    publish(rows, out, plots=not args.no_plots)
    print(f"leaderboard: wrote {out / 'results.jsonl'} and {out / 'LEADERBOARD.md'}")
    print(render_table_only(rows))
    return 1 if result["failed"] else 0


def paper_report(recipes_root: Path | None = None) -> str:
    """The --paper document: what produced it (command, commit, machine), then the table of
    `effpretrain.paper` computed from the paper recipes under `recipes_root` (default `RECIPES`)."""
    import torch

    from effpretrain import paper
    from effpretrain.reporting import git_commit

    rows = paper.paper_memory_table(recipes_root=recipes_root or RECIPES)
    return "\n".join(
        [
            "# Weight + optimizer memory at the paper sizes: the estimator vs the published figures",
            "",
            "- Command: `python benchmarks/leaderboard.py --paper` (an analytic estimate on the meta device)",
            f"- Code: commit {git_commit()}, {dt.datetime.now(dt.timezone.utc):%Y-%m-%d}",
            f"- Machine: {cpu_description()}; torch {torch.__version__}",
            "- Counting: bf16 weights + optimizer state, GB = 1e9 bytes, gradients and activations not"
            " counted, vocabulary 32,000; ranks, factorization and density from each"
            " `recipes/<size>/<method>.yaml`. \"benchmark's count\" counts the state the method's"
            ' official code holds (the note says where that is more than ours); "effpretrain holds" is ours.',
            "",
            paper.format_paper_table(rows, paper.skipped_methods()),
        ]
    )


def render_table_only(rows: Sequence[dict[str, Any]]) -> str:
    """The ranked tables of the markdown, for the terminal."""
    md = render_markdown(rows)
    return "\n".join(line for line in md.splitlines() if line.startswith(("|", "##")))


def cli() -> None:
    try:
        code = main()
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    cli()

"""Leaderboard: runs a grid of recipes at equal tokens and publishes memory, speed and perplexity.

The committed CPU study (benchmarks/results/tiny-cpu-study/) is this command:

    python benchmarks/leaderboard.py --grid tiny --sweep lr=x0.25,x0.5,x1,x2,x4 --seeds 0,1,2 --jobs 2 \
        --out benchmarks/results/tiny-cpu-study

``--grid tiny`` is every ``recipes/tiny/*.yaml`` at 2,048 tokens per step (``data.seq_len=128``,
``train.batch_size=16``) and, by default, 1,048,576 tokens per final run (512 steps); the sweep
trains each method at 0.25x, 0.5x, 1x, 2x and 4x its recipe's lr for a quarter of that (128
steps, seed 0), then three seeds at the best lr. That is 26 x 5 sweep runs (34.1M tokens) and
26 x 3 final runs (81.8M tokens): at about 7,500 tokens/s for two tiny runs at once on a 2-core
CPU, about 4.5 hours, plus about an hour for Muon's Newton-Schulz iterations. (A 3-point grid,
x0.5,x1,x2, left the best lr at an edge for most methods.) The plan's token
count is printed first. The same table at 60M on a GPU (the benchmark's 11,000 steps of 131,072
tokens; the sweep at a quarter of it):

    python benchmarks/leaderboard.py --grid llama_60m --sweep lr=x0.5,x1,x2 --seeds 0,1,2 --out DIR

Other forms:

    python benchmarks/leaderboard.py --grid tiny --tokens 200000 --out DIR [--seeds 0,1]
        [--methods adamw,galore] [--recipes recipes/tiny/adamw.yaml ...] [--set key=value ...]
        [--sweep lr=x0.25,x0.5,x1,x2,x4 | lr=1e-3,3e-3] [--sweep-tokens N] [--sweep-seed K] [--jobs N]
    python benchmarks/leaderboard.py --out DIR          # re-collect and re-render what DIR holds
    python benchmarks/leaderboard.py --out benchmarks/results/tiny-cpu-study --readme README.md
                                                        # also regenerate README.md's excerpt
    python benchmarks/leaderboard.py --paper            # estimator vs the paper's memory table

Each recipe runs once per seed, as ``DIR/runs/<method>-<model>-seed<k>/``, with
``train.max_steps = ceil(tokens / (batch_size * grad_accum * seq_len))`` so that every method sees the
same number of tokens; evaluation is spread over a few points of the run (``--eval-points``).

Learning-rate sweep (``--sweep``): first every method trains each lr of the grid (multiples
``xM`` of its recipe's ``optim.lr``, or absolute values) on ``--sweep-tokens`` (default a quarter of
``--tokens``) at ``--sweep-seed`` (default the first seed), as
``DIR/runs/<method>-<model>-sweep-lr<point>-seed<k>/``; the lr with the lowest final validation
perplexity (ties to the smaller lr; failed or diverged runs never win) is then trained at every
seed on the full budget. A choice at either end of the grid is flagged "edge of grid: widen it".
The choice is a pure function of the sweep rows (`select_lrs`), so it is the same on every
re-invocation.

Seeds and claims: the table gives each method's mean final perplexity and sample standard
deviation over seeds, and its difference from AdamW; two methods differ "within noise" when
|mean_a - mean_b| <= max(sd_a, sd_b) (sd 0 for a single seed). The claims section checks the
benchmark's claims (`CLAIMS`, data) against the final runs (`evaluate_claims`): reproduced, not
reproduced, within noise, or not measured (a method missing), with the numbers.

Budgets: the header states tokens per step, steps and tokens per run of the sweep and the final
runs; fewer than `MIN_TOKENS_PER_STEP` tokens per step, or final runs of fewer than `MIN_STEPS`
steps, are warned about on stderr and in the markdown.

Resuming: a run is skipped when its ``summary.json`` exists or ``DIR/results.jsonl`` holds a
finished row of it, so the committed results alone (run folders deleted, a new machine) re-run
nothing and re-render the same markdown; results.jsonl is rewritten after every run. A run stopped
mid-way with a complete checkpoint is resumed from it. A run that crashes is recorded as an error
and the grid goes on (it is retried on the next invocation).

Runs are trained by `effpretrain.trainer.train` in a forked copy of this process (Linux): the fork
shares the already imported torch/transformers (no per-run import cost), isolates crashes (even a
segfault), and gives every run its own measured peak memory, which on CPU is the process's peak
RSS, a high-water mark that would otherwise carry over from one run to the next. ``--jobs N``
keeps N forked runs going at once, each on cores / N torch threads. The parent does not
initialise CUDA itself (a forked child could not use it then); should something have done so,
runs are trained in-process, one at a time. ``--in-process`` trains in this process always (then
the measured peak of a run is at least that of the runs before it).

Outputs in DIR: ``results.jsonl`` (one line per run: the run's summary plus phase, lr, hardware,
commit, date, config hash, token budget, FLOPs per token, serial decompositions per update,
optimizer telemetry, evaluation and restart seconds and the validation curve), ``LEADERBOARD.md``
(a pure function of those rows) and three plots of the final runs: ``memory_vs_ppl.png`` (with the
Pareto front), ``val_curves.png`` (every method's validation curve, mean over seeds) and
``memory_breakdown.png``.

``--readme FILE`` rewrites the text between FILE's ``<!-- leaderboard:start -->`` and
``<!-- leaderboard:end -->`` markers with `readme_summary` of the rows (per model the top final
runs, then every claim's verdict): the README's leaderboard excerpt is generated, not edited.

Exit codes: 0 all runs finished; 1 some run failed (recorded in the results); 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import functools
import json
import math
import os
import shutil
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
GRIDS = {
    "tiny": ("tiny",),
    "llama_60m": ("llama_60m",),
    "paper": ("llama_60m", "llama_130m", "llama_350m", "llama_1b"),
}
#: Overrides a named grid applies to every run before --set: the tiny preset's budget floors hold
#: (16 x 128 = 2,048 tokens per step) whatever the recipes say.
GRID_OVERRIDES = {"tiny": ("data.seq_len=128", "train.batch_size=16", "train.grad_accum=1")}
#: --tokens when a named grid is run without it: 512 steps of 2,048 tokens for tiny; the
#: benchmark's 11,000 steps of 512 x 256 tokens at 60M.
GRID_TOKENS = {"tiny": 1_048_576, "llama_60m": 11_000 * 512 * 256}
#: Budget floors: fewer tokens per step or fewer steps per final run than these draw a warning
#: (stderr and LEADERBOARD.md): below them the tiny study's ranking is noise and warm-up.
MIN_TOKENS_PER_STEP = 2_000
MIN_STEPS = 500
BASELINE = "adamw"
RUN_RECORD = "leaderboard_run.json"  # the planned spec, written into each run dir
ERROR_FILE = "leaderboard_error.txt"  # written by the grid when a run fails
TIMING_FILE = "leaderboard_timing.json"  # seconds in evaluation and restarts, measured by the grid
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
        per_step = t.batch_size * t.grad_accum * base.data.seq_len
        steps = steps_for_tokens(tokens, t.batch_size, t.grad_accum, base.data.seq_len)
        if sweep is not None:
            points: list[tuple[str | None, float]] = [(p.label, p.lr(base.optim.lr)) for p in sweep]
        elif lrs is not None:
            if (base.model.preset, base.method) not in lrs:
                continue
            points = [(None, lrs[base.model.preset, base.method])]
        else:
            points = [(None, base.optim.lr)]
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
                cfg = load_config(recipe, list(overrides))
                trial = f"-sweep-lr{label}" if label is not None else ""
                name = f"{cfg.method}-{cfg.model.preset}{trial}-seed{seed}"
                if name in seen:
                    raise BadInput(
                        f"two recipes give the same run name {name!r}: set a distinct `method` in one"
                    )
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
                        phase="sweep" if sweep is not None else "final",
                        lr=cfg.optim.lr,
                        lr_label=label,
                        tokens_per_step=per_step,
                    )
                )
    if wanted is not None:
        missing = wanted - {s.method for s in specs}
        if missing and lrs is None:
            raise BadInput(f"--methods: no recipe for {', '.join(sorted(missing))}")
    return specs


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


# ----------------------------------------------------------------------------------------------
# Running: skip finished runs, isolate failures, show progress

Runner = Callable[[RunSpec, Path], None]


@contextlib.contextmanager
def timed_events(run_dir: Path) -> Iterator[dict[str, float]]:
    """Times evaluation (`Trainer.evaluate`) and restarts (`Restarts.restart`) while a run trains
    here, and adds the seconds to ``run_dir/leaderboard_timing.json`` (``eval_s``, ``restart_s``;
    summed over the processes of a resumed run). The trainer times its steps and basis refreshes
    itself but not these two; the patch is undone on exit (and dies with a forked child)."""
    from effpretrain.trainer import Trainer
    from optimizers.restarts import Restarts

    spent = {"eval_s": 0.0, "restart_s": 0.0}
    originals = [(Trainer, "evaluate", "eval_s"), (Restarts, "restart", "restart_s")]
    saved = []
    for cls, attr, key in originals:
        fn = cls.__dict__[attr]

        def timed(self: Any, *args: Any, _fn: Any = fn, _key: str = key, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(self, *args, **kwargs)
            finally:
                spent[_key] += time.perf_counter() - t0

        saved.append((cls, attr, fn))
        setattr(cls, attr, functools.wraps(fn)(timed))
    try:
        yield spent
    finally:
        for cls, attr, fn in saved:
            setattr(cls, attr, fn)
        path = run_dir / TIMING_FILE
        try:
            before = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            before = {}
        total = {k: float(before.get(k, 0.0)) + v for k, v in spent.items()}
        path.write_text(json.dumps(total, sort_keys=True) + "\n")


def train_spec(spec: RunSpec, run_dir: Path, threads: int | None = None) -> None:
    """Trains one planned run into `run_dir` in this process (resuming from its checkpoint if any),
    on `threads` torch threads when given (parallel runs share the cores)."""
    from effpretrain import checkpoint as ckpt
    from effpretrain.config import load_config
    from effpretrain.trainer import train

    if threads:
        import torch

        torch.set_num_threads(threads)
    recipe = Path(spec.recipe)
    cfg = load_config(recipe if recipe.is_absolute() else ROOT / recipe, list(spec.overrides))
    resume = "auto" if ckpt.complete_checkpoints(run_dir / "checkpoints") else None
    with timed_events(run_dir):
        summary = train(cfg, run_dir, resume=resume)
    if "stopped_by_signal" in summary:
        raise KeyboardInterrupt


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def forked_runner(spec: RunSpec, run_dir: Path) -> None:
    """Runs `train_spec` in a forked child; raises RuntimeError with the child's error if it fails."""
    if _cuda_initialised():
        # A forked child cannot use CUDA once the parent initialised it: train here instead.
        return train_spec(spec, run_dir)
    outcome: list[BaseException | None] = []
    run_forked(
        [(spec, run_dir)],
        jobs=1,
        threads=None,
        on_start=lambda _: None,
        on_done=lambda _, e: outcome.append(e),
    )
    if outcome and outcome[0] is not None:
        raise outcome[0]


def run_forked(
    items: Sequence[tuple[RunSpec, Path]],
    jobs: int,
    threads: int | None,
    on_start: Callable[[RunSpec], None],
    on_done: Callable[[RunSpec, BaseException | None], None],
) -> None:
    """Trains `items` in forked children, at most `jobs` at once, each on `threads` torch threads.

    `on_start` runs before a child is forked; `on_done` gets each run's outcome as it ends: None,
    RuntimeError (the child's error, or how it died) or KeyboardInterrupt (it stopped on a signal,
    after saving a checkpoint). SIGTERM is passed on to every running child; Ctrl-C (which reaches
    the children too) and SIGTERM start no new run and wait for the running ones to save and stop,
    then raise KeyboardInterrupt.
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("fork")
    pending = list(items)
    running: dict[Any, tuple[Any, RunSpec]] = {}
    interrupted = False

    def forward_sigterm(signum: int, _frame: Any) -> None:
        # An orphaned child would train on: pass the signal on, it saves a checkpoint and stops.
        nonlocal interrupted
        interrupted = True
        for child, _ in running.values():
            os.kill(child.pid, signum)

    try:
        old_handler = signal.signal(signal.SIGTERM, forward_sigterm)
    except ValueError:  # not the main thread: signals stay with whoever owns them
        old_handler = None
    try:
        while pending or running:
            while pending and len(running) < jobs and not interrupted:
                spec, run_dir = pending.pop(0)
                on_start(spec)
                recv, send = ctx.Pipe(duplex=False)
                child = ctx.Process(
                    target=_child_main, args=(spec, run_dir, send, threads), name=f"leaderboard-{spec.name}"
                )
                child.start()
                send.close()  # the child holds the only write end now: EOF as soon as it dies
                running[recv] = (child, spec)
            if not running:
                break
            try:
                ready = wait(list(running))
            except KeyboardInterrupt:
                # Ctrl-C reaches the children too; each finishes its step and saves: wait for them.
                interrupted = True
                continue
            for conn in ready:
                child, spec = running.pop(conn)
                try:
                    msg = conn.recv()
                except EOFError:
                    msg = None
                except KeyboardInterrupt:
                    interrupted, msg = True, None
                child.join()
                conn.close()
                # After Ctrl-C or SIGTERM a child's end is its interruption, not a failure to record.
                outcome = KeyboardInterrupt() if interrupted else _outcome(child.exitcode, msg)
                interrupted = interrupted or isinstance(outcome, KeyboardInterrupt)
                on_done(spec, outcome)
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
    if interrupted:
        raise KeyboardInterrupt


def _outcome(exitcode: int | None, msg: tuple[str, str] | None) -> BaseException | None:
    """What a child's last message (None: it died without one) and exit code say."""
    if msg is None:
        how = (
            f"killed by signal {-exitcode}"
            if exitcode is not None and exitcode < 0
            else f"exit code {exitcode}"
        )
        return RuntimeError(f"training process died without a result ({how})")
    if msg[0] == "stopped":
        return KeyboardInterrupt()
    if msg[0] == "error":
        return RuntimeError(msg[1])
    return None


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


def _child_main(spec: RunSpec, run_dir: Path, conn: Any, threads: int | None = None) -> None:
    code = 0
    # The fork inherited the grid's SIGTERM forwarding: a child's own SIGTERM is the trainer's.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        # Without a thread count, the two-argument call (torch's default threads; what tests replace).
        train_spec(spec, run_dir, threads) if threads else train_spec(spec, run_dir)
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


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_grid(
    specs: Sequence[RunSpec],
    out: Path,
    runner: Runner | None = None,
    log: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
    *,
    finished: Mapping[str, dict[str, Any]] | None = None,
    jobs: int = 1,
    after_each: Callable[[RunSpec], None] | None = None,
) -> dict[str, list[str]]:
    """Runs every spec not finished yet; returns the names done/skipped/failed.

    A run is finished when its ``summary.json`` exists or `finished` (the rows of a results.jsonl)
    holds an ok row of that name: the committed results alone are enough to resume on a new
    machine. A failure (any exception from `runner`) is written to the run's
    ``leaderboard_error.txt`` and the grid continues; KeyboardInterrupt stops the grid after the
    current runs saved a checkpoint.

    Args:
        specs: the planned runs.
        out: the grid's folder; run k goes to ``out/runs/<spec.name>``.
        runner: trains one spec into a folder; default `forked_runner` on Linux, else `train_spec`.
        log: where progress lines go.
        clock: seconds, for elapsed time and ETA.
        finished: results rows by run name.
        jobs: with the default runner on Linux, this many forked runs at once, each on
            ``cores // jobs`` torch threads; another runner always runs one at a time.
        after_each: called after every run that ran (to write results.jsonl as the grid goes).
    """
    finished = finished or {}
    result: dict[str, list[str]] = {"done": [], "skipped": [], "failed": []}

    def done_before(s: RunSpec) -> str | None:
        if (out / "runs" / s.name / "summary.json").is_file():
            return "summary.json exists"
        return "in results.jsonl" if (finished.get(s.name) or {}).get("status") == "ok" else None

    todo = [s for s in specs if done_before(s) is None]
    pool = runner is None and sys.platform.startswith("linux") and not _cuda_initialised()
    if runner is None:
        runner = forked_runner if sys.platform.startswith("linux") else train_spec
    if pool and todo:
        prewarm_imports()
    n, start = len(specs), clock()
    index = {s.name: i for i, s in enumerate(specs, 1)}
    t0: dict[str, float] = {}
    log(f"leaderboard: {n} runs, {n - len(todo)} already finished, {len(todo)} to run")

    def on_start(spec: RunSpec) -> None:
        ran = len(result["done"]) + len(result["failed"])
        elapsed = clock() - start
        eta = f", ETA {_fmt_duration(elapsed / ran * (len(todo) - ran))}" if ran else ""
        log(
            f"[{index[spec.name]}/{n}] {spec.name}: {spec.steps} steps ({spec.recipe}), elapsed {_fmt_duration(elapsed)}{eta}"
        )
        _prepare_run_dir(spec, out / "runs" / spec.name)
        t0[spec.name] = clock()

    def on_done(spec: RunSpec, error: BaseException | None) -> None:
        i, took = index[spec.name], _fmt_duration(clock() - t0[spec.name])
        if isinstance(error, KeyboardInterrupt):
            log(f"[{i}/{n}] {spec.name}: interrupted; run the same command again to resume")
            return
        if error is None:
            log(f"[{i}/{n}] {spec.name}: done in {took}")
            result["done"].append(spec.name)
        else:
            msg = str(error).strip() or type(error).__name__
            (out / "runs" / spec.name / ERROR_FILE).write_text(msg + "\n")
            log(f"[{i}/{n}] {spec.name}: FAILED after {took}: {msg.splitlines()[0]}")
            result["failed"].append(spec.name)
        if after_each is not None:
            after_each(spec)

    for spec in specs:
        why = done_before(spec)
        if why is not None:
            stale = _stale_note(spec, out / "runs" / spec.name, finished.get(spec.name))
            log(f"[{index[spec.name]}/{n}] {spec.name}: skipped ({why}){stale}")
            result["skipped"].append(spec.name)
        elif pool and jobs > 1:
            continue  # started by the pool below, in plan order
        else:
            on_start(spec)
            try:
                runner(spec, out / "runs" / spec.name)
            except KeyboardInterrupt:
                on_done(spec, KeyboardInterrupt())
                raise
            except Exception as e:
                on_done(spec, e)
            else:
                on_done(spec, None)
    if pool and jobs > 1:
        threads = max(1, _cores() // jobs)
        run_forked([(s, out / "runs" / s.name) for s in todo], jobs, threads, on_start, on_done)
    log(
        f"leaderboard: {len(result['done'])} ran, {len(result['skipped'])} skipped, "
        f"{len(result['failed'])} failed, in {_fmt_duration(clock() - start)}"
    )
    return result


def _stale_note(spec: RunSpec, run_dir: Path, row: dict[str, Any] | None = None) -> str:
    try:
        old = json.loads((run_dir / "summary.json").read_text()).get("config_hash")
    except (OSError, ValueError):
        old = (row or {}).get("config_hash")
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
        "phase": spec.get("phase") or "final",
        "lr": spec.get("lr"),
        "lr_label": spec.get("lr_label"),
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
    if (run_dir / TIMING_FILE).is_file():
        timing = json.loads((run_dir / TIMING_FILE).read_text())
        row["eval_s"] = timing.get("eval_s")
        if "opt/restarts" in telemetry:  # a run without restarts has no restart time, not 0 s
            row["restart_s"] = timing.get("restart_s")
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
    return row


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


def gather_rows(
    out: Path, names: Iterable[str], previous: Iterable[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
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


def _finite_ppl(r: dict[str, Any]) -> bool:
    v = r.get("final_val_ppl")
    return isinstance(v, (int, float)) and math.isfinite(v)


def _is_ok(r: dict[str, Any]) -> bool:
    """A finished run with a finite final perplexity (a diverged run is listed with the failures)."""
    return r.get("status") == "ok" and _finite_ppl(r)


def _phase(r: dict[str, Any]) -> str:
    return r.get("phase") or "final"


@dataclass
class _Group:
    """The final runs of one (model, method) over seeds, reduced to what the table shows."""

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


def _groups(rows: Sequence[dict[str, Any]]) -> dict[str, list[_Group]]:
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


# ----------------------------------------------------------------------------------------------
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


def select_lrs(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, str], LrChoice]:
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


def _sweep_section(rows: Sequence[dict[str, Any]], model: str) -> list[str]:
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


# ----------------------------------------------------------------------------------------------
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


def evaluate_claims(rows: Sequence[dict[str, Any]], claims: Sequence[Claim] = CLAIMS) -> list[dict[str, str]]:
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


def _claims_section(rows: Sequence[dict[str, Any]]) -> list[str]:
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


# ----------------------------------------------------------------------------------------------
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


def _common_overrides(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The user's --set overrides shared by every row, in the first row's order."""
    lists = [[o for o in r.get("overrides") or [] if not o.startswith(_GRID_KEYS)] for r in rows]
    return [o for o in lists[0] if all(o in other for other in lists[1:])] if lists else []


def _budget_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
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


def _header(
    rows: Sequence[dict[str, Any]], ok: Sequence[dict[str, Any]], bad: Sequence[dict[str, Any]]
) -> list[str]:
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


def render_markdown(
    rows: Sequence[dict[str, Any]], baseline: str = BASELINE, plots: Iterable[str] = ()
) -> str:
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
        "--grid",
        choices=sorted(GRIDS),
        help="tiny: recipes/tiny/*.yaml; llama_60m: recipes/llama_60m/*.yaml; paper: recipes/llama_*/",
    )
    ap.add_argument(
        "--recipes", nargs="+", type=Path, default=[], help="recipe files (instead of / beside --grid)"
    )
    ap.add_argument(
        "--tokens",
        type=int,
        help="token budget per final run (default for --grid tiny: 1,048,576 = 512 steps of 2,048 tokens)",
    )
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
        "--sweep",
        metavar="lr=POINTS",
        help="learning-rate sweep before the final runs: lr=x0.5,x1,x2 (multiples of each recipe's lr)"
        " or lr=1e-3,3e-3; the best lr per method (lowest val ppl, ties to the smaller) is carried over",
    )
    ap.add_argument("--sweep-tokens", type=int, help="token budget per sweep run (default: --tokens / 4)")
    ap.add_argument(
        "--sweep-seed", type=int, help="train.seed of the sweep runs (default: the first of --seeds)"
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="forked runs at once, each on cores / jobs torch threads (default 1)",
    )
    ap.add_argument(
        "--in-process", action="store_true", help="train in this process instead of a fork per run"
    )
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument(
        "--readme",
        type=Path,
        help="also rewrite the text between this markdown file's '<!-- leaderboard:start -->' and"
        " '<!-- leaderboard:end -->' markers with the top rows and the claims (README.md)",
    )
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


def _readme(args: argparse.Namespace, rows: Sequence[dict[str, Any]]) -> None:
    if args.readme is not None:
        changed = update_readme(args.readme, rows, _display_path(args.out))
        print(f"leaderboard: {'updated' if changed else 'unchanged'}: {args.readme}'s leaderboard section")


def _render_only(out: Path, plots: bool) -> list[dict[str, Any]]:
    """Re-collects DIR/runs (beside the rows of DIR/results.jsonl) or reads the results alone."""
    previous = read_jsonl(out / "results.jsonl") if (out / "results.jsonl").is_file() else []
    if not (out / "runs").is_dir() and not previous:
        raise BadInput(f"{out}: no runs/ and no results.jsonl; pass --grid or --recipes to run a grid")
    names = sorted(p.name for p in (out / "runs").glob("*") if p.is_dir()) if (out / "runs").is_dir() else []
    rows = gather_rows(out, names, previous)
    publish(rows, out, plots=plots)
    print(f"leaderboard: rendered {len(rows)} rows into {out / 'LEADERBOARD.md'}")
    return rows


def _recipes_of(args: argparse.Namespace) -> list[Path]:
    recipes = grid_recipes(args.grid) if args.grid else []
    for r in args.recipes:
        if not r.is_file():
            raise BadInput(f"recipe not found: {r}")
        recipes.append(r)
    return recipes


def main(argv: Sequence[str] | None = None, runner: Runner | None = None) -> int:
    """The command line (see the module docstring); `runner` replaces the training of one run
    (tests), else runs are forked (or trained here with --in-process)."""
    args = _parse_args(argv)
    if args.paper:
        print(paper_report())
        return 0
    if args.out is None:
        raise BadInput("--out DIR is required (or use --paper)")
    out: Path = args.out
    if args.readme is not None:
        readme_span(args.readme)  # checked before anything trains
    if not args.grid and not args.recipes:
        _readme(args, _render_only(out, plots=not args.no_plots))
        return 0
    tokens = args.tokens if args.tokens is not None else GRID_TOKENS.get(args.grid or "")
    if tokens is None:
        raise BadInput("--tokens BUDGET is required to run a grid")
    if args.jobs < 1:
        raise BadInput(f"--jobs must be >= 1, got {args.jobs}")
    recipes = _recipes_of(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    seeds = _int_list(args.seeds, "--seeds")
    if not seeds:
        raise BadInput("--seeds: expected at least one seed")
    overrides = [*GRID_OVERRIDES.get(args.grid or "", ()), *args.overrides]
    plan = functools.partial(
        plan_runs, recipes, methods=methods, extra_overrides=overrides, eval_points=args.eval_points
    )
    sweep: list[RunSpec] = []
    if args.sweep:
        sweep_tokens = args.sweep_tokens if args.sweep_tokens is not None else max(1, tokens // 4)
        sweep_seed = args.sweep_seed if args.sweep_seed is not None else seeds[0]
        sweep = plan(sweep_tokens, [sweep_seed], sweep=parse_sweep(args.sweep))
    final = plan(tokens, seeds)  # at the recipes' lr: the budget is the same at any lr
    for w in budget_warnings([*sweep, *final]):
        print(f"warning: {w}", file=sys.stderr)
    print(
        f"leaderboard: plan: {len(sweep)} sweep runs ({sum(s.steps * s.tokens_per_step for s in sweep):,} tokens)"
        f" + {len(final)} final runs ({sum(s.steps * s.tokens_per_step for s in final):,} tokens)"
    )
    previous = read_jsonl(out / "results.jsonl") if (out / "results.jsonl").is_file() else []
    finished = {r["run"]: r for r in previous}
    runner = runner or (train_spec if args.in_process else None)
    names = [s.name for s in sweep]

    current = {r["run"]: r for r in previous}

    def save(spec: RunSpec) -> None:
        # results.jsonl grows run by run: commit it while a long grid goes on.
        _merge_run(current, out / "runs" / spec.name)
        write_jsonl([current[k] for k in sorted(current)], out / "results.jsonl")

    failed = run_grid(sweep, out, runner, finished=finished, jobs=args.jobs, after_each=save)["failed"]
    if sweep:
        planned = set(names)  # the sweep rows of this grid, not those of an earlier, other sweep
        choices = select_lrs(r for r in gather_rows(out, names, previous) if r["run"] in planned)
        for c in choices.values():
            note = f" (edge of grid: {c.edge} lr; widen it)" if c.edge else ""
            print(
                f"leaderboard: {c.method} on {c.model}: lr {fmt_lr(c.lr)}{note}"
                if c.lr
                else f"leaderboard: {c.method} on {c.model}: no sweep run finished, no final runs"
            )
        final = plan(tokens, seeds, lrs={k: c.lr for k, c in choices.items() if c.lr is not None})
    names += [s.name for s in final]
    failed += run_grid(final, out, runner, finished=finished, jobs=args.jobs, after_each=save)["failed"]
    rows = gather_rows(out, names, previous)
    publish(rows, out, plots=not args.no_plots)
    print(f"leaderboard: wrote {out / 'results.jsonl'} and {out / 'LEADERBOARD.md'}")
    _readme(args, rows)
    print(render_table_only(rows))
    return 1 if failed else 0


def paper_report(recipes_root: Path | None = None) -> str:
    """The --paper document: what produced it (command, commit, machine), then the table of
    `effpretrain.paper` computed from the paper recipes under `recipes_root` (default `RECIPES`)."""
    import torch

    from effpretrain.memory import published as paper
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


README_START = "<!-- leaderboard:start"
README_END = "<!-- leaderboard:end -->"


def readme_summary(rows: Sequence[dict[str, Any]], source: str, top: int = 10) -> str:
    """The README's leaderboard excerpt, a pure function of the rows: per model the `top` final
    runs (rank, method, lr, perplexity over seeds, difference from the baseline, measured peak
    tensor memory and optimizer state) and every claim's verdict with its numbers.

    Args:
        rows: results.jsonl rows.
        source: the folder the rows come from, as the excerpt names it (a relative path).
        top: how many ranked methods to show per model.
    """
    ok = [r for r in rows if _is_ok(r)]
    final = [r for r in ok if _phase(r) == "final"]
    commits = sorted({r.get("git_commit") or "unknown" for r in ok})
    hardware = sorted({r.get("hardware") or "unknown" for r in ok})
    out = [
        f"Generated from `{source}/results.jsonl` by `benchmarks/leaderboard.py --out {source}"
        f" --readme README.md` ({len(final)} final and {len(ok) - len(final)} sweep runs; hardware:"
        f" {'; '.join(hardware) or '-'}; commits: {', '.join(commits) or '-'}). The full table, the"
        f" sweep and the budgets are in `{source}/LEADERBOARD.md`.",
        "",
    ]
    groups = _groups(ok)
    if not groups:
        out += ["No final run has finished yet: the study is still in its learning-rate sweep.", ""]
    for model, gs in groups.items():
        base = next((g for g in gs if g.method == BASELINE), None)
        shown = gs[:top]
        out += [
            f"**{model}**: the {len(shown)} best of {len(gs)} methods by mean validation perplexity.",
            "",
            f"| # | method | lr | val ppl | vs {BASELINE} | peak tensor memory | optimizer state |",
            "|---|---|---|---|---|---|---|",
        ]
        for rank, g in enumerate(shown, 1):
            cells = [
                *_ranked_cells(rank, g, base),
                fmt_bytes(g.mean("measured", "peak")),
                fmt_bytes(g.mean("measured", "optimizer_state")),
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    claims = evaluate_claims(ok)
    if claims:
        out += [f"The benchmark's claims ({NOISE_RULE}):", "", *_claim_table(claims)]
    return "\n".join(out)


def readme_span(readme: Path) -> tuple[str, int, int]:
    """`readme`'s text and the (start, end) offsets of the text between its leaderboard markers;
    bad input when the file or a marker is missing."""
    if not readme.is_file():
        raise BadInput(f"--readme: {readme} not found")
    text = readme.read_text()
    start = text.find(README_START)
    end = text.find(README_END, start + 1) if start >= 0 else -1
    if start < 0 or end < 0 or "\n" not in text[start:end]:
        raise BadInput(f"--readme: {readme} lacks the markers '{README_START} -->' and '{README_END}'")
    return text, text.index("\n", start) + 1, end


def update_readme(readme: Path, rows: Sequence[dict[str, Any]], source: str) -> bool:
    """Replaces the text between the README's leaderboard markers with `readme_summary`; returns
    whether the file changed. Missing markers are bad input (nothing is written)."""
    text, body_at, end = readme_span(readme)
    new = text[:body_at] + readme_summary(rows, source) + text[end:]
    if new != text:
        readme.write_text(new)
    return new != text


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

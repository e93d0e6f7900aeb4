"""Running the plan: each run trained in a forked copy of this process (crashes isolated, its own peak memory), N at once, resumable."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from leaderboard.collect import ResultRow, cpu_description
from leaderboard.common import ERROR_FILE, ROOT, RUN_RECORD, TIMING_FILE
from leaderboard.plan import RunSpec

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
    pool = _ForkPool(threads, on_done)

    def forward_sigterm(signum: int, _frame: Any) -> None:
        # An orphaned child would train on: pass the signal on, it saves a checkpoint and stops.
        pool.interrupted = True
        for child, _ in pool.running.values():
            os.kill(child.pid, signum)

    try:
        old_handler = signal.signal(signal.SIGTERM, forward_sigterm)
    except ValueError:  # not the main thread: signals stay with whoever owns them
        old_handler = None
    pending = list(items)
    try:
        while pending or pool.running:
            while pending and len(pool.running) < jobs and not pool.interrupted:
                spec, run_dir = pending.pop(0)
                on_start(spec)
                pool.start(spec, run_dir)
            if not pool.running:
                break
            pool.collect_ended()
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
    if pool.interrupted:
        raise KeyboardInterrupt


class _ForkPool:
    """The running forked children of `run_forked`, each with the read end of its pipe."""

    def __init__(self, threads: int | None, on_done: Callable[[RunSpec, BaseException | None], None]):
        import multiprocessing as mp

        self.ctx, self.threads, self.on_done = mp.get_context("fork"), threads, on_done
        self.running: dict[Any, tuple[Any, RunSpec]] = {}
        self.interrupted = False

    def start(self, spec: RunSpec, run_dir: Path) -> None:
        recv, send = self.ctx.Pipe(duplex=False)
        child = self.ctx.Process(
            target=_child_main, args=(spec, run_dir, send, self.threads), name=f"leaderboard-{spec.name}"
        )
        child.start()
        send.close()  # the child holds the only write end now: EOF as soon as it dies
        self.running[recv] = (child, spec)

    def collect_ended(self) -> None:
        """Waits for some child to end and reports each ended one's outcome."""
        from multiprocessing.connection import wait

        try:
            ready = wait(list(self.running))
        except KeyboardInterrupt:
            # Ctrl-C reaches the children too; each finishes its step and saves: wait for them.
            self.interrupted = True
            return
        for conn in ready:
            child, spec = self.running.pop(conn)
            try:
                msg = conn.recv()
            except EOFError:
                msg = None
            except KeyboardInterrupt:
                self.interrupted, msg = True, None
            child.join()
            conn.close()
            # After Ctrl-C or SIGTERM a child's end is its interruption, not a failure to record.
            outcome = KeyboardInterrupt() if self.interrupted else _outcome(child.exitcode, msg)
            self.interrupted = self.interrupted or isinstance(outcome, KeyboardInterrupt)
            self.on_done(spec, outcome)


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
    todo = [s for s in specs if _done_before(s, out, finished) is None]
    pool = runner is None and sys.platform.startswith("linux") and not _cuda_initialised()
    if runner is None:
        runner = forked_runner if sys.platform.startswith("linux") else train_spec
    if pool and todo:
        prewarm_imports()
    grid = _GridProgress(specs, len(todo), out, log, clock, after_each)
    log(f"leaderboard: {len(specs)} runs, {len(specs) - len(todo)} already finished, {len(todo)} to run")
    for spec in specs:
        why = _done_before(spec, out, finished)
        if why is not None:
            stale = _stale_note(spec, out / "runs" / spec.name, finished.get(spec.name))
            log(f"[{grid.index[spec.name]}/{grid.n}] {spec.name}: skipped ({why}){stale}")
            grid.result["skipped"].append(spec.name)
        elif not (pool and jobs > 1):  # (else started by the pool below, in plan order)
            grid.run_one(spec, runner)
    if pool and jobs > 1:
        threads = max(1, _cores() // jobs)
        run_forked([(s, out / "runs" / s.name) for s in todo], jobs, threads, grid.on_start, grid.on_done)
    result = grid.result
    log(
        f"leaderboard: {len(result['done'])} ran, {len(result['skipped'])} skipped, "
        f"{len(result['failed'])} failed, in {_fmt_duration(clock() - grid.start)}"
    )
    return result


def _done_before(spec: RunSpec, out: Path, finished: Mapping[str, dict[str, Any]]) -> str | None:
    """Why `spec` need not run (its summary exists, or results.jsonl holds it finished), or None."""
    if (out / "runs" / spec.name / "summary.json").is_file():
        return "summary.json exists"
    return "in results.jsonl" if (finished.get(spec.name) or {}).get("status") == "ok" else None


class _GridProgress:
    """The grid's progress lines (elapsed time, ETA) and its done / skipped / failed lists."""

    def __init__(
        self,
        specs: Sequence[RunSpec],
        todo: int,
        out: Path,
        log: Callable[[str], None],
        clock: Callable[[], float],
        after_each: Callable[[RunSpec], None] | None,
    ):
        self.n, self.todo, self.out, self.log, self.clock = len(specs), todo, out, log, clock
        self.after_each, self.start = after_each, clock()
        self.index = {s.name: i for i, s in enumerate(specs, 1)}
        self.t0: dict[str, float] = {}
        self.result: dict[str, list[str]] = {"done": [], "skipped": [], "failed": []}

    def run_one(self, spec: RunSpec, runner: Runner) -> None:
        """Runs `spec` in this process's turn (a KeyboardInterrupt stops the grid)."""
        self.on_start(spec)
        try:
            runner(spec, self.out / "runs" / spec.name)
        except KeyboardInterrupt:
            self.on_done(spec, KeyboardInterrupt())
            raise
        except Exception as e:
            self.on_done(spec, e)
        else:
            self.on_done(spec, None)

    def on_start(self, spec: RunSpec) -> None:
        ran = len(self.result["done"]) + len(self.result["failed"])
        elapsed = self.clock() - self.start
        eta = f", ETA {_fmt_duration(elapsed / ran * (self.todo - ran))}" if ran else ""
        self.log(
            f"[{self.index[spec.name]}/{self.n}] {spec.name}: {spec.steps} steps ({spec.recipe}), "
            f"elapsed {_fmt_duration(elapsed)}{eta}"
        )
        _prepare_run_dir(spec, self.out / "runs" / spec.name)
        self.t0[spec.name] = self.clock()

    def on_done(self, spec: RunSpec, error: BaseException | None) -> None:
        i, took = self.index[spec.name], _fmt_duration(self.clock() - self.t0[spec.name])
        if isinstance(error, KeyboardInterrupt):
            self.log(f"[{i}/{self.n}] {spec.name}: interrupted; run the same command again to resume")
            return
        if error is None:
            self.log(f"[{i}/{self.n}] {spec.name}: done in {took}")
            self.result["done"].append(spec.name)
        else:
            msg = str(error).strip() or type(error).__name__
            (self.out / "runs" / spec.name / ERROR_FILE).write_text(msg + "\n")
            self.log(f"[{i}/{self.n}] {spec.name}: FAILED after {took}: {msg.splitlines()[0]}")
            self.result["failed"].append(spec.name)
        if self.after_each is not None:
            self.after_each(spec)


def _stale_note(spec: RunSpec, run_dir: Path, row: ResultRow | None = None) -> str:
    try:
        old = json.loads((run_dir / "summary.json").read_text()).get("config_hash")
    except (OSError, ValueError):
        old = (row or {}).get("config_hash")
    if old and old != spec.config_hash:
        return f"; WARNING: it was made with another config ({old} != {spec.config_hash}); delete it to rerun"
    return ""

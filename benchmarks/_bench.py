"""Shared by the benchmark scripts: progress lines, where a result came from, result files, and
timing, and cases run under a wall-clock budget (`run_cases`). Every script writes its figures with `write_result`, which puts `provenance` (commit,
machine, device, torch and CUDA versions, UTC date) beside them, so no number lands without the
commit and machine it came from."""

from __future__ import annotations

import datetime as dt
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from effpretrain.reporting import cpu_description, device_name, git_commit

__all__ = [
    "Budget",
    "Missing",
    "Skipped",
    "log",
    "missing_module",
    "needs_package",
    "provenance",
    "run_cases",
    "seconds",
    "write_result",
]


def log(msg: str) -> None:
    """A progress line on stderr (stdout stays the result)."""
    print(msg, file=sys.stderr, flush=True)


def provenance(device: str | None = None) -> dict[str, Any]:
    """Where a result came from: commit, machine (CPU model and cores), torch, UTC date; with a
    `device`, its name and the CUDA version too."""
    out = {
        "commit": git_commit(),
        "machine": cpu_description(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device is not None:
        out.update(device=device_name(torch.device(device)), cuda=torch.version.cuda)
    return out


def write_result(path: Path, result: dict[str, Any], indent: int = 1) -> None:
    """Writes `result` as JSON to `path` (folders made), with `provenance` first unless the result
    carries its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = result if "commit" in result else {**provenance(), **result}
    path.write_text(json.dumps(payload, indent=indent) + "\n")


def seconds(
    fn: Callable[[], Any], repeats: int, warmup: int = 1, sync: Callable[[], None] | None = None
) -> float:
    """The median wall time of `fn()` over `repeats` calls after `warmup` untimed ones; `sync`
    (a device synchronisation) runs before each clock read."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------
# Cases under a wall-clock budget


class Skipped(Exception):
    """A case or section that cannot run here for a reason other than a missing package: reported,
    not a failure."""


class Missing(Exception):
    """A case or section whose package is not installed: reported as "missing" (never as skipped,
    so an incomplete install does not read as a complete run)."""


class Budget:
    """Wall-clock budget of the whole check: a case starts only with enough time left."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, cost_s: float) -> bool:
        return self.left() >= cost_s


def missing_module(err: BaseException) -> str | None:
    """The top-level package that a ModuleNotFoundError names, looked for along the chain of causes
    (the optimizers re-raise a missing bitsandbytes as an ImportError with a hint), or None: an
    ImportError that is not a missing package (a name missing from a module) is a failure."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ModuleNotFoundError) and seen.name:
            return seen.name.split(".")[0]
        seen = seen.__cause__ or seen.__context__
    return None


def needs_package(err: ImportError) -> Missing | ImportError:
    """A case's missing package as `Missing`, naming it; `err` itself when it is not one."""
    name = missing_module(err)
    return Missing(f"needs {name} (not installed)") if name else err


def run_cases(
    cases: list[tuple[str, float, Callable[[], dict[str, Any]]]], budget: Budget
) -> list[dict[str, Any]]:
    """Runs (label, expected seconds, case) in order: each gives a row, or a row saying it was
    skipped (with why), missing a package (`Missing`, or a ModuleNotFoundError), not reached (the
    budget), or failed (the error's last line)."""
    rows = []
    for label, cost, case in cases:
        if not budget.allows(cost):
            rows.append({"case": label, "status": "not reached", "note": f"{budget.left():.0f} s left"})
            continue
        log(f"  {label}")
        t0 = time.monotonic()
        try:
            row = {"case": label, "status": "ok", **case()}
        except Skipped as e:
            row = {"case": label, "status": "skipped", "note": str(e)}
        except Missing as e:
            row = {"case": label, "status": "missing", "note": str(e)}
        except Exception as e:  # a failure is reported and the check goes on
            name = missing_module(e) if isinstance(e, ImportError) else None
            if name is not None:
                row = {"case": label, "status": "missing", "note": f"needs {name} (not installed)"}
            else:
                traceback.print_exc(file=sys.stderr)
                row = {
                    "case": label,
                    "status": "failed",
                    "note": f"{type(e).__name__}: {str(e).splitlines()[0]}",
                }
        row["seconds"] = round(time.monotonic() - t0, 1)
        rows.append(row)
    return rows

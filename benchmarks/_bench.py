"""Shared by the benchmark scripts: progress lines, where a result came from, result files, and
timing. Every script writes its figures with `write_result`, which puts `provenance` (commit,
machine, device, torch and CUDA versions, UTC date) beside them, so no number lands without the
commit and machine it came from."""

from __future__ import annotations

import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from effpretrain.reporting import cpu_description, device_name, git_commit

__all__ = ["log", "provenance", "seconds", "write_result"]


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

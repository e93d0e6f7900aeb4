"""Pre-flight: refuse a run whose estimated peak cannot fit, before anything is built."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from effpretrain.errors import ConfigError


def device_memory_limit(device: torch.device) -> tuple[int, str]:
    """Bytes one process may use on `device`, and what that figure is.

    CUDA: the device's total memory. CPU: the available RAM (``MemAvailable`` from
    /proc/meminfo, else free pages x page size) divided by the processes on this machine
    (``LOCAL_WORLD_SIZE``), since they share it.
    """
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory), f"{device} total memory"
    avail = _mem_available()
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    what = "available RAM" + (f" / {local} local processes" if local > 1 else "")
    return avail // local, what


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def biggest_term(est: Any) -> tuple[str, int]:
    """The largest term of an `effpretrain.memory.Estimate`'s peak (its ``peak_terms`` when the
    estimator gives them, else the largest of weights, grads, optimizer state, activations)."""
    terms = est.detail.get("peak_terms") or {
        "weights": est.weights,
        "grads": est.grads,
        "optimizer_state": est.optimizer_state,
        "activations": est.activations,
    }
    name = max(terms, key=lambda k: terms[k])
    return name, int(terms[name])


def check_fits(est: Any, device: torch.device) -> None:
    """ConfigError (one line: the estimate, the limit, the biggest term) when the estimate's
    per-rank peak (``peak``; ``total`` for an estimator without one) exceeds
    `device_memory_limit`."""

    peak = int(getattr(est, "peak", est.total))
    limit, what = device_memory_limit(device)
    if peak <= limit:
        return
    name, size = biggest_term(est)
    raise ConfigError(
        f"estimated peak memory {peak / 1e9:.2f} GB per process exceeds {what}, {limit / 1e9:.2f} GB "
        f"(biggest term: {name} {size / 1e9:.2f} GB); reduce the batch, use activation checkpointing, "
        "or pass --allow-oversubscribe to run anyway"
    )


__all__ = ["biggest_term", "check_fits", "device_memory_limit"]

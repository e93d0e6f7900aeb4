"""Pre-flight: refuse a run whose estimated peak cannot fit, before anything is built (on a GPU:
into its free memory less a stated reserve, `cuda_memory_limit`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from effpretrain.errors import ConfigError

MiB = 2**20

#: Bytes held back on a GPU for what the estimate does not count and this check cannot see yet
#: (they appear after it, when the run first multiplies or launches a kernel): cuBLAS's workspace,
#: up to 32 MiB per handle and stream (torch's default on Hopper and later, 4096 KiB x 8, which
#: `train.deterministic` also sets; 8 MiB on older GPUs), for each stream a run uses (the default
#: one, FSDP2's, the in-backward hooks'), cuDNN's workspace, and the kernel images CUDA loads
#: lazily at their first launch (torch's, NCCL's, Triton's): an allowance of 512 MiB in all.
CUDA_RESERVE_BYTES = 512 * MiB
#: With several processes, NCCL's communicator buffers (NCCL_BUFFSIZE, 4 MiB by default, per
#: channel, peer and protocol; up to 32 channels over NVLink, 2 peers per ring channel) and its
#: proxy's host-mapped memory: 1 GiB more.
NCCL_RESERVE_BYTES = 1024 * MiB
#: The caching allocator's fragmentation: requests are rounded up to 512 B, those up to 1 MiB share
#: 2 MiB segments, up to 10 MiB 20 MiB segments, larger ones are rounded to 2 MiB, and a cached
#: block is split only for a request that fits it, so the memory the allocator reserves runs above
#: the allocated peak: an allowance of 5% of the free memory.
FRAGMENTATION = 0.05


def cuda_memory_limit(free: int, total: int, processes: int = 1) -> tuple[int, str]:
    """Bytes one process may plan to allocate on a GPU with `free` of `total` bytes free now
    (``torch.cuda.mem_get_info``: after this process's CUDA context and whatever other processes
    hold), and what that figure is: ``free - CUDA_RESERVE_BYTES - (NCCL_RESERVE_BYTES if
    processes > 1) - FRAGMENTATION * free``, at least 0."""
    reserve = CUDA_RESERVE_BYTES + (NCCL_RESERVE_BYTES if processes > 1 else 0)
    limit = max(int(free - reserve - FRAGMENTATION * free), 0)
    what = (
        f"free GPU memory {free / 1e9:.2f} of {total / 1e9:.2f} GB less {reserve / 1e9:.2f} GB "
        f"(CUDA{' and NCCL' if processes > 1 else ''} buffers) and {FRAGMENTATION:.0%} (fragmentation)"
    )
    return limit, what


def device_memory_limit(device: torch.device) -> tuple[int, str]:
    """Bytes one process may use on `device`, and what that figure is.

    CUDA: `cuda_memory_limit` of the device's free memory now (the CUDA context, other
    processes' memory and a reserve for buffers the estimate does not count taken off, not its
    total memory), with NCCL's reserve when ``WORLD_SIZE`` > 1. CPU: the available RAM
    (``MemAvailable`` from /proc/meminfo, else free pages x page size) divided by the processes
    on this machine (``LOCAL_WORLD_SIZE``), since they share it.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        world = max(int(os.environ.get("WORLD_SIZE", "1") or 1), 1)
        return cuda_memory_limit(int(free), int(total), world)
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


__all__ = [
    "CUDA_RESERVE_BYTES",
    "FRAGMENTATION",
    "NCCL_RESERVE_BYTES",
    "biggest_term",
    "check_fits",
    "cuda_memory_limit",
    "device_memory_limit",
]

"""Simple measured numbers: peak memory of the process or device, tensor bytes, saved-for-backward bytes."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from typing import Any

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the given tensors hold: sum of numel * element size."""
    return sum(t.numel() * t.element_size() for t in tensors)


def saved_tensor_bytes(fn: Any) -> tuple[int, Any]:
    """Bytes the autograd graph of `fn()` saves for backward (each distinct storage once, as it
    is held once), measured with `torch.autograd.graph.saved_tensors_hooks`; and `fn()`'s result.
    Works on any device, CPU included, where process RSS cannot tell tensors apart."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out

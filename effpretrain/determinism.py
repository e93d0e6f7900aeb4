"""`train.deterministic`: deterministic kernels for one run, restored when it ends.

On CPU the project's bitwise claims (a resumed run equals the straight one, DDP equals one
process, a compiled run split at a checkpoint equals the straight compiled run) hold without this:
every CPU kernel the runs use is deterministic. On CUDA several are not: attention's and
embeddings' backward accumulate with atomics (``index_add_``/``scatter_add_`` style kernels), cuBLAS
may pick a split-K algorithm whose reduction order depends on its workspace and stream, and cuDNN
autotunes. `deterministic` turns each of those off:

- ``torch.use_deterministic_algorithms(True)``: every op takes its deterministic kernel, and an
  op that has none raises a RuntimeError naming itself (never a silent fallback). It also fills
  ``torch.empty`` with NaN (``torch.utils.deterministic.fill_uninitialized_memory``), so reading
  uninitialised memory shows.
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (kept if already ``:4096:8`` or ``:16:8``): cuBLAS's
  reductions are deterministic only with a fixed workspace; torch refuses a cuBLAS call under
  deterministic algorithms without it. cuBLAS reads it when its handle's workspace is created, so
  it is set before anything in the run touches CUDA (the Accelerator, the model): a process that
  ran cuBLAS before `train()` keeps the workspace it had.
- ``torch.backends.cudnn.deterministic = True`` and ``benchmark = False``.

All four are put back as they were when the run returns or raises, so a later run in the same
process (tests, notebooks) is not changed by this one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

#: The cuBLAS workspace setting deterministic runs use (8 buffers of 4096 KiB; ``:16:8`` is the
#: smaller alternative NVIDIA documents, kept when the user set it).
CUBLAS_WORKSPACE = ":4096:8"
_DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")


@contextlib.contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    """With `enabled`, the run inside uses deterministic kernels (module docstring); without, it
    changes nothing (the process's own settings stay in force)."""
    if not enabled:
        yield
        return
    cudnn = torch.backends.cudnn
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn.deterministic,
        cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    if saved[4] not in _DETERMINISTIC_WORKSPACES:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        algorithms, warn_only, cudnn.deterministic, cudnn.benchmark, workspace = saved
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


__all__ = ["CUBLAS_WORKSPACE", "deterministic"]

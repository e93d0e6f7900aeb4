"""Full fp32 for the optimizers' matrix math, whatever the process's TF32 setting (torch only).

A float32 matrix product on an Ampere or later GPU runs in TF32 (10 explicit mantissa bits, about
3 decimal digits) when the process allows it: ``torch.backends.cuda.matmul.allow_tf32 = True``,
``torch.set_float32_matmul_precision("high")`` or ``"medium"``, or the newer per-backend
``torch.backends.{,cuda.matmul.,cudnn.}fp32_precision = "tf32"``; ``"medium"`` also lets oneDNN run
a CPU float32 product in bfloat16. Those settings are meant for a model's forward and backward. The
optimizers' own products are not such: a projection basis (the SVD's Gram, the randomized SVD's
sketches and Rayleigh-Ritz products), the projected gradient R = G P^T and its way back, Fira's
and APOLLO's norms of R, Newton-Schulz orthogonalisation and whitening, the refactorization's and
LORO's decompositions. In TF32 their relative error grows from about 1e-7 to 1e-3, enough to
change which singular directions a refresh keeps. `full_fp32` runs them at IEEE fp32.

cuBLAS reads the precision when a product is launched (torch passes it with each call), so
switching it around a computation affects exactly the products launched inside. The settings are
process-wide: another thread's products launched meanwhile run at fp32 too (the trainer launches
none then: an update in backward runs in the backward's own thread, between its kernels).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["full_fp32", "model_matmuls", "tf32_state"]

#: The (backend, op) pairs of torch's per-backend fp32 precision (torch >= 2.9) that `full_fp32`
#: pins to "ieee": CUDA products and cuDNN convolutions and RNNs; oneDNN's on the CPU.
_OPS: tuple[tuple[str, str], ...] = (
    ("cuda", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)
_NEW_API = hasattr(torch._C, "_get_fp32_precision_getter")


def _get(backend: str, op: str) -> str:
    return torch._C._get_fp32_precision_getter(backend, op)


def _set(backend: str, op: str, value: str) -> None:
    torch._C._set_fp32_precision_setter(backend, op, value)


def _read(getter: Callable[[], Any]) -> Any:
    """A legacy flag's value, or None where torch refuses to read it (a process that mixed the
    legacy and the per-backend APIs: torch then raises on the legacy getters)."""
    try:
        return getter()
    except RuntimeError:
        return None


def _capture() -> tuple[Any, Any, dict[tuple[str, str], str]]:
    """The precision settings `_restore` puts back: the legacy matmul precision and cuDNN flag
    (None where unreadable) and the effective per-backend precision of every op in `_OPS`."""
    legacy = _read(torch.get_float32_matmul_precision)
    cudnn = _read(lambda: torch.backends.cudnn.allow_tf32)
    ops = {key: _get(*key) for key in _OPS} if _NEW_API else {}
    return legacy, cudnn, ops


def _restore(saved: tuple[Any, Any, dict[tuple[str, str], str]]) -> None:
    legacy, cudnn, ops = saved
    if legacy is not None:
        torch.set_float32_matmul_precision(legacy)
    if cudnn is not None:
        torch._C._set_cudnn_allow_tf32(cudnn)
    for (backend, op), value in ops.items():
        if _get(backend, op) == value:
            continue
        # "none" inherits from the backend's and then the generic setting: where that gives the saved
        # value, the op was most likely inheriting it, and keeps following that setting afterwards.
        _set(backend, op, "none")
        if _get(backend, op) != value:
            _set(backend, op, value)


def _force_fp32() -> None:
    # The legacy setters keep the legacy and per-backend views consistent (torch raises on reading
    # a legacy flag that disagrees with the per-backend one); "highest" pins CUDA's and oneDNN's
    # matmul to "ieee". The per-backend ops are then pinned too, over a generic "tf32" setting.
    torch.set_float32_matmul_precision("highest")
    # torch._C's setter: torch.backends.cudnn's refuses after torch.backends.disable_global_flags().
    torch._C._set_cudnn_allow_tf32(False)
    if _NEW_API:
        for backend, op in _OPS:
            _set(backend, op, "ieee")


class _FullFP32(contextlib.ContextDecorator):
    """The context of `full_fp32` (one process-wide instance: the settings are process-wide).

    Nested and concurrent uses share one entry: the first to enter saves and forces the settings,
    the last to leave restores them, so a thread's inner block never restores under another's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: tuple[Any, Any, dict[tuple[str, str], str]] | None = None

    def __enter__(self) -> _FullFP32:
        with self._lock:
            if self._depth == 0:
                self._saved = _capture()
                _force_fp32()
            self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                saved, self._saved = self._saved, None
                assert saved is not None
                _restore(saved)


_FULL_FP32 = _FullFP32()


def full_fp32() -> _FullFP32:
    """A context (and decorator) in which float32 matrix products, convolutions and RNNs run at
    IEEE fp32 on CUDA and on oneDNN, whatever the caller enabled (TF32, or bf16 on oneDNN);
    the previous settings are restored on leaving.

    Inside: ``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.allow_tf32`` read
    False, ``torch.get_float32_matmul_precision()`` "highest", and (torch >= 2.9) the per-backend
    ``fp32_precision`` of CUDA's and oneDNN's matmul, conv and rnn "ieee". On leaving, each of those
    reads what it read before. (A process that set the legacy and the per-backend APIs
    inconsistently, where torch refuses to read a legacy flag, gets its per-backend precisions back
    and the legacy matmul precision "highest".)

    Used around every projection, orthogonalisation, whitening and refactorization computation in
    this package (`projection.compute_basis`, `projection.project`, the optimizers' ``step``, ...).
    Re-entering costs a lock and a counter; the first entry about twenty flag reads and writes.
    """
    return _FULL_FP32


def tf32_state() -> dict[str, Any]:
    """The TF32 settings a test or a report reads: the legacy matmul and cuDNN flags (None where
    torch refuses to read them) and, with torch >= 2.9, the per-backend precisions of `_OPS`."""
    legacy, cudnn, ops = _capture()
    out: dict[str, Any] = {
        "matmul_precision": legacy,
        "cuda_matmul_allow_tf32": None if legacy is None else legacy != "highest",
        "cudnn_allow_tf32": cudnn,
    }
    out.update({f"{b}.{o}": v for (b, o), v in ops.items()})
    return out


@contextlib.contextmanager
def model_matmuls(tf32: bool):
    """The model's float32 products (and cuDNN's) in TF32 when `tf32` (``train.tf32``), at IEEE
    fp32 otherwise, for the block's duration; the previous settings are restored after. The
    optimizers' math stays at fp32 either way (`full_fp32`)."""
    saved = _capture()
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    torch._C._set_cudnn_allow_tf32(bool(tf32))
    if _NEW_API:  # over a generic "tf32" set through the per-backend API
        for op in ("matmul", "conv", "rnn"):
            _set("cuda", op, "tf32" if tf32 else "ieee")
    try:
        yield
    finally:
        _restore(saved)

"""Tensor accounting: the one instrument effpretrain measures memory with, on any device.

A `StorageLog` gives every tensor storage it sees an id for its lifetime, its bytes, and a log of
allocations (+bytes) and releases (-bytes) in order, each with the phase it happened in, plus the
categories a caller files storages under (weights, gradients, optimizer_state, activations; a
storage shared by two counts in the first). `Meter`, a `TorchDispatchMode`, feeds it every
operator's storages: an output not seen before is an allocation, a `weakref.finalize` on the
storage records its release, and a storage first seen as an input existed before (``pre``).
Replaying the log gives the peak and what was live at that moment. Process RSS, which includes
the Python and torch runtime, plays no part; compiled code runs below any dispatch mode, so what
it allocates is not seen (measure such code eagerly).

Built on it: `effpretrain.memory.measure.measure_step` (one training step by category),
`saved_tensor_bytes` (what a call saves for backward), `measure_loss_bytes` (the loss's own
bytes); and two plain readings, `tensor_bytes` and `peak_memory_bytes`.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from effpretrain.data import IGNORE_INDEX
from effpretrain.loss import DEFAULT_CHUNK_TOKENS, LossKind, linear_cross_entropy
from optimizers._sharded import local as _local

__all__ = [
    "CATEGORIES",
    "Meter",
    "StorageLog",
    "accounting",
    "measure_loss_bytes",
    "peak_memory_bytes",
    "saved_tensor_bytes",
    "storage_of",
    "storages_of",
    "tensor_bytes",
    "watch_fsdp2_resizes",
]

#: The categories in priority order: a storage shared by two counts in the first.
CATEGORIES: tuple[str, ...] = ("weights", "gradients", "optimizer_state", "activations")


def storages_of(t: Any) -> list[torch.UntypedStorage]:
    """The storages behind `t`: its own (`storage_of`), or, for a tensor subclass that wraps others
    (an INT8 weight: its codes and scales), theirs."""
    if isinstance(t, torch.Tensor):
        inner = _local(t)
        if is_traceable_wrapper_subclass(inner):
            names, _ = inner.__tensor_flatten__()
            return [st for n in names for st in storages_of(getattr(inner, n))]
    st = storage_of(t)
    return [] if st is None else [st]


def storage_of(t: Any) -> torch.UntypedStorage | None:
    """The untyped storage behind `t` (a DTensor's local shard), or None when it has none."""
    if not isinstance(t, torch.Tensor):
        return None
    t = _local(t)
    if t.device.type == "meta" or is_traceable_wrapper_subclass(t):
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    # A fake tensor (FakeTensorMode, as `effpretrain.models.materialize` records a build on)
    # reports a real device but its storage is on the meta device: it holds no bytes.
    return st if st.nbytes() and st.device.type != "meta" else None


class StorageLog:
    """Every storage the step touches, each with an id for its lifetime, its bytes, and a log of
    allocations (+bytes) and releases (-bytes) in order, each with the phase it happened in."""

    def __init__(self) -> None:
        self.phase = "start"
        self.ids: dict[int, int] = {}  # StorageImpl address -> id, while alive
        self.nbytes: dict[int, int] = {}  # id -> bytes
        self.pre: set[int] = set()  # ids alive before the step
        self.log: list[tuple[int, int, str]] = []
        self.cats: dict[str, set[int]] = {c: set() for c in CATEGORIES}
        self.saved_live = 0
        self.saved_max = 0
        self.grad_live = 0  # gradient storages alive now (weights excluded: they outrank them)
        self.grad_max = 0
        self.grad_phase_max: dict[str, int] = {}  # the largest grad_live seen in each phase
        self._fins: dict[int, weakref.finalize] = {}

    def id_of(self, st: torch.UntypedStorage, allocated: bool) -> int:
        """The storage's id, registering it on first sight: as allocated now (logged) or as alive
        since before the step."""
        key = st._cdata
        sid = self.ids.get(key)
        if sid is None:
            sid = len(self.nbytes)
            self.ids[key], self.nbytes[sid] = sid, st.nbytes()
            if allocated:
                self.log.append((sid, self.nbytes[sid], self.phase))
            else:
                self.pre.add(sid)
            self._fins[sid] = weakref.finalize(st, self._release, key, sid)
        return sid

    def _release(self, key: int, sid: int) -> None:
        self.ids.pop(key, None)
        self._fins.pop(sid, None)
        self.log.append((sid, -self.nbytes[sid], self.phase))
        if sid in self.cats["activations"] and self._plain(sid):
            self.saved_live -= self.nbytes[sid]
        if sid in self.cats["gradients"] and sid not in self.cats["weights"]:
            self.grad_live -= self.nbytes[sid]

    def resized(self, st: torch.UntypedStorage) -> None:
        """FSDP2 resized `st` (to 0 bytes or back to full): its current id ends as a release, and
        a storage with bytes again starts a new one, as allocated now."""
        sid = self.ids.get(st._cdata)
        if sid is not None:
            self._fins[sid].detach()
            self._release(st._cdata, sid)
        if st.nbytes():
            self.id_of(st, allocated=True)

    def _plain(self, sid: int) -> bool:
        """Not weights, gradients or optimizer state (which outrank activations)."""
        return not any(sid in self.cats[c] for c in CATEGORIES[:3])

    def add(self, category: str, tensors: Iterable[Any], allocated: bool = False) -> None:
        for st in (st for t in tensors for st in storages_of(t)):
            sid = self.id_of(st, allocated)
            if category != "activations" and sid in self.cats["activations"] and self._plain(sid):
                # A saved storage that becomes a gradient (autograd keeps the chunked loss's saved
                # dW as the head's .grad) leaves the activations now: it is held as a gradient from
                # here on, across the next micro-steps of an accumulation.
                self.saved_live -= self.nbytes[sid]
            if category == "gradients" and sid not in self.cats[category] and sid not in self.cats["weights"]:
                self.grad_live += self.nbytes[sid]
                self.grad_max = max(self.grad_max, self.grad_live)
                top = self.grad_phase_max.get(self.phase, 0)
                self.grad_phase_max[self.phase] = max(top, self.grad_live)
            self.cats[category].add(sid)

    def saved(self, st: torch.UntypedStorage, allocated: bool) -> None:
        sid = self.id_of(st, allocated)
        if sid not in self.cats["activations"]:
            self.cats["activations"].add(sid)
            if self._plain(sid):
                self.saved_live += self.nbytes[sid]
                self.saved_max = max(self.saved_max, self.saved_live)

    def close(self) -> None:
        """Detaches the finalizers of storages that outlive the step."""
        for fin in list(self._fins.values()):
            fin.detach()
        self._fins.clear()

    def owned(self) -> dict[str, set[int]]:
        """Each category's ids, a shared storage kept only in the first category that has it."""
        seen: set[int] = set()
        out = {}
        for c in CATEGORIES:
            out[c] = self.cats[c] - seen
            seen |= out[c]
        return out

    def bytes_of(self, ids: Iterable[int]) -> int:
        return sum(self.nbytes[i] for i in ids)

    def replay(self, include_existing: bool = True) -> tuple[int, set[int], str]:
        """Peak live bytes over the log, the ids live at that moment and its phase. With
        `include_existing` False, storages alive before (``pre``) count neither at the start nor
        when released: the peak of what was allocated while logging alone."""
        counted = (lambda sid: True) if include_existing else (lambda sid: sid not in self.pre)
        cur = self.bytes_of(self.pre) if include_existing else 0
        peak, at, phase = cur, 0, "start"
        for i, (sid, delta, ph) in enumerate(self.log):
            if not counted(sid):
                continue
            cur += delta
            if cur > peak:
                peak, at, phase = cur, i + 1, ph
        live = set(self.pre) if include_existing else set()
        for sid, delta, _ in self.log[:at]:
            if delta > 0:
                live.add(sid)
            else:
                live.discard(sid)
        return peak, live, phase

    def phase_peaks(self, include_existing: bool = True) -> dict[str, int]:
        """The largest live total reached in each phase (as `replay` counts)."""
        cur = self.bytes_of(self.pre) if include_existing else 0
        out: dict[str, int] = {}
        for sid, delta, ph in self.log:
            if include_existing or sid not in self.pre:
                cur += delta
                out[ph] = max(out.get(ph, cur), cur)
        return out


class Meter(TorchDispatchMode):
    """Sees every operator: registers the storages it reads (alive before, if new) and writes."""

    def __init__(self, reg: StorageLog) -> None:
        super().__init__()
        self.reg = reg

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for t in pytree.tree_leaves((args, kwargs)):
            for st in storages_of(t):
                self.reg.id_of(st, allocated=False)
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            for st in storages_of(t):
                self.reg.id_of(st, allocated=True)
        return out


def watch_fsdp2_resizes(reg: StorageLog) -> list[tuple[Any, str, Any]]:
    """Wraps FSDP2's `alloc_storage` / `free_storage` (where this torch has them) so that each
    resize reaches `reg.resized`; returns (module, name, original) for each wrapped name."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    except ImportError:
        return []
    wrapped = []
    for module in (_fsdp_param, _fsdp_param_group):
        for name in ("alloc_storage", "free_storage"):
            old = getattr(module, name, None)
            if old is None:
                continue

            def resize(tensor: torch.Tensor, _old: Callable[[torch.Tensor], None] = old) -> None:
                _old(tensor)
                reg.resized(tensor.untyped_storage())

            setattr(module, name, resize)
            wrapped.append((module, name, old))
    return wrapped


@contextlib.contextmanager
def accounting(*existing: torch.Tensor) -> Iterator[StorageLog]:
    """Counts every storage created inside the block and what autograd saves for backward among
    them (``saved_live`` / ``saved_max``); the `existing` tensors (the inputs: weights, a batch)
    are filed as weights, so they never count as allocated or saved. The log stays readable after
    the block (``replay(include_existing=False)``: the peak of what the block allocated)."""
    log = StorageLog()
    log.add("weights", existing)

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = storage_of(t)
        if st is not None:
            log.saved(st, allocated=False)  # the dispatch mode saw it allocated, if it was
        return t

    try:
        with Meter(log), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield log
    finally:
        log.close()


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
    is held once, the inputs' included), and `fn()`'s result. Only the saved-tensor hooks run
    (no dispatch mode), so it works on any device and around any kernel, CPU included, where
    process RSS cannot tell tensors apart."""
    log = StorageLog()

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = storage_of(t)
        if st is not None:
            log.saved(st, allocated=False)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return log.bytes_of(log.cats["activations"]), out
    finally:
        log.close()


def measure_loss_bytes(
    kind: LossKind,
    tokens: int,
    vocab: int,
    hidden: int,
    act_dtype: torch.dtype = torch.float32,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignored_every: int = 0,
    seed: int = 0,
    param_dtype: torch.dtype = torch.float32,
) -> dict[str, int]:
    """Measured memory of one forward and backward of `effpretrain.loss.linear_cross_entropy` on
    CPU, in bytes, by `accounting`.

    H (tokens, hidden) and W (vocab, hidden) are `param_dtype` leaves (as the model's final norm
    output and head weight are: fp32, or bf16 in a bf16-pure run), the product runs in
    `act_dtype` (autocast when that differs from `param_dtype`); every
    `ignored_every`-th label is IGNORE_INDEX (0: none). Counted: the tensors the loss itself
    creates (not H, W, the labels), its gradients of H and W included.

    Returns:
        ``saved`` (new bytes autograd holds for backward at the end of the forward), ``peak`` (the
        largest live total at any moment of forward and backward), ``transient`` = peak - saved,
        and ``forward_peak``.
    """
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(param_dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(param_dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    if ignored_every:
        labels[::ignored_every] = IGNORE_INDEX
    auto = torch.autocast("cpu", dtype=act_dtype, enabled=act_dtype != param_dtype)
    with accounting(h, w, labels) as log:
        log.phase = "forward"
        with auto:
            s = linear_cross_entropy(h, w, labels, kind, chunk_tokens)
        saved = log.saved_live
        log.phase = "backward"
        s.backward()
        del s
    peak, _, _ = log.replay(include_existing=False)
    return {
        "saved": saved,
        "peak": peak,
        "transient": peak - saved,
        "forward_peak": log.phase_peaks(include_existing=False).get("forward", 0),
    }

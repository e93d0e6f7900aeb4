"""Measured memory of one training step, by category, on any device.

`measure_step(run_step, model, optimizer)` runs ``run_step()`` once (forward, backward, optimizer
step, zero_grad: whatever the callable does) and returns, in bytes per process:

- ``weights``: the distinct storages of the model's parameters and persistent buffers;
- ``gradients``: the most bytes of gradient storages alive at once: the distinct storages the
  parameters' ``.grad`` point into (all alive at the optimizer step; under DDP with
  ``gradient_as_bucket_view`` these are the communication buckets) and, with ``train.
  update_in_backward`` (`measure_step`'s `in_backward`), the engine's accumulators (full, or low
  rank between GaLore's refreshes) and the gradients in flight (each fresh micro-batch gradient
  and each final gradient), which are not ``.grad`` when the step ends: the measured peak
  gradient bytes;
- ``optimizer_state``: the distinct storages of the tensors in ``optimizer.state`` (equal to
  `optimizers.measured_state_bytes` when no state tensor is a view into a larger storage);
- ``activations``: the largest total, at any moment, of storages that autograd saved for
  backward (`torch.autograd.graph.saved_tensors_hooks`), which is reached when backward starts;
- ``peak``: the largest total of live tensor bytes during the step;
- ``temporaries``: ``peak`` minus the four categories' bytes live at the moment of the peak;
- ``phase_at_peak``: ``start``, ``forward`` (the loss included), ``backward`` (clipping included,
  and the optimizer's steps that run inside backward with ``train.update_in_backward``),
  ``optimizer_step`` or ``zero_grad`` (what follows the optimizer step);
- ``at_peak``: the four categories' bytes live at the peak moment; ``step``; ``device``.

A storage shared by several categories counts once, in the first of weights, gradients,
optimizer_state, activations. Each distinct storage counts its whole size (``nbytes``), as the
allocator holds it.

How it is measured:

- CPU (any non-CUDA device): tensor accounting (`effpretrain.memory.accounting`, the one
  instrument the project measures memory with). A `TorchDispatchMode` sees every operator; the
  storage of each output not seen before is an allocation, and a `weakref.finalize` on the
  storage records its release. Storages that existed before the step (weights, state, buffers,
  the batch, DDP's buckets) are counted from the step's start, found either up front (the
  categories) or when an operator first reads them. Replaying the allocation log gives the peak,
  the set of live storages at that moment and so the categories at the peak. Process RSS, which
  includes the Python and torch runtime, plays no part.
- CUDA: the caching allocator's ``max_memory_allocated``, reset at every phase boundary, gives the
  peak and its phase (all tensors on the device, as the allocator sees them); the categories come
  from the same storage accounting (no dispatch mode), and ``at_peak`` takes each category's larger
  value at the two boundaries of the peak's phase (an approximation: the allocator does not say
  which tensors were live at its peak).

Only the measured call runs under these hooks; every hook (forward pre-hook, saved-tensor hooks,
dispatch mode, finalizers, the optimizer's patched ``step``/``zero_grad``) is removed before
`measure_step` returns, so later steps run untouched.

FSDP2 frees a unit's unsharded parameters by resizing their storages to 0 bytes and allocates
them again by resizing back (`torch.distributed.fsdp._fully_shard._fsdp_param.free_storage` /
``alloc_storage``): the storage object lives on, so no finalizer would see the release. The
measured step wraps those two functions: a resize to 0 is a release (a tensor autograd saved in it
stops counting as an activation), a resize back a new allocation.

With `train.compile` the first step compiles the blocks (and on CUDA autotunes Triton's kernels,
whose buffers the allocator counts): the trainer's default measured steps and `measure_run` start
after it (`effpretrain.compile.COMPILE_WARMUP_STEPS`).
The CUDA measurement sees the compiled blocks as they run; tensor accounting
(CPU) cannot see inside compiled code (it runs below any dispatch mode), so there a measured step
runs the blocks eagerly (``torch.compiler.set_stance("force_eager")``) and its activations are
eager's. Weights, gradients and optimizer state are the same either way.

Under activation checkpointing (non-reentrant), the blocks' own saved tensors are held by the
checkpoint's frames, not by our saved-tensor hooks: ``activations`` then counts what is saved
outside the checkpointed blocks, and the inputs the checkpoints keep show up in ``temporaries``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from effpretrain.compile import COMPILE_WARMUP_STEPS
from effpretrain.config.checks import stochastic_rounding
from effpretrain.in_backward import InBackward
from effpretrain.memory.accounting import (
    CATEGORIES,
    Meter,
    StorageLog,
    peak_memory_bytes,
    storage_of,
    watch_fsdp2_resizes,
)
from effpretrain.memory.estimator import estimate_from_config
from effpretrain.optim_setup import build_optimizer_and_schedule
from effpretrain.run_model import build_run_model, make_train_step, place_model, synthetic_batch
from optimizers._sharded import local as _local
from optimizers.writer import Rounding, attach

__all__ = [
    "CATEGORIES",
    "MEASURED_KEYS",
    "device_key",
    "measure_run",
    "measure_step",
    "process_peak_bytes",
]

#: Phases during which autograd's graph (and what it saved) can be alive.
_GRAPH_PHASES = ("forward", "backward")
#: The byte fields of a measurement.
MEASURED_KEYS: tuple[str, ...] = (*CATEGORIES, "temporaries", "peak")


def _inner_optimizer(optimizer: Any) -> Any:
    """Below Accelerate's wrapper, as `optimizers.measured_state_bytes` reads it."""
    return getattr(optimizer, "optimizer", optimizer)


#: Per CUDA device (`device_key`), the allocator's largest peak that a measured step's resets took
#: away from ``max_memory_allocated`` (`process_peak_bytes` puts it back).
_CUDA_PEAK_FLOOR: dict[str, int] = {}


def _current_cuda_index() -> int:
    """The index a bare ``cuda`` means: the current CUDA device, 0 where CUDA is absent (as the
    allocator's functions resolve ``cuda`` without an index)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def device_key(device: torch.device | str, current_index: Callable[[], int] = _current_cuda_index) -> str:
    """One name per physical device, however it is spelled: ``cuda``, ``cuda:0``,
    ``torch.device("cuda", 0)`` and, with device 0 current, ``torch.device("cuda")`` all give
    ``cuda:0``. A measured step saves its floor under its parameters' device (``cuda:0``) and the
    trainer reads it under Accelerate's (``cuda`` on one GPU), so both go through this.
    `current_index` is what a CUDA device without an index means (injectable for tests)."""
    d = torch.device(device)
    if d.type != "cuda":
        return str(d)
    return f"cuda:{current_index() if d.index is None else d.index}"


def _raise_floor(device: torch.device) -> None:
    key = device_key(device)
    _CUDA_PEAK_FLOOR[key] = max(_CUDA_PEAK_FLOOR.get(key, 0), int(torch.cuda.max_memory_allocated(device)))


def process_peak_bytes(device: torch.device) -> int:
    """`effpretrain.memory.peak_memory_bytes` (CUDA max allocated, or the process's peak RSS),
    including the CUDA peaks from before a measured step's per-phase resets (saved under
    `device_key`, so any spelling of the device finds them)."""

    return max(peak_memory_bytes(device), _CUDA_PEAK_FLOOR.get(device_key(device), 0))


class _CudaPhases:
    """The allocator's peak per phase (reset at each boundary) and category snapshots there."""

    def __init__(self, device: torch.device, snapshot: Callable[[], dict[str, int]]) -> None:
        self.device, self.snapshot = device, snapshot
        self.peaks: list[tuple[int, str, dict[str, int], dict[str, int]]] = []
        _raise_floor(device)
        torch.cuda.reset_peak_memory_stats(device)
        self.start = snapshot()

    def boundary(self, phase: str) -> None:
        end = self.snapshot()
        self.peaks.append((int(torch.cuda.max_memory_allocated(self.device)), phase, self.start, end))
        _raise_floor(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.start = end

    def result(self) -> tuple[int, str, dict[str, int]]:
        peak, phase, a, b = max(self.peaks, key=lambda p: p[0])
        return peak, phase, {c: max(a[c], b[c]) for c in CATEGORIES}


class _Step:
    """The hooks of one measured step: phase changes and category collection."""

    def __init__(
        self, model: torch.nn.Module, optimizer: Any, device: torch.device, in_backward: Any = None
    ) -> None:
        self.model, self.opt, self.reg = model, _inner_optimizer(optimizer), StorageLog()
        self.inb = in_backward
        self.cuda = _CudaPhases(device, self._snapshot) if device.type == "cuda" else None

    def params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def collect(self, weights: bool = False) -> None:
        """Registers the storages of the current gradients and optimizer state, and with `weights`
        those of the parameters and persistent buffers: only outside forward and backward, where
        FSDP2's modules hold gathered copies of their parameters (and state_dict() would put the
        sharded ones back in the middle of a forward)."""
        reg = self.reg
        if weights:
            reg.add("weights", self.params())
            reg.add("weights", _persistent_buffers(self.model))
        reg.add("gradients", (p.grad for p in self.params() if p.grad is not None))
        reg.add("optimizer_state", (v for st in self.opt.state.values() for v in st.values()))

    def enter(self, phase: str) -> None:
        if phase == self.reg.phase:
            return
        self.collect()
        if self.cuda is not None:
            self.cuda.boundary(self.reg.phase)
        self.reg.phase = phase

    def _snapshot(self) -> dict[str, int]:
        """Bytes of each category alive now (CUDA's boundaries)."""
        self.collect()
        owned = self.reg.owned()
        alive = set(self.reg.ids.values())
        snap = {c: self.reg.bytes_of(owned[c] & alive) for c in CATEGORIES[:3]}
        snap["activations"] = self.reg.saved_live
        return snap

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Installs every hook of the measured step and removes all of them on the way out."""
        pre = self.model.register_forward_pre_hook(lambda *_: self.enter("forward"))
        patched = {}
        for name, phase in (("step", "optimizer_step"), ("zero_grad", "zero_grad")):
            patched[name] = self.opt.__dict__.get(name)
            setattr(self.opt, name, self._entering(phase, getattr(self.opt, name)))
        allocated = self.cuda is not None  # on CPU the dispatch mode has seen the allocation

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = storage_of(t)
            if st is not None:
                self.reg.saved(st, allocated)
            return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            if self.reg.phase == "forward":
                self.enter("backward")
            return t

        watched = self._watch_in_backward()
        resizes = watch_fsdp2_resizes(self.reg)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            for module, name, old in resizes:
                setattr(module, name, old)
            pre.remove()
            for name, old in patched.items():
                if old is None:
                    self.opt.__dict__.pop(name, None)
                else:
                    setattr(self.opt, name, old)
            for name in watched:
                self.inb.__dict__.pop(name, None)

    def _watch_in_backward(self) -> list[str]:
        """With an `effpretrain.in_backward.InBackward`, classifies as gradients, when its hook
        handles them, each fresh micro-batch gradient (``p.grad`` as the hook finds it), each
        accumulator it keeps (full or low rank, `InBackward._acc`) and each final gradient: none
        of them is ``.grad`` at a phase boundary. Wraps the instance's ``_accumulate`` and
        ``_final_grad`` (removed on the way out); returns the wrapped names."""
        inb = self.inb
        if inb is None:
            return []
        names = ["_accumulate", "_final_grad"]
        missing = [n for n in names if not callable(getattr(type(inb), n, None))]
        if missing or not isinstance(getattr(inb, "_acc", None), dict):
            raise TypeError(f"measure_step: {type(inb).__name__} has no {missing or ['_acc']}")
        reg, allocated = self.reg, self.cuda is not None
        accumulate, final_grad = inb._accumulate, inb._final_grad

        def watched_accumulate(p: torch.Tensor) -> None:
            reg.add("gradients", [p.grad], allocated)
            accumulate(p)
            held = inb._acc.get(id(p))
            reg.add("gradients", [held[0]] if held is not None else [], allocated)

        def watched_final_grad(p: torch.Tensor) -> torch.Tensor:
            reg.add("gradients", [p.grad], allocated)
            grad = final_grad(p)
            reg.add("gradients", [grad], allocated)
            return grad

        inb._accumulate, inb._final_grad = watched_accumulate, watched_final_grad
        return names

    def _entering(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # its signature too: Accelerate inspects zero_grad's parameters
        def call(*args: Any, **kwargs: Any) -> Any:
            if not _inside_backward():  # in-backward updates step inside the backward phase
                self.enter(phase)
            return fn(*args, **kwargs)

        return call


def _inside_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a hook's call)."""
    return torch._C._current_graph_task_id() != -1


def _persistent_buffers(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The buffers a state_dict holds (SLTrain's sparse index; not rotary's inv_freq)."""
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                yield b


def _device(model: torch.nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return _local(p).device if p is not None else torch.device("cpu")


def measure_step(
    run_step: Callable[[], Any],
    model: torch.nn.Module,
    optimizer: Any,
    step: int = 0,
    in_backward: Any = None,
) -> dict:
    """Runs ``run_step()`` once under memory accounting and returns its breakdown (module
    docstring): weights, gradients, optimizer_state, activations, temporaries, peak (bytes),
    at_peak, phase_at_peak, step (`step`, as given) and device.

    Args:
        run_step: one training step (its return value is discarded).
        model: the model it trains (a DDP or FSDP2 wrapper is fine).
        optimizer: the optimizer it steps (Accelerate's wrapper is fine); its ``step`` and
            ``zero_grad`` mark the phases.
        step: the step number to record.
        in_backward: the run's `effpretrain.in_backward.InBackward` (``train.update_in_backward``),
            whose accumulators and gradients in flight then count as gradients.
    """
    device = _device(model)
    rec = _Step(model, optimizer, device, in_backward)
    meter = Meter(rec.reg) if rec.cuda is None else contextlib.nullcontext()
    # Compiled code runs below any dispatch mode, so tensor accounting cannot see inside it:
    # compiled blocks (`train.compile`) run eagerly in a step measured that way.
    stance = torch.compiler.set_stance("force_eager") if rec.cuda is None else contextlib.nullcontext()
    try:
        with rec.hooks(), meter, stance:
            rec.collect(weights=True)
            run_step()
            rec.collect(weights=True)
            rec.enter("end")
        return _result(rec, step, device)
    finally:
        rec.reg.close()


def measure_run(
    cfg: Any, vocab_size: int, steps: int = 2, seed: int = 0, device: torch.device | str = "cpu"
) -> list[dict]:
    """Builds `cfg`'s model and optimizer as the trainer does (placed by `run_model.place_model`:
    its precision, its activation checkpointing as the estimator plans it, `train.compile`) and
    measures its first `steps` steps on one random batch, without data loading: one `measure_step`
    breakdown per step. Each step clips at the run's `train.grad_clip` (0: not at all) with the
    trainer's own norm (`run_model.make_train_step`). Step 0 builds the optimizer state (and a
    projecting method's first basis: a refresh step); from step 1 the state exists before the
    forward (the steady state). With `train.compile` the first
    `effpretrain.compile.COMPILE_WARMUP_STEPS` steps run unmeasured before them (they compile
    the blocks; on CUDA Triton's autotuning buffers would be in their peak), as the trainer's
    default `train.memory_steps` skip them: the breakdowns are then of steps 1, 2, ... With
    ``train.update_in_backward`` the step runs as the trainer's does (an
    `effpretrain.in_backward.InBackward` steps each parameter inside backward; its hooks are
    removed before returning). Weights stored in fewer bits round each update as the trainer's
    do (`optimizers.writer`). Tests and benchmarks compare these with the estimate.

    Args:
        cfg: a loaded `effpretrain.config.RunConfig`.
        vocab_size: the model's vocabulary.
        steps: how many steps to run and measure.
        seed: seeds the batch's token ids (the bytes do not depend on them).
        device: where the model trains (CUDA: the allocator's measurement).
    """

    model, _ = build_run_model(cfg, vocab_size)
    planned = estimate_from_config(cfg, vocab_size).detail["checkpointed_layers"]
    model = place_model(model, cfg, device, planned)
    rounding = Rounding(stochastic_rounding(cfg), seed=cfg.train.seed)  # as the trainer rounds
    attach(list(enumerate(model.parameters())), rounding)
    opt, _ = build_optimizer_and_schedule(model, cfg)
    mb = synthetic_batch(cfg, vocab_size, seed, device)
    inb = InBackward.for_run(model.parameters(), opt, cfg.train) if cfg.train.update_in_backward else None
    step = make_train_step(model, opt, cfg, lambda k: mb, in_backward=inb, rounding=rounding)
    warmup = COMPILE_WARMUP_STEPS if cfg.train.compile else 0
    try:
        for _ in range(warmup):
            step()
        return [measure_step(step, model, opt, warmup + k, in_backward=inb) for k in range(steps)]
    finally:
        if inb is not None:
            inb.remove()


def _result(rec: _Step, step: int, device: torch.device) -> dict:
    reg = rec.reg
    owned = reg.owned()
    totals = {c: reg.bytes_of(owned[c]) for c in CATEGORIES[:3]}
    totals["gradients"] = reg.grad_max  # at most every gradient storage's bytes (all alive at once)
    totals["activations"] = reg.saved_max
    if rec.cuda is None:
        peak, live, phase = reg.replay()
        at_peak = {c: reg.bytes_of(owned[c] & live) for c in CATEGORIES}
        if phase not in _GRAPH_PHASES:
            # Backward has released the graph: a once-saved storage still alive (the batch) is
            # no longer held for backward, so it counts as a temporary here.
            at_peak["activations"] = 0
    else:
        peak, phase, at_peak = rec.cuda.result()
        # In-backward gradients live between the boundaries: the phase's largest, as an upper bound.
        at_peak["gradients"] = max(at_peak["gradients"], reg.grad_phase_max.get(phase, 0))
    return {
        **totals,
        "temporaries": max(peak - sum(at_peak.values()), 0),
        "peak": peak,
        "at_peak": at_peak,
        "phase_at_peak": phase,
        "step": int(step),
        "device": device.type,
    }

"""One command that proves effpretrain on a GPU: CUDA numerics, memory by category at 1B, speed
(eager and compiled, MFU), and the HF Trainer's own GaLore side by side.

    python benchmarks/gpu_check.py [--out DIR] [--budget-s 420]
        [--sections numerics,memory,step_7b,in_backward_fsdp2,speed,hf]
    python benchmarks/gpu_check.py --smoke    # every section's code at tiny scale on the CPU

Sections (each writes ``DIR/<section>.json`` and ``DIR/<section>.md``, headed by the commit, the
device's name, and the torch and CUDA versions; ``DIR/summary.md`` joins them):

- ``numerics``: every registered optimizer and factor kind (their tiny recipes, `run_model.
  registry_recipes`), fp32, 5 steps on the device against the same 5 steps on the CPU from the same
  weights and batches: the worst relative weight difference (||a - b|| / ||b||, per tensor); for a
  method with 8-bit (uint8) state, the final losses' relative difference (target: within 1%).
- ``memory``: llama_1b, bf16-pure, sequence 256 (the benchmark's), the largest batch of (64, 32,
  ..., 1) whose estimate fits every method in 85% of the device, for adamw, galore (rank 512),
  galore_8bit, apollo_mini, muon, lowrank_restarts, sltrain and cola_m, plus galore_8bit with
  updates in backward and activation checkpointing: measured by category (the allocator on CUDA,
  `effpretrain.memory.measure.measure_run`, two steps) against the estimator. Weights, gradients and state
  must be equal, the peak within 5% (flagged otherwise).
- ``step_7b``: GaLore's 24 GB claim: 3 steps of llama_7b with galore_8bit (rank 1024), updates in
  backward, no clipping, batch 1 x 256 tokens, bf16-pure; measured by category against the
  estimate, as ``memory`` (skipped where bitsandbytes is missing).
- ``in_backward_fsdp2``: FSDP2 on one GPU (a process group of one), galore_8bit and adamw_8bit,
  a few steps with updates in backward against the same steps without (clipping off, one
  micro-batch): the hooks run on FSDP2's reduce-scatter stream and bitsandbytes' kernels on the
  legacy default stream (`optimizers._streams`). Target: the same weights bitwise at fp32, the
  last loss within 1% in bf16 (skipped where bitsandbytes is missing).
- ``speed``: tokens/s and MFU at the same shape for adamw, galore, apollo_mini, muon and lowrank,
  eager and compiled (`train.compile`): the median of timed steps after warm-up steps, the
  compile time apart, the optimizer step's share of a step, and a refresh's time amortised over
  its gap. Printed beside the figures (targets, not assertions): compiled >= 1.15x eager;
  compiled galore >= 0.90x, apollo_mini >= 0.95x and muon >= 0.85x of compiled AdamW's tokens/s.
- ``hf``: with galore-torch importable, transformers' Trainer with ``optim="galore_adamw"``
  against ``effpretrain train`` galore at llama_350m, the same batch, rank, gap and data
  (the built-in corpus's tokens), one process, alternating (HF, ours, HF, ours): the steady
  tokens/s ratio and the peak-memory ratio.

Data is the built-in corpus and synthetic token ids only: nothing is downloaded, and `datasets` is
never imported; the tokenizer cache goes to a scratch folder (`EFFPRETRAIN_CACHE`, unless set).

Packages (`NEEDS`: bitsandbytes for the 8-bit methods, galore-torch for ``hf``) are checked
before the first case: a missing one is named in a ``MISSING PACKAGES`` line at the start and at
the end, the cases that need it are reported ``missing`` (never ``skipped``), the rest runs, and
the exit code is 3. ``--packages`` checks them alone (after installing the carried wheels).

``--budget-s``: a case starts only with time left for it; the cases not reached are listed.

``--smoke`` runs every section's functions at tiny scale on the CPU (the "device" is the CPU, so
the numerics compare the CPU with itself) in about a minute; the test suite runs it, so the GPU
path cannot rot while no GPU is at hand. Only CUDA calls (synchronisation, the allocator's
statistics) are left untaken.

Wheels for a GPU machine without network: ``make gpu-wheels`` (bitsandbytes, galore-torch, about 43
MB, in the ignored ``.whl/``, for Python 3.12); there ``python3 -m pip install --no-index --no-deps
--target /tmp/site .whl/*.whl`` and ``export PYTHONPATH=/tmp/site`` (docs/gpu.md, "Install").

Exit code: 0 when every reached case ran (targets and flags reported, not asserted); 1 when one raised;
2 for bad arguments; 3 when none raised but a needed package is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import gpu_report  # noqa: E402
from _bench import Budget, Missing, Skipped, log, needs_package, provenance, run_cases  # noqa: E402

from effpretrain import flops  # noqa: E402
from effpretrain.config import load_config  # noqa: E402

RECIPES = ROOT / "recipes"
SECTIONS, RESULTS = gpu_report.SECTIONS, gpu_report.RESULTS  # the files and docs page, read here too
README_START, README_END = gpu_report.README_START, gpu_report.README_END
markdown, write_section = gpu_report.markdown, gpu_report.write_section
render_results, update_readme = gpu_report.render_results, gpu_report.update_readme
MEMORY_METHODS = (
    "adamw",
    "galore",
    "galore_8bit",
    "apollo_mini",
    "muon",
    "lowrank_restarts",
    "sltrain",
    "cola_m",
)
IN_BACKWARD = ("train.update_in_backward=true", "train.grad_clip=0", "train.activation_checkpointing=1")
SPEED_METHODS = ("adamw", "galore", "apollo_mini", "muon", "lowrank")
#: Speed targets printed beside the figures: compiled / eager, and compiled method / compiled AdamW.
COMPILE_TARGET = 1.15
VS_ADAMW_TARGET = {"galore": 0.90, "apollo_mini": 0.95, "muon": 0.85}
EXACT = ("weights", "gradients", "optimizer_state")
PEAK_TOLERANCE = 0.05
#: The packages the sections need beyond the toolkit's own requirements (import name: sections):
#: the wheels `make gpu-wheels` carries to a GPU machine without network (docs/gpu.md, "Install").
NEEDS: dict[str, tuple[str, ...]] = {
    "bitsandbytes": ("numerics", "memory", "step_7b"),
    "galore_torch": ("hf",),
}


@dataclass(frozen=True)
class Scale:
    """The shapes and step counts of one mode (the GPU check, or the CPU smoke)."""

    device: str
    numerics_steps: int
    numerics_over: tuple[str, ...]
    numerics_restart_every: int  # a recipe with restarts restarts this often (within the steps)
    model_dir: str  # recipes/<model_dir>/<method>.yaml for memory and speed
    seq_len: int
    batches: tuple[int, ...]  # candidates, largest first
    memory_fraction: float
    vocab: int
    warmup: int
    timed: int
    hf_model_dir: str
    hf_batch: int
    hf_steps: int
    hf_vocab: int
    big_preset: str  # the 7B step's model and GaLore rank
    big_rank: int
    fsdp2_preset: str  # the FSDP2 + updates-in-backward pairs: model, batch, steps
    fsdp2_batch: int
    fsdp2_steps: int


FULL = Scale(
    device="cuda",
    numerics_steps=5,
    numerics_over=("data.seq_len=64", "train.batch_size=4", "optim.update_proj_gap=2"),
    numerics_restart_every=3,
    model_dir="llama_1b",
    seq_len=256,
    batches=(64, 32, 16, 8, 4, 2, 1),
    memory_fraction=0.85,
    vocab=32000,
    warmup=3,
    timed=10,
    hf_model_dir="llama_350m",
    hf_batch=32,
    hf_steps=12,
    hf_vocab=8192,
    big_preset="llama_7b",
    big_rank=1024,
    fsdp2_preset="llama_130m",
    fsdp2_batch=8,
    fsdp2_steps=5,
)
SMOKE = dataclasses.replace(
    FULL,
    device="cpu",
    numerics_steps=2,
    numerics_over=("data.seq_len=16", "train.batch_size=2", "optim.update_proj_gap=2"),
    numerics_restart_every=2,
    model_dir="tiny",
    seq_len=16,
    batches=(2,),
    vocab=512,
    warmup=1,
    timed=2,
    hf_model_dir="tiny",
    hf_batch=2,
    hf_steps=4,
    hf_vocab=512,
    big_preset="tiny",
    big_rank=8,
    fsdp2_preset="tiny",
    fsdp2_batch=2,
    fsdp2_steps=2,
)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    """Collects what the last case left (reference cycles included) and, on CUDA, returns the
    allocator's cached blocks, so the next case starts from the same memory."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# packages: checked before the first case; a missing one is "missing", never "skipped"


def missing_packages(sections: list[str]) -> dict[str, str]:
    """The `NEEDS` packages that the chosen sections need and that do not import, each with why
    (its error's first line). Imported for real, not only found: a wheel for another Python, or
    one whose own library does not load, is as missing as an absent one."""
    out = {}
    for name, needed_by in NEEDS.items():
        if not set(needed_by) & set(sections):
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or a wheel whose native library raises on load
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else name}"
    return out


def missing_line(missing: dict[str, str]) -> str:
    """The one prominent line naming the missing packages and the sections that need them."""
    names = ", ".join(f"{n} ({', '.join(NEEDS[n])})" if n in NEEDS else n for n in missing)
    return (
        f"gpu_check: MISSING PACKAGES: {names}: their cases are reported 'missing' and the exit code "
        "is 3; install the carried wheels (docs/gpu.md, Install) and rerun"
    )


def report_packages() -> int:
    """``--packages``: each `NEEDS` package, ok (with its version) or MISSING; 3 if one is missing."""
    missing = missing_packages(list(SECTIONS))
    for name, needed_by in NEEDS.items():
        if name in missing:
            print(f"MISSING  {name:14s} needed by {', '.join(needed_by)}: {missing[name]}")
        else:
            version = getattr(importlib.import_module(name), "__version__", "?")
            print(f"ok       {name:14s} {version}")
    if missing:
        print(missing_line(missing))
    return 3 if missing else 0


# ----------------------------------------------------------------------------------------------
# a. numerics: the device against the CPU


def _five_steps(cfg: Any, device: str, steps: int, vocab: int) -> tuple[dict[str, torch.Tensor], float, bool]:
    """`steps` steps of `cfg`'s model and optimizer on `device` from the seeded initial weights
    and the same batches: final weights (on the CPU), last loss, and whether any state is uint8."""
    from effpretrain.optim_setup import build_optimizer_and_schedule
    from effpretrain.run_model import build_run_model, make_train_step, place_model, synthetic_batch

    torch.manual_seed(cfg.train.seed)  # as the trainer seeds: surgery and restarts draw from it
    model, _ = build_run_model(cfg, vocab)
    model = place_model(model, cfg, device, 0)
    opt, sched = build_optimizer_and_schedule(model, cfg)
    counter = iter(range(10**6))
    step = make_train_step(
        model, opt, cfg, lambda k: synthetic_batch(cfg, vocab, next(counter), device), sched=sched
    )
    loss = math.nan
    for _ in range(steps):
        loss = step()
    inner = getattr(opt, "optimizer", opt)
    quantized = any(
        isinstance(v, torch.Tensor) and v.dtype == torch.uint8
        for st in inner.state.values()
        for v in st.values()
    )
    weights = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    return weights, loss, quantized


def numerics_case(recipe: str, scale: Scale) -> dict[str, Any]:
    cfg = load_config(RECIPES / "tiny" / f"{recipe}.yaml", [*scale.numerics_over, "train.precision=fp32"])
    if cfg.restarts.every:
        cfg.restarts.every = scale.numerics_restart_every
    ref, ref_loss, _ = _five_steps(cfg, "cpu", scale.numerics_steps, scale.vocab)
    got, loss, quantized = _five_steps(cfg, scale.device, scale.numerics_steps, scale.vocab)
    worst = max(float((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)) for k in ref)
    loss_rel = abs(loss - ref_loss) / abs(ref_loss)
    return {
        "worst_weight_rel_diff": worst,
        "loss_rel_diff": loss_rel,
        "state_8bit": quantized,
        # 8-bit state: code flips between devices move the weights, the loss stays within 1%.
        "within_target": loss_rel <= 0.01 if quantized else None,
    }


def numerics_recipes() -> list[str]:
    """Every registered optimizer and factor kind, by the tiny recipe that covers it."""
    from effpretrain.run_model import registry_recipes

    return registry_recipes(RECIPES / "tiny")


def section_numerics(scale: Scale, budget: Budget) -> list[dict[str, Any]]:
    return run_cases([(n, 5.0, lambda n=n: numerics_case(n, scale)) for n in numerics_recipes()], budget)


# ----------------------------------------------------------------------------------------------
# b. memory at 1B: measured by category against the estimate


def device_bytes(device: str) -> int:
    from effpretrain.memory.preflight import device_memory_limit

    return device_memory_limit(torch.device(device))[0]


def paper_config(method: str, scale: Scale, batch: int, extra: tuple[str, ...] = ()) -> Any:
    over = [
        f"data.seq_len={scale.seq_len}",
        f"train.batch_size={batch}",
        "train.grad_accum=1",
        "data.shuffle_buffer=0",
        *extra,
    ]
    if scale is SMOKE:
        over.append("train.precision=bf16-pure")
    return load_config(RECIPES / scale.model_dir / f"{method}.yaml", over)


def fitting_batch(scale: Scale, methods: tuple[str, ...]) -> int:
    """The largest candidate batch whose estimated peak fits every method in the device share."""
    from effpretrain.memory import estimate_from_config

    room = scale.memory_fraction * device_bytes(scale.device)
    for b in scale.batches:
        peaks = [estimate_from_config(paper_config(m, scale, b), scale.vocab).peak for m in methods]
        if max(peaks) <= room:
            return b
    return scale.batches[-1]


def memory_case(
    method: str, scale: Scale, batch: int, extra: tuple[str, ...] = (), steps: int = 2
) -> dict[str, Any]:
    from effpretrain.memory import estimate_from_config
    from effpretrain.memory.measure import measure_run

    cfg = paper_config(method, scale, batch, extra)
    est = estimate_from_config(cfg, scale.vocab)
    try:
        steps = measure_run(cfg, scale.vocab, steps=steps, device=scale.device)
    finally:
        free(scale.device)
    measured = {c: max(int(s[c]) for s in steps) for c in (*EXACT, "activations", "peak")}
    estimated = {
        "weights": est.weights,
        "gradients": est.grads,
        "optimizer_state": est.optimizer_state,
        "activations": est.activations,
        "peak": est.peak,
    }
    flags = [c for c in EXACT if measured[c] != estimated[c]]
    if abs(measured["peak"] / estimated["peak"] - 1) > PEAK_TOLERANCE:
        flags.append("peak")
    return {
        "batch": batch,
        "measured": measured,
        "estimated": estimated,
        "ratio": {c: measured[c] / estimated[c] if estimated[c] else None for c in measured},
        "phase_at_peak": max(steps, key=lambda s: s["peak"])["phase_at_peak"],
        "flags": flags,
    }


def section_memory(scale: Scale, budget: Budget) -> list[dict[str, Any]]:
    batch = fitting_batch(scale, ("adamw",))
    log(f"  batch {batch} (sequence {scale.seq_len})")
    cases = [(m, 30.0, lambda m=m: memory_case(m, scale, batch)) for m in MEMORY_METHODS]
    cases.append(
        (
            "galore_8bit+in_backward+checkpointing",
            30.0,
            lambda: memory_case("galore_8bit", scale, batch, IN_BACKWARD),
        )
    )
    return run_cases(cases, budget)


def section_step_7b(scale: Scale, budget: Budget) -> list[dict[str, Any]]:
    """GaLore's headline step: llama_7b, 8-bit GaLore at rank 1024 updated in backward, no
    clipping, 256 tokens (batch 1 x 256), pure bf16; 3 steps measured by category."""
    extra = (
        f"model.preset={scale.big_preset}",
        f"optim.rank={scale.big_rank}",
        "train.update_in_backward=true",
        "train.grad_clip=0",
    )
    case = f"galore_8bit {scale.big_preset} r{scale.big_rank} in backward"
    return run_cases([(case, 120.0, lambda: memory_case("galore_8bit", scale, 1, extra, steps=3))], budget)


# ----------------------------------------------------------------------------------------------
# b2. FSDP2 + updates in backward + 8-bit state, on one device


#: (method, precision) pairs of the section; the target of each: bitwise at fp32, else the loss.
IN_BACKWARD_FSDP2 = (
    ("galore_8bit", "fp32"),
    ("adamw_8bit", "fp32"),
    ("galore_8bit", "bf16-pure"),
    ("adamw_8bit", "bf16-pure"),
)


@contextlib.contextmanager
def one_process_group(device: str) -> Iterator[None]:
    """A process group of this one process (NCCL on CUDA, gloo on the CPU), for FSDP2 on one
    device; destroyed after."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp2_run(cfg: Any, device: str, steps: int, vocab: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """`steps` steps of `cfg` under FSDP2 on one device (its own process group must exist), as the
    trainer's FSDP2 launch builds them (sharded, then the optimizer; with
    ``train.update_in_backward`` the `InBackward` hooks, which FSDP2 runs on its reduce-scatter
    stream): the final weights (on the CPU) and the losses."""
    from effpretrain.fsdp import apply_fsdp2
    from effpretrain.in_backward import InBackward
    from effpretrain.optim_setup import build_optimizer_and_schedule
    from effpretrain.run_model import build_run_model, make_train_step, place_model, synthetic_batch

    torch.manual_seed(cfg.train.seed)
    model, _ = build_run_model(cfg, vocab)
    model = apply_fsdp2(place_model(model, cfg, device, 0))
    opt, sched = build_optimizer_and_schedule(model, cfg)
    inb = InBackward.for_run(model.parameters(), opt, cfg.train) if cfg.train.update_in_backward else None
    counter = iter(range(10**6))
    step = make_train_step(
        model,
        opt,
        cfg,
        lambda k: synthetic_batch(cfg, vocab, next(counter), device),
        sched=sched,
        in_backward=inb,
    )
    try:
        losses = [step() for _ in range(steps)]
        sync(device)
        weights = {k: v.full_tensor().detach().float().cpu() for k, v in model.state_dict().items()}
    finally:
        if inb is not None:
            inb.remove()
        del model, opt, sched, step, inb
        free(device)
    return weights, losses


def in_backward_fsdp2_case(method: str, precision: str, scale: Scale) -> dict[str, Any]:
    """The same steps under FSDP2 on one device with and without updates in backward (clipping
    off, one micro-batch: the same kernels on the same gradients, so the same weights bitwise
    at fp32 when the 8-bit kernels are ordered with FSDP2's reduce-scatter stream; G1 of the
    CUDA review, docs/gpu.md). bf16: the last losses within 1%."""
    over = [
        f"model.preset={scale.fsdp2_preset}",
        f"data.seq_len={scale.seq_len}",
        f"train.batch_size={scale.fsdp2_batch}",
        "train.grad_accum=1",
        "train.grad_clip=0",
        f"train.precision={precision}",
    ]
    runs = {}
    with one_process_group(scale.device):
        for inb in (False, True):
            cfg = load_config(RECIPES / "tiny" / f"{method}.yaml", [*over, f"train.update_in_backward={inb}"])
            runs[inb] = fsdp2_run(cfg, scale.device, scale.fsdp2_steps, scale.vocab)
    (ref, ref_losses), (got, losses) = runs[False], runs[True]
    bitwise = all(torch.equal(got[k], ref[k]) for k in ref)
    worst = max(float((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)) for k in ref)
    loss_rel = abs(losses[-1] - ref_losses[-1]) / abs(ref_losses[-1])
    return {
        "precision": precision,
        "steps": scale.fsdp2_steps,
        "bitwise_equal": bitwise,
        "worst_weight_rel_diff": worst,
        "loss_rel_diff": loss_rel,
        "within_target": bitwise if precision == "fp32" else loss_rel <= 0.01,
    }


def section_in_backward_fsdp2(scale: Scale, budget: Budget) -> list[dict[str, Any]]:
    cases = [
        (f"{m} {p}", 20.0, lambda m=m, p=p: in_backward_fsdp2_case(m, p, scale)) for m, p in IN_BACKWARD_FSDP2
    ]
    return run_cases(cases, budget)


# ----------------------------------------------------------------------------------------------
# c. speed: tokens/s and MFU, eager and compiled


@contextlib.contextmanager
def timed_optimizer(opt: Any, device: str, seconds: list[float]) -> Iterator[None]:
    """Records each ``opt.step()``'s wall time (synchronised before and after on CUDA)."""
    inner_step = opt.step

    def step(*a: Any, **kw: Any) -> Any:
        sync(device)
        t0 = time.perf_counter()
        out = inner_step(*a, **kw)
        sync(device)
        seconds.append(time.perf_counter() - t0)
        return out

    opt.step = step
    try:
        yield
    finally:
        del opt.step


def _allocated(device: str) -> int | None:
    return int(torch.cuda.memory_allocated()) if device == "cuda" else None


def _timed_steps(cfg: Any, scale: Scale) -> tuple[list[float], list[float], dict[str, Any]]:
    """Builds `cfg`'s model, optimizer and batch on the device and times warm-up + timed steps:
    (step seconds, optimizer-step seconds, telemetry), plain numbers only. Everything it builds
    (the model, the optimizer and its state, the `step` closure that holds both) is local to this
    frame, so it is garbage once this returns, whatever the closures refer to."""
    from effpretrain.optim_setup import build_optimizer_and_schedule, opt_telemetry
    from effpretrain.run_model import build_run_model, make_train_step, place_model, synthetic_batch

    model, _ = build_run_model(cfg, scale.vocab)
    model = place_model(model, cfg, scale.device, 0)
    opt, sched = build_optimizer_and_schedule(model, cfg)
    mb = synthetic_batch(cfg, scale.vocab, 0, scale.device)
    step = make_train_step(model, opt, cfg, lambda k: mb, sched=sched)
    opt_s: list[float] = []
    times = []
    with timed_optimizer(opt, scale.device, opt_s):
        for _ in range(scale.warmup + scale.timed):
            sync(scale.device)
            t0 = time.perf_counter()
            step()
            sync(scale.device)
            times.append(time.perf_counter() - t0)
    return times, opt_s, opt_telemetry(opt)


def speed_case(method: str, scale: Scale, batch: int, compiled: bool) -> dict[str, Any]:
    """One speed row. The case's tensors live in `_timed_steps`'s frame alone; after it returns
    (or raises) `free` collects them, cycles included (an LR scheduler and the optimizer refer to
    each other), and returns CUDA's cached blocks, so cases do not pile up on the device."""
    from effpretrain.compile import compile_seconds

    cfg = paper_config(method, scale, batch, (f"train.compile={str(compiled).lower()}",))
    before = compile_seconds()
    held = _allocated(scale.device)
    try:
        times, opt_s, tel = _timed_steps(cfg, scale)
    finally:
        free(scale.device)
    leftover = None if held is None else _allocated(scale.device) - held
    steady = statistics.median(times[scale.warmup :])
    tokens_per_s = batch * scale.seq_len / steady
    per_token = flops.run_flops_per_token(cfg, scale.vocab)
    peak, _, peak_dtype = flops.run_peak_flops(cfg, torch.device(scale.device))
    refresh = None
    if tel.get("opt/refreshes"):  # one refresh's time over the steps between refreshes
        refresh = tel["opt/refresh_s"] / tel["opt/refreshes"] / cfg.optim.update_proj_gap
    return {
        "batch": batch,
        "compiled": compiled,
        "step_s": steady,
        "first_step_s": times[0],
        "compile_s": compile_seconds() - before,
        "tokens_per_s": tokens_per_s,
        "mfu": flops.mfu(per_token * tokens_per_s, peak),
        "peak_flops_dtype": peak_dtype,
        # CUDA bytes still allocated after the case freed what it built, against before it: a
        # leak into the next case shows here (the first case may also leave cuBLAS's workspace,
        # a few MiB, which later cases reuse). None on the CPU, which has no allocator statistics.
        "leftover_bytes": leftover,
        "optimizer_share": statistics.median(opt_s[scale.warmup :]) / steady,
        "refresh_amortised_s": refresh,
    }


def speed_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """compiled / eager per method, and each compiled method / compiled AdamW, beside the targets."""
    tps = {
        (r["case"].split(" ")[0], r.get("compiled")): r.get("tokens_per_s")
        for r in rows
        if r["status"] == "ok"
    }
    out = []
    for m in SPEED_METHODS:
        eager, comp, base = tps.get((m, False)), tps.get((m, True)), tps.get(("adamw", True))
        out.append(
            {
                "method": m,
                "compiled_vs_eager": comp / eager if comp and eager else None,
                "compiled_vs_eager_target": COMPILE_TARGET,
                "vs_compiled_adamw": comp / base if comp and base else None,
                "vs_compiled_adamw_target": VS_ADAMW_TARGET.get(m),
            }
        )
    return out


def section_speed(scale: Scale, budget: Budget) -> list[dict[str, Any]]:
    batch = fitting_batch(scale, ("adamw",))
    cases = [
        (
            f"{m} {'compiled' if c else 'eager'}",
            45.0 if c else 20.0,
            lambda m=m, c=c: speed_case(m, scale, batch, c),
        )
        for m in SPEED_METHODS
        for c in (False, True)
    ]
    return run_cases(cases, budget)


# ----------------------------------------------------------------------------------------------
# d. the HF Trainer's GaLore against effpretrain's, side by side


def _reset_accelerate() -> None:
    """Accelerate keeps one process-wide state; each trainer here builds its own."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _peak_bytes(device: str) -> int | None:
    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


def _reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def ours_galore(cfg: Any, out: Path, device: str) -> dict[str, Any]:
    from effpretrain.trainer import train

    _reset_accelerate()
    _reset_peak(device)
    train(cfg, out)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in steps if "tokens_per_s" in r and r.get("step", 0) > 2]
    return {"tokens_per_s": statistics.median(rates), "peak_bytes": _peak_bytes(device)}


def hf_galore(
    cfg: Any, rows: list[dict[str, torch.Tensor]], vocab: int, out: Path, device: str
) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from effpretrain.config import ATTN_MLP_TARGETS
    from effpretrain.models import build_model

    _reset_accelerate()
    model = build_model(cfg.model.preset, vocab, cfg.data.seq_len, seed=cfg.train.seed)
    model = model.to(torch.bfloat16).to(device)  # pure bf16, as the effpretrain run
    o, t = cfg.optim, cfg.train
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=device == "cpu",
        report_to=[],
        max_steps=t.max_steps,
        per_device_train_batch_size=t.batch_size,
        learning_rate=o.lr,
        weight_decay=o.weight_decay,
        lr_scheduler_type="cosine",
        warmup_steps=int(t.warmup_ratio * t.max_steps),
        max_grad_norm=t.grad_clip,
        optim="galore_adamw",
        optim_target_modules=list(ATTN_MLP_TARGETS),
        optim_args=f"rank={o.rank}, update_proj_gap={o.update_proj_gap}, scale={o.scale}",
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        seed=t.seed,
    )

    class StepClock(TrainerCallback):
        """Times each optimizer step (synchronised on CUDA)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.t0 = 0.0

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            sync(device)
            self.times.append(time.perf_counter() - self.t0)

    clock = StepClock()
    _reset_peak(device)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[clock]).train()
    rates = [t.batch_size * cfg.data.seq_len / s for s in clock.times[2:]]
    return {"tokens_per_s": statistics.median(rates), "peak_bytes": _peak_bytes(device)}


def section_hf(scale: Scale, budget: Budget, scratch: Path) -> list[dict[str, Any]]:
    try:
        import galore_torch  # noqa: F401  (transformers' optim="galore_adamw" imports it)
    except ImportError as e:
        raise needs_package(e) from None
    cfg, rows, vocab = _hf_data(scale)
    results: dict[str, list[dict[str, Any]]] = {"hf": [], "ours": []}
    cases = []
    for i in range(2):  # alternating: HF, ours, HF, ours
        hf = lambda i=i: _keep(results["hf"], hf_galore(cfg, rows, vocab, scratch / f"hf{i}", scale.device))  # noqa: E731
        ours = lambda i=i: _keep(results["ours"], ours_galore(cfg, scratch / f"ours{i}", scale.device))  # noqa: E731
        cases += [(f"hf galore_adamw #{i + 1}", 60.0, hf), (f"effpretrain galore #{i + 1}", 60.0, ours)]
    out = run_cases(cases, budget)
    if results["hf"] and results["ours"]:
        hf_peak = [r["peak_bytes"] for r in results["hf"] if r["peak_bytes"]]
        our_peak = [r["peak_bytes"] for r in results["ours"] if r["peak_bytes"]]
        out.append(
            {
                "case": "effpretrain / HF",
                "status": "ok",
                "tokens_per_s_ratio": statistics.mean(r["tokens_per_s"] for r in results["ours"])
                / statistics.mean(r["tokens_per_s"] for r in results["hf"]),
                "peak_memory_ratio": max(our_peak) / max(hf_peak) if hf_peak and our_peak else None,
                "batch": cfg.train.batch_size,
                "rank": cfg.optim.rank,
                "update_proj_gap": cfg.optim.update_proj_gap,
            }
        )
    return out


def _hf_data(scale: Scale) -> tuple[Any, list[dict[str, torch.Tensor]], int]:
    """The side-by-side run's config (the galore recipe on the built-in corpus, pure bf16, the
    model's own loss as the Trainer computes it), the rows both trainers read, the vocabulary."""
    from effpretrain import data as data_mod

    over = [
        "data.source=builtin",
        "data.tokenizer=builtin-bpe",
        f"data.vocab_size={scale.hf_vocab}",
        "data.mode=pack",
        f"data.seq_len={scale.seq_len}",
        f"train.batch_size={scale.hf_batch}",
        "train.grad_accum=1",
        f"train.max_steps={scale.hf_steps}",
        "train.eval_every=0",
        "train.eval_tokens=512",
        "train.memory_steps=[]",
        "train.log_every=1",
        "train.save_every=0",
        "train.plot=false",
        "train.precision=bf16-pure",
        "train.loss=standard",
    ]
    cfg = load_config(RECIPES / scale.hf_model_dir / "galore.yaml", over)
    corpus = data_mod.load_corpus(cfg.data)
    tok = data_mod.load_tokenizer(cfg.data, corpus)
    stream = data_mod.TokenStream.from_config(corpus, tok, cfg.data, 0, 1)
    batches = data_mod.Batches(stream, cfg.train.batch_size, 1, 0, 1, vocab_size=tok.vocab_size)
    rows: list[dict[str, torch.Tensor]] = []
    while len(rows) < cfg.train.batch_size * (cfg.train.max_steps + 1):
        (mb,), _ = batches.next_step()
        rows += [{"input_ids": r, "labels": r.clone()} for r in mb["input_ids"]]
    return cfg, rows, tok.vocab_size


def _keep(into: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any]:
    into.append(row)
    return row


def run_section(section: str, scale: Scale, budget: Budget, scratch: Path) -> list[dict[str, Any]]:
    log(f"{section}:")
    try:
        if section == "numerics":
            return section_numerics(scale, budget)
        if section == "memory":
            return section_memory(scale, budget)
        if section == "step_7b":
            return section_step_7b(scale, budget)
        if section == "in_backward_fsdp2":
            return section_in_backward_fsdp2(scale, budget)
        if section == "speed":
            rows = section_speed(scale, budget)
            return rows + [{"case": f"ratios {r['method']}", "status": "ok", **r} for r in speed_ratios(rows)]
        return section_hf(scale, budget, scratch)
    except Skipped as e:
        log(f"  skipped: {e}")
        return [{"case": section, "status": "skipped", "note": str(e)}]
    except Missing as e:
        log(f"  missing: {e}")
        return [{"case": section, "status": "missing", "note": str(e)}]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--out", type=Path, default=None, help="results folder (default benchmarks/results/gpu-check)"
    )
    p.add_argument(
        "--budget-s", type=float, default=420.0, help="wall-clock budget; cases past it are listed"
    )
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}"
    )
    p.add_argument("--smoke", action="store_true", help="every section at tiny scale on the CPU")
    p.add_argument(
        "--readme", action="store_true", help="only render docs/gpu.md's results from the committed JSON"
    )
    p.add_argument(
        "--packages",
        action="store_true",
        help="only check the packages the sections need (exit 3 if one is missing)",
    )
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections: {', '.join(bad)} not among {', '.join(SECTIONS)}")
    if args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    import tempfile

    args = parse_args(argv)
    if args.readme:
        print("docs/gpu.md " + ("updated" if update_readme() else "unchanged"))
        return 0
    if args.packages:
        return report_packages()
    scale = SMOKE if args.smoke else FULL
    if scale.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: error: no CUDA device (use --smoke for the CPU run of every section)", file=sys.stderr
        )
        return 2
    out = args.out or (ROOT / "runs" / "gpu-check-smoke" if args.smoke else RESULTS)
    budget, prov = Budget(args.budget_s), provenance(scale.device)
    log(f"gpu_check on {prov['device']} (commit {prov['commit']}), budget {args.budget_s:.0f} s")
    missing = missing_packages(args.sections)
    if missing:
        log(missing_line(missing))
    failed = False
    with tempfile.TemporaryDirectory() as scratch, _scratch_cache(Path(scratch) / "cache"):
        for section in args.sections:
            rows = run_section(section, scale, budget, Path(scratch))
            write_section(out, section, prov, rows)
            failed |= any(r["status"] == "failed" for r in rows)
            for r in rows:  # a case's own missing import, even of a package outside NEEDS
                if r["status"] == "missing":
                    name = r["note"].removeprefix("needs ").split(" ")[0]
                    missing.setdefault(name, r["note"])
    summary = "\n".join((out / f"{s}.md").read_text() for s in args.sections)
    (out / "summary.md").write_text(summary)
    print(summary)
    if missing:
        print(missing_line(missing))
    return 1 if failed else 3 if missing else 0


@contextlib.contextmanager
def _scratch_cache(path: Path) -> Iterator[None]:
    """The tokenizer cache in the scratch folder unless `EFFPRETRAIN_CACHE` is set: the check
    writes nothing outside its output, and needs no platformdirs (not on every GPU image)."""
    if "EFFPRETRAIN_CACHE" in os.environ:
        yield
        return
    os.environ["EFFPRETRAIN_CACHE"] = str(path)
    try:
        yield
    finally:
        del os.environ["EFFPRETRAIN_CACHE"]


if __name__ == "__main__":
    sys.exit(main())

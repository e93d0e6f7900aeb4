"""Memory: the analytic estimate (no tensor is allocated) and the measured numbers.

Estimate, per rank, in bytes:

- weights: every parameter (and persistent buffer such as SLTrain's sparse index) at its dtype;
- grads: trainable parameters at the gradient dtype (= parameter dtype);
- optimizer_state: the method's exact formula per parameter (`MethodSpec.state_bytes`), which
  for each class is the same formula its docstring states and its tests check;
- activations: saved-for-backward tensors of a LLaMA block with SDPA attention, per token,
  ``(8 h + 4 i)`` elements (norm inputs/outputs, q/k/v, attention output, the four MLP
  intermediates); a checkpointed block keeps only its input ``h`` and one block is recomputed at a
  time; plus the logits (``V`` at the activation dtype and in fp32 for the loss). An approximation,
  stated as such.

The parameter shapes are those of the preset's LlamaForCausalLM built on PyTorch's meta device
(shapes only, no storage); a factorized target's tensors come from `FactorSpec.param_counts`
(building SLTrain's random support at 1B shapes would take far longer than the estimate).

``dtype`` names the precision, as ``train.precision`` does (`PRECISIONS`): ``fp32``;
``bf16-mixed`` (fp32 weights/grads/states, bf16 activations); ``bf16-pure`` (weights, grads and
states in bf16, the paper's setting).
Under FSDP2 weights, grads and full-rank states are sharded over ranks, while a projected matrix's
low-rank moments and basis are computed from the gathered gradient and held whole on every rank
(optimizers/projected_adam.py), and the 8-bit methods (adamw_8bit, galore_8bit) step gathered tensors and
hold all their state whole on every rank (`MethodSpec.fsdp2_whole_state`); under DDP every rank
holds all. Per-rank figures are rank 0's, the largest share: torch.chunk gives it ceil(rows / N)
rows of every tensor.

Measured: exact optimizer-state bytes from the state tensors, and peak memory (CUDA max allocated,
or the process's peak RSS on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import resource
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import optimizers
from effpretrain.config import ATTN_MLP_TARGETS
from effpretrain.models.factorized import FactorSpec, factor_spec
from effpretrain.models.llama import PRESETS, build_llama_config


@dataclass(frozen=True)
class Precision:
    """Storage dtype of weights, gradients and optimizer state; dtype of the activations."""

    params: torch.dtype
    activations: torch.dtype


#: ``train.precision`` names, the only precision names the estimator knows.
PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(torch.float32, torch.float32),
    "bf16-mixed": Precision(torch.float32, torch.bfloat16),
    "bf16-pure": Precision(torch.bfloat16, torch.bfloat16),
}


def precision(name: str) -> Precision:
    """The `PRECISIONS` row for `name`; ValueError naming the choices otherwise."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}") from None


@dataclass(frozen=True)
class ParamShape:
    """One parameter of a model, as `named_parameters` lists it.

    Attributes:
        name: its fully qualified name.
        shape: its shape.
        linear: the attribute name of the nn.Linear whose ``weight`` it is (``q_proj``,
            ``lm_head``, ...), else None; optimizer and factor targets are matched against it, as
            the trainer's param groups and `apply_factorization` match module names.
    """

    name: str
    shape: tuple[int, ...]
    linear: str | None


@functools.lru_cache(maxsize=32)
def model_param_shapes(preset: str, vocab_size: int | None = None) -> tuple[ParamShape, ...]:
    """The parameters of a preset's LlamaForCausalLM, in its named_parameters order.

    The model is built on the meta device: shapes without storage or initialisation (llama_1b
    builds in a few hundredths of a second, after transformers is imported).
    """
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(build_llama_config(preset, vocab_size))
    out = []
    for name, p in model.named_parameters():
        mod_name, _, pname = name.rpartition(".")
        is_linear = isinstance(model.get_submodule(mod_name), torch.nn.Linear) and pname == "weight"
        out.append(ParamShape(name, tuple(p.shape), mod_name.rsplit(".", 1)[-1] if is_linear else None))
    return tuple(out)


@dataclass
class Estimate:
    """The analytic breakdown, all in bytes per rank."""

    weights: int
    grads: int
    optimizer_state: int
    activations: int
    params: int
    trainable_params: int
    detail: dict[str, Any] = field(default_factory=dict)
    #: the largest live total at any moment of a step (bytes, per rank); ``detail["peak_phase"]``
    #: names that moment and ``detail["peak_terms"]`` its terms (name -> bytes).
    peak: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer_state + self.activations

    @property
    def weights_plus_optimizer(self) -> int:
        return self.weights + self.optimizer_state

    def as_dict(self) -> dict[str, Any]:
        return {
            "weights": self.weights,
            "grads": self.grads,
            "optimizer_state": self.optimizer_state,
            "activations": self.activations,
            "weights_plus_optimizer": self.weights_plus_optimizer,
            "total": self.total,
            "peak": self.peak,
            "params": self.params,
            "trainable_params": self.trainable_params,
            **self.detail,
        }


def projection_group(optim_cfg: Any) -> dict[str, Any]:
    """The group options a projected param gets from an OptimConfig (also used by the trainer):
    the registry row's `projection_group`."""
    o = optim_cfg
    return optimizers.method_spec(o.name).projection_group(
        rank=o.rank,
        update_proj_gap=o.update_proj_gap,
        scale=o.scale,
        proj_type=o.proj_type,
        basis=o.basis,
        extra=o.extra,
    )


@dataclass
class _Tally:
    """Running per-rank totals of the parameter part of an estimate (bytes, except counts)."""

    method: optimizers.MethodSpec
    dtype: torch.dtype
    shard: int  # ranks a tensor is split over (1: whole)
    whole_state: bool  # the method keeps all its state whole on every rank (FSDP2)
    weights: int = 0
    grads: int = 0
    state: int = 0
    params: int = 0
    trainable: int = 0
    index_bytes: int = 0

    def mine(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Rank 0's part of a tensor: torch.chunk gives it ceil(rows / N) rows."""
        return (-(-shape[0] // self.shard), *shape[1:]) if self.shard > 1 else tuple(shape)

    def stored(self, shape: tuple[int, ...]) -> int:
        """Bytes of rank 0's part of a `shape` tensor at the storage dtype."""
        return math.prod(self.mine(shape)) * self.dtype.itemsize

    def trainable_tensor(self, shape: tuple[int, ...], group: dict[str, Any] | None = None) -> None:
        """A trainable tensor: its weight, its gradient and its state. Element-wise state is split
        like its parameter (scalar terms, such as torch AdamW's step tensor, stay whole); a
        projected tensor's state (`group` given) and a whole-state method's stay whole."""
        self.weights += self.stored(shape)
        self.grads += self.stored(shape)
        whole = group is not None or self.whole_state
        self.state += self.method.state_bytes(shape if whole else self.mine(shape), group or {}, self.dtype)


def _tally_factorized(
    t: _Tally, m: int, n: int, spec: FactorSpec, rank: int, density: float, warm_start: bool = False
) -> int:
    """Adds one factorized m x n target (B m x r, A r x n, [sparse values], [frozen W0], [index
    buffer, not sharded]) to `t`; returns its element count. In a warm start (`warm_start`, a kind
    with `warm_starts`) the roles swap: W0 trains (weight, gradient, plain unprojected state) and
    the factors are stored only."""
    counts = spec.param_counts(m, n, rank, density)
    warm = warm_start and spec.warm_starts
    for shape in _factor_param_shapes(m, n, rank, counts):
        if warm:
            t.weights += t.stored(shape)
        else:
            t.trainable_tensor(shape)
    if warm:
        t.trainable_tensor((m, n))
    elif counts["frozen"]:  # LoRA's W0 (m x n), sharded like any parameter
        t.weights += t.stored((m, n))
    t.index_bytes += counts["index_elements"] * torch.int64.itemsize
    t.trainable += m * n if warm else counts["trainable"]
    return counts["trainable"] + counts["frozen"]


def _factor_param_shapes(m: int, n: int, rank: int, counts: dict[str, int]) -> list[tuple[int, ...]]:
    """Shapes of the separate trainable tensors a factorized m x n target holds: B (m x r),
    A (r x n) and, for SLTrain, the 1-D sparse values."""
    shapes: list[tuple[int, ...]] = [(m, rank), (rank, n)]
    extra = counts["trainable"] - m * rank - rank * n
    if extra:
        shapes.append((extra,))
    return shapes


def _tally_params(
    t: _Tally,
    shapes: Iterable[ParamShape],
    proj_group: dict[str, Any] | None,
    proj_targets: Sequence[str],
    factor: FactorSpec | None,
    factor_targets: Sequence[str],
    factor_rank: int,
    density: float,
    warm_start: bool = False,
) -> None:
    """Adds every parameter to `t`: factorized targets as their factors (or, in a warm start, as
    their trained W0), projected targets with their whole low-rank state, the rest as dense
    trainable tensors."""
    for s in shapes:
        if factor is not None and s.linear in factor_targets:
            t.params += _tally_factorized(t, *s.shape, factor, factor_rank, density, warm_start)
            continue
        projected = proj_group is not None and s.linear in proj_targets
        t.trainable_tensor(s.shape, proj_group if projected else None)
        t.params += math.prod(s.shape)
        t.trainable += math.prod(s.shape)
    t.weights += t.index_bytes  # a buffer: not sharded


def activation_bytes(
    preset: str,
    vocab_size: int | None,
    batch_size: int,
    seq_len: int,
    activation_checkpointing: int,
    dtype: torch.dtype,
) -> int:
    """Saved activations of one micro-batch (see the module docstring): (8 h + 4 i) per token per
    block, h for a checkpointed block plus one recomputed block, and the logits at `dtype` and fp32."""
    p = PRESETS[preset]
    V, size = vocab_size or p.vocab, dtype.itemsize
    tokens = batch_size * seq_len
    per_layer = (8 * p.hidden + 4 * p.intermediate) * tokens * size
    k = activation_checkpointing
    n_ckpt = 0 if k <= 0 else len(range(0, p.layers, k))
    acts = (p.layers - n_ckpt) * per_layer + n_ckpt * p.hidden * tokens * size
    if n_ckpt:
        acts += per_layer  # one checkpointed block is recomputed at a time
    return acts + tokens * (2 * p.hidden * size + V * (size + 4))


def estimate(
    preset: str,
    method: str = "adamw",
    *,
    dtype: str = "bf16-pure",
    vocab_size: int | None = None,
    optim_cfg: Any = None,
    factor_kind: str = "none",
    factor_rank: int = 128,
    density: float = 0.03,
    factor_targets: list[str] | None = None,
    batch_size: int = 1,
    seq_len: int = 256,
    activation_checkpointing: int = 0,
    world_size: int = 1,
    sharding: str = "none",
    warm_start: bool = False,
) -> Estimate:
    """Analytic memory of training `preset` with optimizer `method` (see module docstring).

    `dtype` is a `PRECISIONS` name. Under FSDP2 each parameter is split on dim 0 into
    `world_size` chunks with torch.chunk's sizes and the figures are rank 0's (the largest share).
    `warm_start`: the full-rank warm-start phase of a kind that has one (ReLoRA's W0 trained with
    the run's optimizer in a plain group, the factors frozen); ignored for other kinds.
    """
    from effpretrain.config import OptimConfig

    optim_cfg = optim_cfg or OptimConfig(name=method)
    prec = precision(dtype)
    mspec = optimizers.method_spec(method)
    shard = world_size if sharding == "fsdp2" else 1
    t = _Tally(mspec, prec.params, shard, whole_state=shard > 1 and mspec.fsdp2_whole_state)
    _tally_params(
        t,
        model_param_shapes(preset, vocab_size),
        projection_group(optim_cfg) if mspec.projects else None,
        list(optim_cfg.targets),
        factor_spec(factor_kind) if factor_kind != "none" else None,
        list(factor_targets or ATTN_MLP_TARGETS),
        factor_rank,
        density,
        warm_start,
    )
    acts = activation_bytes(
        preset, vocab_size, batch_size, seq_len, activation_checkpointing, prec.activations
    )
    detail = {
        "preset": preset,
        "method": method,
        "dtype": dtype,
        "factor": factor_kind,
        "world_size": world_size,
        "sharding": sharding,
        "sparse_index_bytes": t.index_bytes,
    }
    terms = {"weights": t.weights, "grads": t.grads, "optimizer_state": t.state, "activations": acts}
    detail.update(peak_phase="forward_backward", peak_terms=terms)
    return Estimate(
        t.weights, t.grads, t.state, acts, t.params, t.trainable, detail, peak=sum(terms.values())
    )


def estimate_from_config(cfg: Any, vocab_size: int, world_size: int = 1, sharding: str = "none") -> Estimate:
    """The estimate for a resolved RunConfig (what the trainer stores in summary.json).

    A run with a full-rank warm start (`factor.warm_start_steps` > 0) has two phases: the warm
    start (W0 trained: m n gradient and full-rank state per target) and the factorized phase after
    the switch. The estimate returned is the phase with the larger total (the warm start, unless
    r (m + n) > m n), with ``detail["phase"]`` naming it and ``detail["phases"]`` holding
    weights, grads, optimizer_state, total and trainable_params of both ("warm_start",
    "factorized").
    """
    run = functools.partial(_estimate_config, cfg, vocab_size, world_size, sharding)
    factorized = run(warm_start=False)
    spec = factor_spec(cfg.factor.kind) if cfg.factor.kind != "none" else None
    if not (cfg.factor.warm_start_steps and spec is not None and spec.warm_starts):
        return factorized
    phases = {"warm_start": run(warm_start=True), "factorized": factorized}
    keys = ("weights", "grads", "optimizer_state", "total", "trainable_params")
    table = {name: {k: getattr(e, k) for k in keys} for name, e in phases.items()}
    phase = max(phases, key=lambda name: phases[name].total)
    peak = phases[phase]
    return dataclasses.replace(peak, detail={**peak.detail, "phase": phase, "phases": table})


def _estimate_config(cfg: Any, vocab_size: int, world_size: int, sharding: str, warm_start: bool) -> Estimate:
    return estimate(
        cfg.model.preset,
        cfg.optim.name,
        dtype=cfg.train.precision,
        vocab_size=vocab_size,
        optim_cfg=cfg.optim,
        factor_kind=cfg.factor.kind,
        factor_rank=cfg.factor.rank,
        density=cfg.factor.density,
        factor_targets=cfg.factor.targets,
        batch_size=cfg.train.batch_size,
        seq_len=cfg.data.seq_len,
        activation_checkpointing=cfg.train.activation_checkpointing,
        world_size=world_size,
        sharding=sharding,
        warm_start=warm_start,
    )


# ----------------------------------------------------------------------------------------------
# Measured


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


def format_table(est: Estimate) -> str:
    """A human-readable breakdown in GB (1e9 bytes)."""
    rows = [
        ("weights", est.weights),
        ("gradients", est.grads),
        ("optimizer state", est.optimizer_state),
        ("activations (approx.)", est.activations),
        ("weights + optimizer", est.weights_plus_optimizer),
        ("total", est.total),
    ]
    d = est.detail
    head = (
        f"{d['preset']} / {d['method']}"
        + (f" + {d['factor']}" if d["factor"] != "none" else "")
        + f" / {d['dtype']} / world {d['world_size']} ({d['sharding']}), per rank"
    )
    lines = [head, f"  params {est.params:,}  trainable {est.trainable_params:,}"]
    lines += [f"  {name:<24}{b / 1e9:>10.3f} GB  ({b:,} B)" for name, b in rows]
    return "\n".join(lines)

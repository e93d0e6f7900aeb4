"""The estimate (`estimate`, `estimate_from_config`): the sums and the peak moment of a step, per rank; the checkpointing plan; the printed table."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import optimizers
from effpretrain.config import ATTN_MLP_TARGETS, OptimConfig
from effpretrain.config.checks import stochastic_rounding
from effpretrain.errors import ConfigError
from effpretrain.loss import DEFAULT_CHUNK_TOKENS
from effpretrain.memory.activations import (
    Activations,
    _linear_elements,
    activation_terms,
    checkpointed_layers,
)
from effpretrain.memory.in_backward_terms import InBackwardTerms, in_backward_terms
from effpretrain.memory.terms import (
    DistTerms,
    _dist_terms,
    _Tally,
    _tally_params,
    data_bytes,
    model_param_shapes,
    precision,
)
from effpretrain.models.factorized import factor_spec
from effpretrain.models.llama import ModelShape, config_source, model_shape, resolve_shape
from effpretrain.optim_setup import optim_plan


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


def peak_moments(
    t: _Tally,
    acts: Activations,
    checkpointed: Collection[int],
    grad_accum: int,
    dist: DistTerms,
    data: int = 0,
    in_backward: InBackwardTerms | None = None,
    accumulators: int | None = None,
) -> dict[str, dict[str, int]]:
    """Live bytes per term at each moment of a step; the peak is the largest total.

    - ``forward_end``: weights + state + gradients held from earlier micro-steps (none with one
      micro-step: the trainer zeroes them with set_to_none) + activations + the loss's live
      forward terms (`LossBytes.forward`) + FSDP2's gathered units;
    - ``loss_backward``: the same with the loss's backward terms (`LossBytes.backward`);
    - ``block_backward``: the worst decoder block, last to first: the gradients produced so far
      (the head, final norm and the blocks at or after it), the activations of the blocks before
      it and the base, its own full saved set (recomputed if checkpointed) and its backward's
      temporaries (gradients of its intermediates, ``2 N (h + i) e``, and FSDP2's reduce-scatter);
    - ``optimizer_step``: weights + gradients + state + the method's step transients
      (`MethodSpec.step_transient_bytes`) and a restart's (`FactorSpec.restart_transient_bytes`).
    DDP's buckets (`DistTerms`) are live at every moment (holding the gradients themselves with
    ``gradient_as_bucket_view``), and so is the training data's `data` (`data_bytes`).

    With `in_backward` (``train.update_in_backward``; `accumulators`: its accumulators at the
    step modelled, `InBackwardTerms.accumulators` by default) no moment holds every gradient: the
    held gradients are the accumulators (all of them are alive at the last micro-step's forward
    end and at the start of its backward), each block's backward holds the accumulators plus the
    gradients in flight (`in_backward_terms`' rule) and the largest step unit's step transient
    (the optimizer steps inside backward, one unit at a time), and ``optimizer_step`` (the
    wrapper's step after backward, on no gradients) holds only a restart's transient.
    """
    base = {"weights": t.weights, "optimizer_state": t.state, "ddp_buckets": dist.buckets, "data": data}
    held = t.grads if grad_accum > 1 else 0
    if in_backward is not None:
        held = in_backward.accumulators if accumulators is None else accumulators
    out = {
        "forward_end": {**base, "grads": held, "activations": acts.total, "loss": acts.loss.forward},
        "loss_backward": {**base, "grads": held, "activations": acts.total, "loss": acts.loss.backward},
    }
    for m in out.values():
        m["fsdp_gather"] = dist.gather + dist.head  # the loss reads the gathered head
    out["block_backward"] = _worst_block_backward(t, acts, checkpointed, dist, base, held, in_backward)
    if in_backward is not None and t.edge_transient:
        # The head steps as its gradient is final, when the backward starts (every block's saved
        # tensors still held, the loss's released); the embedding as it ends (less held then).
        out["edge_step"] = {
            **base,
            "grads": held + in_backward.in_flight,
            "activations": acts.total - acts.loss.saved,
            "optimizer_transient": t.edge_transient,
            "fsdp_gather": dist.gather + dist.head,
        }
    stepped = in_backward is not None  # every unit has stepped and freed its gradient
    out["optimizer_step"] = {
        **base,
        "grads": 0 if stepped else t.grads,
        "optimizer_transient": 0 if stepped else t.transient,
        "restart_transient": t.restart_transient,
    }
    if dist.grads_in_buckets:
        for m in out.values():
            m["grads"] = 0
    if in_backward is not None:  # each unit's fp64 squared norm, held until the next step begins
        for m in out.values():
            m["grad_norm_squares"] = 8 * t.tensors
    return out


def _worst_block_backward(
    t: _Tally,
    acts: Activations,
    checkpointed: Collection[int],
    dist: DistTerms,
    base: dict[str, int],
    held: int,
    in_backward: InBackwardTerms | None,
) -> dict[str, int]:
    """The ``block_backward`` moment of `peak_moments`: the decoder block, last to first, whose
    backward holds the most (gradients so far, the activations before it, its own saved set or
    its recompute, its temporaries)."""
    produced = t.grads - sum(t.block_grads.values())
    before = acts.total - acts.loss.saved
    worst: dict[str, int] = {}
    for i in reversed(range(len(acts.blocks))):
        before -= acts.blocks[i]
        produced += t.block_grads.get(i, 0)
        own = acts.block_full if i in checkpointed else acts.blocks[i]
        m = {
            **base,
            "grads": max(held, produced) if in_backward is None else held + in_backward.in_flight,
            "activations": before + (0 if i in checkpointed else own),
            "recompute": own if i in checkpointed else 0,
            "block_backward_temporaries": t.block_temporaries,
            "fsdp_gather": dist.gather + dist.reduce,
        }
        if in_backward is not None:
            m["optimizer_transient"] = in_backward.step_transient
        if sum(m.values()) > sum(worst.values()):
            worst = m
    return worst


def _rank_moments(
    t: _Tally,
    rank: int,
    acts: Activations,
    ck: Collection[int],
    o: EstimateOptions,
    dist: DistTerms,
    ib: InBackwardTerms | None,
) -> dict[str, dict[str, int]]:
    """`peak_moments` (or `in_backward_moments`) of one rank: its own optimizer state and step
    temporaries (under FSDP2 a whole-stepped matrix's state and step live on its owner rank)."""
    mine = copy.copy(t)
    mine.state, mine.transient = t.state_ranks[rank], t.transient_ranks[rank]
    if ib is None:
        return peak_moments(mine, acts, ck, o.grad_accum, dist, o.data)
    ib = dataclasses.replace(ib, step_transient=t.unit_transient_ranks[rank])
    return in_backward_moments(mine, acts, ck, o.grad_accum, dist, o.data, ib)


def _peak(moments: dict[str, dict[str, int]]) -> tuple[int, str, dict[str, int]]:
    name = max(moments, key=lambda k: sum(moments[k].values()))
    terms = {k: v for k, v in moments[name].items() if v}
    return sum(terms.values()), name, terms


@dataclass(frozen=True)
class EstimateOptions:
    """What `estimate` reads beside the preset and the method: the run's shape and settings."""

    dtype: str = "bf16-pure"
    """A `PRECISIONS` name: the storage precision."""
    vocab_size: int | None = None
    """The vocabulary; None: the preset's."""
    optim_cfg: Any = None
    """The run's `OptimConfig` (rank, gap, targets, extra); None: the method's defaults."""
    factor_kind: str = "none"
    factor_rank: int = 128
    density: float = 0.03
    factor_targets: list[str] | None = None
    batch_size: int = 1
    seq_len: int = 256
    activation_checkpointing: int | Collection[int] = 0
    """Every k-th layer (an int) or the layer indices."""
    world_size: int = 1
    sharding: str = "none"
    """Under FSDP2 each parameter is split on dim 0 into `world_size` chunks with torch.chunk's
    sizes and the figures are rank 0's (the largest share)."""
    warm_start: bool = False
    """The full-rank warm-start phase of a kind that has one (ReLoRA's W0 trained with the run's
    optimizer in a plain group, the factors frozen); ignored for other kinds."""
    grad_accum: int = 1
    loss: str = "standard"
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    restarts: bool = False
    """The run restarts (merges or refactorizes) factors, whose transient the step includes."""
    ddp_bucket_view: bool = True
    data: int = 0
    """The training data's bytes during a step (`data_bytes`; the trainer's runs)."""
    update_in_backward: bool = False
    """``train.update_in_backward``: ``grads`` is the in-backward figure between refreshes,
    accumulators + gradients in flight (`in_backward_terms`), and the moments are
    `in_backward_moments`; under FSDP2 the accumulators are per-rank shards, under DDP no bucket is
    counted. Low-rank accumulators only with `grad_clip` 0 (`effpretrain.in_backward`)."""
    grad_clip: float = 0.0
    in_backward_refresh: str = "accumulated"
    """``train.in_backward_refresh``: ``first_micro`` keeps a refreshing matrix's accumulator low
    rank at a refresh step too (its basis comes from the first micro-batch's gradient)."""
    weight_quant: str = "none"
    """``train.weight_quant``: ``int8`` stores the target linear weights (``optim.targets`` that
    are not factorized) as int8 codes with one fp32 scale per `weight_quant_group` columns:
    ``m n + 4 m ceil(n / g)`` bytes each; they compute (gradients, state) in the run's dtype."""
    weight_quant_group: int = 128
    weight_quant_embeddings: bool = False
    """``train.weight_quant_embeddings``: the input embedding and the head stored in INT8 too."""
    stochastic_rounding: bool | None = None
    """``train.stochastic_rounding`` resolved (None: on exactly for INT8 weights): the writer's
    noise is part of a rounded weight's step temporaries."""


def estimate(preset: str | ModelShape, method: str = "adamw", **options: Any) -> Estimate:
    """Analytic memory of training `preset` (a preset's name or any `ModelShape`) with optimizer
    `method` (see module docstring), with
    the run's shape and settings as `EstimateOptions` keywords. The peak is the largest moment of
    `peak_moments` (`in_backward_moments` with updates in backward); ``detail`` says where it is
    reached, of what, and with updates in backward the gradient figures of both paths
    (`_in_backward_detail`)."""
    o = EstimateOptions(**options)
    prec = precision(o.dtype)
    p = resolve_shape(preset)
    shapes = model_param_shapes(p, o.vocab_size)
    factor = factor_spec(o.factor_kind) if o.factor_kind != "none" else None
    targets = list(o.factor_targets or ATTN_MLP_TARGETS)
    t = _param_tally(p, method, o, prec, shapes, factor, targets)
    ck = checkpointed_layers(o.activation_checkpointing, p.layers)
    acts = _activation_terms(p, o, ck, shapes, factor, targets)
    t.block_temporaries = (
        2 * o.batch_size * o.seq_len * (p.hidden + p.intermediate) * prec.activations.itemsize
    )
    ib = in_backward_terms(t, o.grad_accum) if o.update_in_backward else None
    # In backward, DDP's buckets are not used (assumed: each final gradient is reduced in its hook).
    dist = _dist_terms(
        t, "none" if ib and o.sharding == "ddp" else o.sharding, o.world_size, o.ddp_bucket_view
    )
    ranks = [_rank_moments(t, r, acts, ck, o, dist, ib) for r in range(len(t.state_ranks))]
    peaks = [_peak(m) for m in ranks]
    worst = max(range(len(peaks)), key=lambda r: peaks[r][0])
    moments, (peak, moment, terms) = ranks[worst], peaks[worst]
    detail = {
        "preset": preset if isinstance(preset, str) else p.label,
        "method": method,
        "dtype": o.dtype,
        "factor": o.factor_kind,
        "world_size": o.world_size,
        "sharding": o.sharding,
        "sparse_index_bytes": t.index_bytes,
        "optimizer_state_per_rank": t.state_ranks,
        "peak_per_rank": [p_[0] for p_ in peaks],
        "checkpointed_layers": sorted(ck),
        "loss": o.loss,
        "peak_phase": "optimizer_step" if moment == "optimizer_step" else "forward_backward",
        "peak_moment": moment,
        "peak_terms": terms,
        **(_in_backward_detail(t, ib, moments) if ib is not None else {}),
    }
    grads = t.grads if ib is None else ib.grads
    return Estimate(t.weights, grads, t.state, acts.total, t.params, t.trainable, detail, peak=peak)


def _param_tally(
    p: ModelShape, method: str, o: EstimateOptions, prec: Any, shapes: Any, factor: Any, targets: list[str]
) -> _Tally:
    """Weights, gradients and optimizer state per parameter, sharded as the run shards them."""
    optim_cfg = o.optim_cfg or OptimConfig(name=method)
    plan = optim_plan(optim_cfg, p.dim, name=method)  # the groups the trainer builds, resolved once
    shard = o.world_size if o.sharding == "fsdp2" else 1
    extra = {k: v for k, v in optim_cfg.extra.items() if k not in optimizers.PROJECTION_GROUP_EXTRAS}
    t = _Tally(plan.spec, prec.params, shard, options=extra)
    t.int8_group = o.weight_quant_group if o.weight_quant == "int8" else 0
    t.int8_embeddings = t.int8_group > 0 and o.weight_quant_embeddings
    t.stochastic = o.weight_quant == "int8" if o.stochastic_rounding is None else bool(o.stochastic_rounding)
    t.low_rank_acc = shard == 1 and o.grad_clip <= 0
    t.refresh_ahead = t.low_rank_acc and o.in_backward_refresh == "first_micro"
    _tally_params(
        t,
        shapes,
        plan,
        list(optim_cfg.targets),
        factor,
        targets,
        o.factor_rank,
        o.density,
        o.warm_start,
        o.restarts,
    )
    t.finish()
    return t


def _activation_terms(
    p: ModelShape, o: EstimateOptions, ck: frozenset[int], shapes: Any, factor: Any, targets: list[str]
) -> Activations:
    """What one micro-batch saves for backward, the loss's included."""
    rank_saves = 0 if factor is None or (o.warm_start and factor.warm_starts) else factor.rank_saves
    block, head = _linear_elements(shapes, factor, targets, o.factor_rank, o.density)
    if p.tied:  # the head is the embedding's matrix, listed once, as the embedding
        head = (o.vocab_size or p.vocab) * p.hidden
    return activation_terms(
        p,
        o.vocab_size,
        o.batch_size,
        o.seq_len,
        ck,
        o.dtype,
        rank_inputs=len(set(targets) & set(ATTN_MLP_TARGETS)) * rank_saves,
        rank=o.factor_rank,
        linear_weights=(block, head),
        loss=o.loss,
        loss_chunk_tokens=o.loss_chunk_tokens,
    )


def estimate_from_config(
    cfg: Any,
    vocab_size: int,
    world_size: int = 1,
    sharding: str = "none",
    checkpointed: Collection[int] | None = None,
) -> Estimate:
    """The estimate for a resolved RunConfig (what the trainer stores in summary.json).

    A run with a full-rank warm start (`factor.warm_start_steps` > 0) has two phases: the warm
    start (W0 trained: m n gradient and full-rank state per target) and the factorized phase after
    the switch. The estimate returned is the phase with the larger total (the warm start, unless
    r (m + n) > m n), with ``detail["phase"]`` naming it and ``detail["phases"]`` holding
    weights, grads, optimizer_state, total, peak and trainable_params of both ("warm_start",
    "factorized"); its `peak` is the larger phase's peak.

    `checkpointed` (layer indices) overrides ``train.activation_checkpointing``; its ``auto`` is
    resolved by `plan_checkpointing`.
    """
    ck = cfg.train.activation_checkpointing if checkpointed is None else checkpointed
    if ck == "auto":
        ck = plan_checkpointing(cfg, vocab_size, world_size, sharding)[0]
    run = functools.partial(_estimate_config, cfg, vocab_size, world_size, sharding, ck)
    factorized = run(warm_start=False)
    spec = factor_spec(cfg.factor.kind) if cfg.factor.kind != "none" else None
    if not (cfg.factor.warm_start_steps and spec is not None and spec.warm_starts):
        return factorized
    phases = {"warm_start": run(warm_start=True), "factorized": factorized}
    keys = ("weights", "grads", "optimizer_state", "total", "peak", "trainable_params")
    table = {name: {k: getattr(e, k) for k in keys} for name, e in phases.items()}
    phase = max(phases, key=lambda name: phases[name].total)
    top = max(phases.values(), key=lambda e: e.peak)
    peak_detail = {k: top.detail[k] for k in ("peak_phase", "peak_moment", "peak_terms")}
    chosen = phases[phase]
    detail = {**chosen.detail, **peak_detail, "phase": phase, "phases": table}
    return dataclasses.replace(chosen, peak=top.peak, detail=detail)


def plan_checkpointing(
    cfg: Any, vocab_size: int, world_size: int = 1, sharding: str = "none"
) -> tuple[list[int], Estimate]:
    """``train.activation_checkpointing: auto``: the fewest decoder layers to checkpoint so that
    the estimated peak fits ``train.memory_budget_gb`` (GB = 1e9 bytes), and that estimate.

    Blocks save equal activations, and checkpointing a lower block frees its activations for
    every later moment of the backward, so layers are taken from layer 0 up: the first k that fits.

    Raises:
        ConfigError: no budget is set, or even checkpointing every layer exceeds it.
    """

    budget = cfg.train.memory_budget_gb
    if budget is None:
        raise ConfigError("train.activation_checkpointing=auto needs train.memory_budget_gb")
    layers = model_shape(cfg.model).layers
    for k in range(layers + 1):
        est = estimate_from_config(cfg, vocab_size, world_size, sharding, checkpointed=range(k))
        if est.peak <= budget * 1e9:
            return list(range(k)), est
    name, biggest = max(est.detail["peak_terms"].items(), key=lambda kv: kv[1])
    raise ConfigError(
        f"train.memory_budget_gb={budget:g}: nothing fits; with every decoder layer checkpointed the "
        f"estimated peak is {est.peak / 1e9:.3f} GB (largest term: {name} {biggest / 1e9:.3f} GB)"
    )


def _estimate_config(
    cfg: Any, vocab_size: int, world_size: int, sharding: str, checkpointed: Any, warm_start: bool
) -> Estimate:
    return estimate(
        model_shape(cfg.model) if config_source(cfg.model)[1] else cfg.model.preset,
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
        activation_checkpointing=checkpointed,
        world_size=world_size,
        sharding=sharding,
        warm_start=warm_start,
        grad_accum=cfg.train.grad_accum,
        loss=cfg.train.loss,
        loss_chunk_tokens=cfg.train.loss_chunk_tokens,
        restarts=cfg.restarts.every > 0,
        data=data_bytes(cfg.data.shuffle_buffer, cfg.data.seq_len),
        update_in_backward=cfg.train.update_in_backward,
        grad_clip=cfg.train.grad_clip,
        in_backward_refresh=cfg.train.in_backward_refresh,
        weight_quant=cfg.train.weight_quant,
        weight_quant_group=cfg.train.weight_quant_group,
        weight_quant_embeddings=cfg.train.weight_quant_embeddings,
        stochastic_rounding=stochastic_rounding(cfg),
    )


def format_table(est: Estimate, top: int = 4) -> str:
    """A human-readable breakdown in GB (1e9 bytes): the sums, then the peak, the moment it is
    reached and its `top` largest terms."""
    rows = [
        ("weights", est.weights),
        ("gradients (in backward)" if est.detail.get("update_in_backward") else "gradients", est.grads),
        ("optimizer state", est.optimizer_state),
        ("activations", est.activations),
        ("weights + optimizer", est.weights_plus_optimizer),
        ("total", est.total),
        ("peak", est.peak),
    ]
    d = est.detail
    head = (
        f"{d['preset']} / {d['method']}"
        + (f" + {d['factor']}" if d["factor"] != "none" else "")
        + f" / {d['dtype']} / world {d['world_size']} ({d['sharding']}), per rank"
        + (" / updates in backward" if d.get("update_in_backward") else "")
    )
    lines = [head, f"  params {est.params:,}  trainable {est.trainable_params:,}"]
    lines += [f"  {name:<24}{b / 1e9:>10.3f} GB  ({b:,} B)" for name, b in rows]
    ranks = d.get("optimizer_state_per_rank", [])
    if len(ranks) > 1 and min(ranks) != max(ranks):
        lines.insert(
            5, f"    (the largest rank's; every rank {min(ranks) / 1e9:.3f}-{max(ranks) / 1e9:.3f} GB)"
        )
    if d.get("update_in_backward"):
        sub = [
            ("accumulators", d["grad_accumulators"]),
            ("in flight", d["grads_in_flight"]),
            ("at a refresh step", d["grads_at_refresh"]),
            ("all, normal path", d["grads_all_parameters"]),
        ]
        lines[4:4] = [f"    {name:<22}{b / 1e9:>10.3f} GB" for name, b in sub]
    peaks = d.get("peak_per_rank", [])
    if len(peaks) > 1 and min(peaks) != max(peaks):
        lines += [f"    rank {r:<17}{b / 1e9:>10.3f} GB" for r, b in enumerate(peaks)]
    terms = sorted(d.get("peak_terms", {}).items(), key=lambda kv: -kv[1])[:top]
    lines.append(f"  peak at {d.get('peak_moment', '?')} ({d.get('peak_phase', '?')}), largest terms:")
    lines += [f"    {name:<22}{b / 1e9:>10.3f} GB" for name, b in terms]
    return "\n".join(lines)


def in_backward_moments(
    t: _Tally,
    acts: Activations,
    checkpointed: Collection[int],
    grad_accum: int,
    dist: DistTerms,
    data: int,
    terms: InBackwardTerms,
) -> dict[str, dict[str, int]]:
    """`peak_moments` of an in-backward step between refreshes and, where a refresh step holds
    larger accumulators (full ones for every projected matrix), its forward end, loss backward and
    block backward again as ``refresh_forward_end``, ``refresh_loss_backward`` and
    ``refresh_block_backward``: the bounded spike, part of the peak."""
    out = peak_moments(t, acts, checkpointed, grad_accum, dist, data, terms)
    if terms.accumulators_at_refresh != terms.accumulators:
        spike = peak_moments(
            t, acts, checkpointed, grad_accum, dist, data, terms, terms.accumulators_at_refresh
        )
        out.update({f"refresh_{k}": v for k, v in spike.items() if k != "optimizer_step"})
    return out


def _in_backward_detail(t: _Tally, ib: InBackwardTerms, moments: dict[str, dict[str, int]]) -> dict[str, Any]:
    """The detail keys of an in-backward estimate (see `estimate`)."""
    steady = {k: v for k, v in moments.items() if not k.startswith("refresh_")}
    return {
        "update_in_backward": True,
        "grads_all_parameters": t.grads,
        "grad_accumulators": ib.accumulators,
        "grad_accumulators_at_refresh": ib.accumulators_at_refresh,
        "grads_in_flight": ib.in_flight,
        "grads_at_refresh": ib.grads_at_refresh,
        # The largest step unit's temporaries, a decoder layer's or the embedding's or head's.
        "in_backward_step_transient": max(ib.step_transient, t.edge_transient),
        "peak_between_refreshes": _peak(steady)[0],
    }

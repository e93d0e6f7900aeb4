"""The estimate's terms per parameter: precisions, the model's parameter shapes (built on the meta device), the per-parameter tally of weights, gradients and optimizer state (sharded as FSDP2 shards them), and the distributed terms."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import optimizers
from effpretrain.memory.in_backward_terms import lowrank_accumulator_bytes
from effpretrain.models.factorized import FactorSpec
from effpretrain.models.llama import ModelShape, build_llama_config, model_class
from effpretrain.optim_setup import HEAD_TARGETS, OptimPlan
from optimizers.rounding import int8_nbytes
from optimizers.writer import transient_bytes as writer_transient_bytes


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
def model_param_shapes(preset: str | ModelShape, vocab_size: int | None = None) -> tuple[ParamShape, ...]:
    """The parameters of a preset's (or shape's) model, in its named_parameters order: a tied
    head is the embedding's matrix and is listed once, as the embedding.

    The model is built on the meta device: shapes without storage or initialisation (llama_1b
    builds in a few hundredths of a second, after transformers is imported).
    """
    cfg = build_llama_config(preset, vocab_size)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    out = []
    for name, p in model.named_parameters():
        mod_name, _, pname = name.rpartition(".")
        is_linear = isinstance(model.get_submodule(mod_name), torch.nn.Linear) and pname == "weight"
        out.append(ParamShape(name, tuple(p.shape), mod_name.rsplit(".", 1)[-1] if is_linear else None))
    return tuple(out)


@dataclass
class _Tally:
    """Running per-rank totals of the parameter part of an estimate (bytes, except counts)."""

    method: optimizers.MethodSpec
    dtype: torch.dtype
    shard: int  # ranks a tensor is split over (1: whole)
    # The constructor's options every param group inherits (`optim.extra` without the basis
    # options: 8-bit's min_8bit_size, 4-bit's quant_scheme), under each group's own keys.
    options: dict[str, Any] = field(default_factory=dict)
    weights: int = 0
    grads: int = 0
    state: int = 0  # set by `finish`: the largest rank's state, shared state included once
    state_ranks: list[int] = field(default_factory=list)  # each rank's state (`finish`)
    shared_ranks: list[int] = field(default_factory=list)  # state held once per optimizer, per rank
    owned: list[tuple[int, int, int, int]] = field(default_factory=list)  # (cost, state, shared, step)
    local_transient: int = 0  # the step temporaries every rank has (its shards' steps)
    local_unit_transient: int = 0
    transient_ranks: list[int] = field(default_factory=list)  # each rank's (`finish`): its owned steps too
    unit_transient_ranks: list[int] = field(default_factory=list)
    params: int = 0
    trainable: int = 0
    index_bytes: int = 0
    transient: int = 0  # set by `finish`: the largest rank's step temporaries (`transient_ranks`)
    restart_transient: int = 0
    block_temporaries: int = 0  # set by `estimate`: one block's backward temporaries
    unit: int | None = None  # the decoder layer being tallied (None: embeddings, final norm, head)
    fsdp_unit: int | str | None = None  # its FSDP2 unit: the layer, "embed", "head" or None (the root)
    block_grads: dict[int, int] = field(default_factory=dict)
    unit_full: dict[int | str | None, int] = field(default_factory=dict)  # FSDP2 units, unsharded bytes
    unit_mine: dict[int | str | None, int] = field(default_factory=dict)  # and rank 0's shard
    # ``train.update_in_backward`` (`InBackwardTerms`): accumulators between refreshes and at a
    # refresh, the largest parameter's and step unit's gradients, the largest unit's step transient.
    acc_steady: int = 0
    acc_refresh: int = 0
    largest_grad: int = 0
    largest_unit: int = 0
    unit_transient: int = 0  # set by `finish`: the largest rank's (`unit_transient_ranks`)
    int8_group: int = 0  # INT8 target weights' group size (0: none); `quant` marks the tensor being tallied
    quant: bool = False
    int8_embeddings: bool = False
    stochastic: bool = False  # updates rounded stochastically into weights stored in fewer bits
    # In backward, the largest step unit's temporaries among the embedding, final norm and head
    # (stepped as the backward starts or ends, not beside a decoder block's): `edge_transient`.
    edge_transient: int = 0
    tensors: int = 0  # trainable tensors (in backward, each holds its fp64 squared norm: 8 B)
    rounded_transient: int = 0  # the largest writer step (`optimizers.writer`): one tensor at a time
    low_rank_acc: bool = False  # low-rank accumulators allowed (one shard, clipping off)
    refresh_ahead: bool = False  # and kept low rank at a refresh (the first micro-batch's basis)

    def __post_init__(self) -> None:
        self.state_ranks = [0] * self.shard
        self.shared_ranks = [0] * self.shard

    def mine(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Rank 0's part of a tensor: torch.chunk gives it ceil(rows / N) rows."""
        return (-(-shape[0] // self.shard), *shape[1:]) if self.shard > 1 else tuple(shape)

    def stored(self, shape: tuple[int, ...]) -> int:
        """Bytes of rank 0's part of a `shape` tensor at the storage dtype."""
        return math.prod(self.mine(shape)) * self.dtype.itemsize

    def trainable_tensor(self, shape: tuple[int, ...], group: dict[str, Any] | None = None) -> None:
        """A trainable tensor: its weight, its gradient and its state. Element-wise state is split
        like its parameter (scalar terms, such as torch AdamW's step tensor, stay whole); a
        projected tensor's state (`group` given) and a whole-state method's are whole: on every
        rank without sharding, on one owner rank under FSDP2 (`finish` places them). The group
        takes the constructor's `options` where it has no key of its own, as the optimizer's
        groups take its defaults."""
        if self.options:
            group = {**self.options, **(group or {})}
        self.stored_weight(shape)
        self.tensors += 1
        self.grads += self.stored(shape)
        self._in_backward_terms(shape, group or {})
        if self.unit is not None:
            self.block_grads[self.unit] = self.block_grads.get(self.unit, 0) + self.stored(shape)
        group = group or {}
        # Projected and whole-matrix weights, and those whose moments' blocks a row split would
        # cut (`MethodSpec.steps_shards`), step whole, on an owner.
        whole = not self.method.steps_shards(shape, group)
        owned = whole and self.shard > 1
        if owned:
            self.owned.append(
                (
                    optimizers.whole_cost(shape, group),
                    self.method.state_bytes(shape, group, self.dtype),
                    self.method.shared_state_bytes(shape, group, self.dtype),
                    0,  # its step's temporaries, set below
                )
            )
        else:
            parts = self.chunks(shape) if self.shard > 1 else [shape]
            for i, part in enumerate(parts):
                self.state_ranks[i] += self.method.part_state_bytes(shape, part, group, self.dtype)
                self.shared_ranks[i] = max(
                    self.shared_ranks[i], self.method.shared_state_bytes(part, group, self.dtype)
                )
        mine = shape if whole else self.mine(shape)
        step = self.method.step_transient_bytes(mine, group, self.dtype)
        rounded = self.writer_bytes(mine)
        if rounded:
            # Written through the writer (`optimizers.writer.written`), one tensor at a time: its
            # fp32 value and the rounding's temporaries beside the rule's own (a per-tensor rule's
            # even for a method whose plain weights step together, torch's foreach AdamW).
            step = self.method.step_transient_bytes(mine, {**group, "foreach": False}, self.dtype)
            if self.method.foreach:
                step = 2 * math.prod(mine) * self.dtype.itemsize  # torch's single-tensor path
            step += rounded
        if whole and self.shard > 1:
            # Stepped whole on the owner: the gathered W and G, and while gathering the receive
            # buffer of the same size (freed before the step's own temporaries).
            full = math.prod(shape) * self.dtype.itemsize
            step = max(step + 2 * full, 4 * full)
        if owned:  # on its owner rank only
            self.owned[-1] = (*self.owned[-1][:3], step)
        elif rounded:
            self.rounded_transient = max(self.rounded_transient, step)
            self._unit_step(step)
        else:
            self.local_step(step)

    def local_step(self, step: int) -> None:
        """A step's temporaries that every rank has (a shard's step, or an unsharded run's)."""
        f = self.method.foreach
        self.local_transient = self.local_transient + step if f else max(self.local_transient, step)
        self._unit_step(step)

    def _unit_step(self, step: int) -> None:
        """In backward, one unit's step: beside a decoder block's backward, or, for the embedding,
        final norm and head (no decoder layer), at the backward's start or end."""
        if self.unit is None:
            self.edge_transient = max(self.edge_transient, step)
        else:
            self.local_unit_transient = max(self.local_unit_transient, step)

    def _in_backward_terms(self, shape: tuple[int, ...], group: dict[str, Any]) -> None:
        """One trainable tensor's in-backward terms: its accumulator (low rank between refreshes
        where `lowrank_accumulator_bytes` allows, full otherwise and at a refresh, unless the
        refresh takes the first micro-batch's gradient) and, as a
        single-parameter step unit, its gradient; a low-rank accumulator's back-projection
        (one full-size temporary at the last micro-step) counts with the unit's step transient."""
        g = self.stored(shape)
        low = lowrank_accumulator_bytes(self.method, shape, group, self.dtype) if self.low_rank_acc else None
        self.acc_steady += g if low is None else low
        self.acc_refresh += low if low is not None and self.refresh_ahead else g
        self.largest_grad = max(self.largest_grad, g)
        self.largest_unit = max(self.largest_unit, g)
        if low is not None:
            self.local_unit_transient = max(self.local_unit_transient, g)

    def chunks(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Every rank's part of a `shape` tensor under FSDP2 (torch.chunk's rows)."""
        return [(rows, *shape[1:]) for rows in optimizers.shard_rows(shape[0], self.shard)]

    def finish(self) -> None:
        """Places the whole-state tensors on their owner ranks (`optimizers.assign_owners`, as the
        optimizers do) and sets ``state`` to the largest rank's total, ``state_ranks`` to each's,
        and likewise the step temporaries (a whole-stepped matrix's on its owner)."""
        owners = optimizers.assign_owners([(c, s) for c, s, _, _ in self.owned], self.shard)
        # Rounded weights step after the others (`optimizers.adamw`), one at a time.
        self.local_transient = max(self.local_transient, self.rounded_transient)
        self.transient_ranks = [self.local_transient] * len(self.state_ranks)
        self.unit_transient_ranks = [self.local_unit_transient] * len(self.state_ranks)
        for (_, state, shared, step), r in zip(self.owned, owners):
            self.state_ranks[r] += state
            self.shared_ranks[r] = max(self.shared_ranks[r], shared)
            self.transient_ranks[r] = max(self.transient_ranks[r], step)
            self.unit_transient_ranks[r] = max(self.unit_transient_ranks[r], step)
        self.state_ranks = [a + b for a, b in zip(self.state_ranks, self.shared_ranks)]
        self.state = max(self.state_ranks)
        self.transient, self.unit_transient = max(self.transient_ranks), max(self.unit_transient_ranks)

    def writer_bytes(self, shape: tuple[int, ...]) -> int:
        """The writer's bytes for the tensor being tallied (`optimizers.writer.transient_bytes`):
        INT8 codes, bf16 or fp16 weights round through it; fp32 ones do not."""
        if self.quant and len(shape) == 2:
            storage = "int8"
        elif self.dtype in (torch.bfloat16, torch.float16):
            storage = "bf16"
        else:
            return 0
        return writer_transient_bytes(tuple(shape), storage, self.stochastic, self.int8_group or 128)

    def weight_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes a weight of `shape` is stored in: the dtype's, or INT8 codes and scales for a
        quantized target (`quant`)."""
        if self.quant and len(shape) == 2 and shape[0]:
            return int8_nbytes(tuple(shape), self.int8_group)
        return math.prod(shape) * self.dtype.itemsize

    def stored_weight(self, shape: tuple[int, ...]) -> None:
        """A parameter's storage on this rank, and its FSDP2 unit's (unsharded and rank 0's)."""
        mine = self.weight_bytes(self.mine(shape))
        self.weights += mine
        u = self.fsdp_unit
        self.unit_full[u] = self.unit_full.get(u, 0) + self.weight_bytes(shape)
        self.unit_mine[u] = self.unit_mine.get(u, 0) + mine


def _tally_factorized(
    t: _Tally,
    m: int,
    n: int,
    spec: FactorSpec,
    rank: int,
    density: float,
    warm_start: bool = False,
    restarts: bool = False,
) -> int:
    """Adds one factorized m x n target (B m x r, A r x n, [sparse values], [frozen W0], [index
    buffer, not sharded]) to `t`; returns its element count. In a warm start (`warm_start`, a kind
    with `warm_starts`) the roles swap: W0 trains (weight, gradient, plain unprojected state) and
    the factors are stored only. With `restarts`, the largest restart transient is kept; a method
    that steps the pair jointly (`MethodSpec.steps_factor_pairs`) adds that step's temporaries."""
    counts = spec.param_counts(m, n, rank, density)
    warm = warm_start and spec.warm_starts
    for shape in _factor_param_shapes(m, n, rank, counts):
        if warm:
            t.stored_weight(shape)
        else:
            t.trainable_tensor(shape)
    if warm:
        t.trainable_tensor((m, n))
    elif counts["frozen"]:  # LoRA's W0 (m x n), sharded like any parameter
        t.stored_weight((m, n))
    if restarts:
        t.restart_transient = max(t.restart_transient, spec.restart_transient_bytes(m, n, rank))
    if not warm and t.method.steps_factor_pairs:  # the pair steps jointly (LORO's exact step)
        pair = t.method.pair_step_transient_bytes(m, n, rank, t.dtype)
        t.local_step(pair)
        t.largest_unit = max(t.largest_unit, t.stored((m, rank)) + t.stored((rank, n)))
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
    plan: OptimPlan,
    proj_targets: Sequence[str],
    factor: FactorSpec | None,
    factor_targets: Sequence[str],
    factor_rank: int,
    density: float,
    warm_start: bool = False,
    restarts: bool = False,
) -> None:
    """Adds every parameter to `t`: factorized targets as their factors (or, in a warm start, as
    their trained W0), projected targets with their whole low-rank state, a whole-matrix method's
    weights in their matrix group (`MethodSpec.matrix_role`), the rest as dense trainable tensors
    (the query and key weights with the head-block options, if any): each with the options of the
    trainer's param group for it, from the same `plan` (`effpretrain.optim_setup.OptimPlan`)."""
    shapes = list(shapes)
    edges = any(s.name == "lm_head.weight" for s in shapes)  # untied: embedding and head are units
    for s in shapes:
        t.unit = _layer_of(s.name)
        t.fsdp_unit = _fsdp_unit_of(s.name, edges)
        if factor is not None and s.linear in factor_targets:
            t.params += _tally_factorized(t, *s.shape, factor, factor_rank, density, warm_start, restarts)
            continue
        target = s.linear in proj_targets
        # `train.weight_quant: int8`: a target linear layer's weight (its bias stays as it is).
        t.quant = bool(t.int8_group) and target and s.name.endswith(".weight") and len(s.shape) == 2
        t.quant |= t.int8_embeddings and s.name in ("model.embed_tokens.weight", "lm_head.weight")
        # nn.Embedding's weight is the only 2-D parameter of the model that no nn.Linear holds.
        role = t.method.matrix_role(target=target, embedding=s.linear is None, ndim=len(s.shape))
        if plan.projected is not None and target:
            group: dict[str, Any] | None = dict(plan.projected)
        elif role is not None:
            group = dict(plan.matrix[role])
        else:
            group = dict(plan.heads) if s.linear in HEAD_TARGETS else None
            if plan.heads and s.name.endswith(".bias"):  # a linear layer's bias (the trainer's groups)
                group = dict(plan.bias)
        t.trainable_tensor(s.shape, group)
        t.quant = False
        t.params += math.prod(s.shape)
        t.trainable += math.prod(s.shape)
    t.weights += t.index_bytes  # a buffer: not sharded


@dataclass(frozen=True)
class DistTerms:
    """Per-rank bytes a data-parallel run adds: `buckets`, DDP's gradient buckets (one full
    gradient, allocated when DDP wraps the model and live at every moment of a step); with
    `grads_in_buckets` (``gradient_as_bucket_view=True``, the trainer's) the gradients are views
    into them, so no gradient is counted beside them; without it every gradient is a second copy.
    `gather`: FSDP2's unsharded parameters during forward and backward (the root unit's, which
    stay gathered, and two decoder layers': the current and the prefetched one, less the shards
    already counted; an untied model's embedding and head are units of their own, gathered only
    for their own forward and backward); `reduce`: FSDP2's reduce-scatter input in backward (the
    largest unit's full gradient); `head`: the head unit's unsharded part, gathered at the loss."""

    buckets: int = 0
    grads_in_buckets: bool = False
    gather: int = 0
    reduce: int = 0
    head: int = 0


def _dist_terms(t: _Tally, sharding: str, world_size: int, bucket_view: bool) -> DistTerms:
    if world_size > 1 and sharding == "ddp":
        return DistTerms(buckets=t.grads, grads_in_buckets=bucket_view)
    if t.shard <= 1:
        return DistTerms()
    layers = [u for u in t.unit_full if isinstance(u, int)] or [None]
    big = max(layers, key=lambda u: t.unit_full[u])
    unsharded = lambda u: t.unit_full.get(u, 0) - t.unit_mine.get(u, 0)  # noqa: E731
    gather = unsharded(None) + 2 * unsharded(big)
    return DistTerms(gather=gather, reduce=max(t.unit_full.values(), default=0), head=unsharded("head"))


def data_bytes(shuffle_buffer: int, seq_len: int) -> int:
    """The training data's memory during a step: the shuffle pool (`data.shuffle_buffer` rows of
    int32 ids and one int32 length each, ``4 P (T + 1)``) and the copy the trainer's step takes of
    it to undo a skipped step's draw: ``8 P (T + 1)``; 0 without a shuffle buffer."""
    return 8 * shuffle_buffer * (seq_len + 1)


def _fsdp_unit_of(name: str, edges: bool) -> int | str | None:
    """The FSDP2 unit a parameter is sharded in (`effpretrain.fsdp.apply_fsdp2`): its decoder
    layer, with `edges` (an untied model) ``"embed"`` or ``"head"``, else the root (None)."""
    if edges and name.startswith("model.embed_tokens."):
        return "embed"
    if edges and name.startswith("lm_head."):
        return "head"
    return _layer_of(name)


def _layer_of(name: str) -> int | None:
    """The decoder layer a parameter belongs to (``model.layers.<i>.``), else None."""
    parts = name.split(".")
    if "layers" in parts and parts.index("layers") + 1 < len(parts):
        index = parts[parts.index("layers") + 1]
        return int(index) if index.isdigit() else None
    return None

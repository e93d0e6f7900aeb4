"""Memory: the analytic estimate (no tensor is allocated) and the measured numbers.

Estimate, per rank, in bytes:

- weights: every parameter (and persistent buffer such as SLTrain's sparse index) at its dtype;
- grads: trainable parameters at the gradient dtype (= parameter dtype);
- optimizer_state: the method's exact formula per parameter (`MethodSpec.state_bytes`), which
  for each class is the same formula its docstring states and its tests check, plus once the
  state all parameters share (`MethodSpec.shared_state_bytes`: 8-bit AdamW's quantile maps);
- activations: the tensors autograd saves for backward in one micro-batch, as HF's LLaMA block
  (SDPA attention, SiLU MLP, RMSNorm) and the factorized layers really save them, per precision
  (`SAVED_BYTES`, `activation_terms`; equal to the measured saved bytes), a checkpointed block
  keeping only its input, plus what the loss saves (`loss_bytes`);
- peak: the largest live total at any moment of a step (`peak_moments`): the end of the forward,
  the loss's backward, each block's backward (with a checkpointed block's recompute) and the
  optimizer step with the method's transients (`MethodSpec.step_transient_bytes`) and a
  restart's (`FactorSpec.restart_transient_bytes`); gradients held across accumulation
  micro-steps, DDP buckets and FSDP2's gathered units included. ``detail["peak_phase"]``
  ("forward_backward" or "optimizer_step"), ``detail["peak_moment"]`` and
  ``detail["peak_terms"]`` say where it is reached and of what it is made.

With ``train.update_in_backward`` (`effpretrain.in_backward`: each parameter steps inside
backward and its gradient is freed) no moment holds every gradient: the gradient term is the
accumulators of an accumulating step (low rank, r x max(m, n), for the matrices of a class whose
update reads G only through R, between refreshes; full otherwise) plus the gradients in flight
(`in_backward_terms` states the rule), a refresh step's full accumulators are the bounded spike
(``refresh_*`` moments), and the optimizer step's transient moves into each block's backward
(`in_backward_moments`).

The parameter shapes are those of the preset's LlamaForCausalLM built on PyTorch's meta device
(shapes only, no storage); a factorized target's tensors come from `FactorSpec.param_counts`
(building SLTrain's random support at 1B shapes would take far longer than the estimate).

``dtype`` names the precision, as ``train.precision`` does (`PRECISIONS`): ``fp32``;
``bf16-mixed`` (fp32 weights/grads/states, bf16 activations); ``bf16-pure`` (weights, grads and
states in bf16, the paper's setting).
Under FSDP2 weights, grads and element-wise states are sharded over ranks, while a projected
matrix's low-rank moments and basis, and all the state of the 8-bit methods (adamw_8bit,
galore_8bit: `MethodSpec.fsdp2_whole_state`) and a whole-matrix method's matrix weights' state
(Muon's momentum, SCALE's embedding: `MethodSpec.steps_whole`), are whole-tensor state held by one owner rank per
parameter, placed as the optimizers place it (`optimizers.assign_owners`, optimizers/_owners.py);
under DDP every rank holds all. Weights and gradients are rank 0's, the largest share (torch.chunk
gives it ceil(rows / N) rows of every tensor); the optimizer state is the largest rank's, and
``detail["optimizer_state_per_rank"]`` lists every rank's.

Measured: exact optimizer-state bytes from the state tensors, and peak memory (CUDA max allocated,
or the process's peak RSS on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import resource
import sys
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import optimizers
from effpretrain.config import ATTN_MLP_TARGETS
from effpretrain.loss import DEFAULT_CHUNK_TOKENS
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


#: The attention weights whose rows split into heads: Adam-mini (`MethodSpec.head_blocks`) gives them
#: one block per head (`MethodSpec.head_block_group`).
HEAD_TARGETS: tuple[str, ...] = ("q_proj", "k_proj")


def head_group(method: str, head_dim: int) -> dict[str, Any]:
    """The group options the query and key weights get under `method` (also used by the trainer):
    the registry row's `head_block_group`, empty for a method without head blocks."""
    return optimizers.method_spec(method).head_block_group(head_dim)


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


def lowrank_accumulator_bytes(
    method: optimizers.MethodSpec, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype
) -> int | None:
    """Bytes of the low-rank accumulator R = sum_k proj(G_k) that ``train.update_in_backward``
    keeps for a parameter of `shape` in `group` between basis refreshes, or None where it keeps a
    full one: as `ProjectedAdam.accumulation_basis` decides, a projected group of a class whose
    update reads G only through R (its ``PROJECTED_GRAD_ONLY``, read from the registry's target
    class) with a stored (`ComputedBasis`) basis. R has `projection.low_rank_shape`: r x max(m, n)
    for ``proj_type: std``. (FSDP2's sharded parameters always keep full accumulators: the caller
    does not ask.)"""
    if not method.projects or not (group.get("project") or group.get("rank") is not None):
        return None
    cls = method.cls
    if not getattr(cls, "PROJECTED_GRAD_ONLY", False):
        return None
    from optimizers import projection as proj
    from optimizers.projected_adam import ComputedBasis

    g = cls.resolve_group(group)
    if not g["project"] or not isinstance(cls._basis_policy(g), ComputedBasis):
        return None
    side = proj.choose_side(tuple(shape), g["proj_type"])
    return math.prod(proj.low_rank_shape(tuple(shape), g["rank"], side, g["basis"])) * dtype.itemsize


@dataclass(frozen=True)
class InBackwardTerms:
    """Gradient memory of ``train.update_in_backward`` (bytes per rank; `in_backward_terms`).

    Attributes:
        accumulators: the accumulators of a step of K > 1 micro-batches between refreshes (0 for
            K = 1): s_g r max(m, n) for a low-rank accumulated matrix, s_g numel for every other
            trainable tensor (embeddings, head, norms, factors, Fira's and APOLLO's matrices).
        accumulators_at_refresh: the same at a refresh step (and the first step, which has no
            basis yet), where every projected matrix keeps a full accumulator: the bounded spike.
        in_flight: the gradients alive beside the accumulators (the rule is `in_backward_terms`).
        step_transient: the largest step unit's optimizer-step temporaries (its own step inside
            backward), or a low-rank accumulator's full-size back-projection, if larger.
    """

    accumulators: int
    accumulators_at_refresh: int
    in_flight: int
    step_transient: int

    @property
    def grads(self) -> int:
        """The gradient figure between refreshes: accumulators + in flight."""
        return self.accumulators + self.in_flight

    @property
    def grads_at_refresh(self) -> int:
        return self.accumulators_at_refresh + self.in_flight


def in_backward_terms(t: _Tally, grad_accum: int) -> InBackwardTerms:
    """The in-backward gradient terms of a tallied model.

    The rule for the gradients in flight, from what `effpretrain.in_backward.InBackward` holds:

    * K = 1: the largest step unit's final gradients (one parameter; a (B, A) pair of a method
      that steps pairs, whose first final gradient waits while the second is produced). Each
      unit steps in the hook that makes its last gradient final and frees it before autograd
      produces the next.
    * K > 1: the largest parameter's gradient, on top of every accumulator: in micro-steps
      1 .. K-1 a fresh gradient G_k is alive while it is added to its accumulator, and in
      micro-step K the full accumulator itself becomes the final gradient (acc + G_K, in place),
      a low-rank one is replaced by back(R) + G_K (the back-projection is a temporary, counted in
      ``step_transient``), and a pair's first final gradient is its own former accumulator.
    """
    accumulate = grad_accum > 1
    return InBackwardTerms(
        accumulators=t.acc_steady if accumulate else 0,
        accumulators_at_refresh=t.acc_refresh if accumulate else 0,
        in_flight=t.largest_grad if accumulate else t.largest_unit,
        step_transient=t.unit_transient,
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
    state: int = 0  # set by `finish`: the largest rank's state, shared state included once
    state_ranks: list[int] = field(default_factory=list)  # each rank's state (`finish`)
    shared_ranks: list[int] = field(default_factory=list)  # state held once per optimizer, per rank
    owned: list[tuple[int, int, int]] = field(default_factory=list)  # (cost, state, shared) on owners
    params: int = 0
    trainable: int = 0
    index_bytes: int = 0
    transient: int = 0  # the optimizer step's temporaries (summed for a foreach method, else the largest)
    restart_transient: int = 0
    block_temporaries: int = 0  # set by `estimate`: one block's backward temporaries
    unit: int | None = None  # the decoder layer being tallied (None: embeddings, final norm, head)
    block_grads: dict[int, int] = field(default_factory=dict)
    unit_full: dict[int | None, int] = field(default_factory=dict)  # FSDP2 units, unsharded bytes
    unit_mine: dict[int | None, int] = field(default_factory=dict)  # and rank 0's shard
    # ``train.update_in_backward`` (`InBackwardTerms`): accumulators between refreshes and at a
    # refresh, the largest parameter's and step unit's gradients, the largest unit's step transient.
    acc_steady: int = 0
    acc_refresh: int = 0
    largest_grad: int = 0
    largest_unit: int = 0
    unit_transient: int = 0
    low_rank_acc: bool = False  # low-rank accumulators allowed (one shard, clipping off)

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
        rank without sharding, on one owner rank under FSDP2 (`finish` places them)."""
        self.stored_weight(shape)
        self.grads += self.stored(shape)
        self._in_backward_terms(shape, group or {})
        if self.unit is not None:
            self.block_grads[self.unit] = self.block_grads.get(self.unit, 0) + self.stored(shape)
        group = group or {}
        # Projected and whole-matrix weights (`MethodSpec.steps_whole`) step whole, on an owner.
        whole = self.method.steps_whole(group) or self.whole_state
        if whole and self.shard > 1:
            self.owned.append(
                (
                    optimizers.whole_cost(shape, group),
                    self.method.state_bytes(shape, group, self.dtype),
                    self.method.shared_state_bytes(shape, group, self.dtype),
                )
            )
        else:
            parts = self.chunks(shape) if self.shard > 1 else [shape]
            for i, part in enumerate(parts):
                self.state_ranks[i] += self.method.state_bytes(part, group, self.dtype)
                self.shared_ranks[i] = max(
                    self.shared_ranks[i], self.method.shared_state_bytes(part, group, self.dtype)
                )
        mine = shape if whole else self.mine(shape)
        step = self.method.step_transient_bytes(mine, group, self.dtype)
        if whole and self.shard > 1:
            # Stepped whole on the owner: the gathered W and G, and while gathering the receive
            # buffer of the same size (freed before the step's own temporaries).
            full = math.prod(shape) * self.dtype.itemsize
            step = max(step + 2 * full, 4 * full)
        self.transient = self.transient + step if self.method.foreach else max(self.transient, step)
        self.unit_transient = max(self.unit_transient, step)  # in backward each unit steps alone

    def _in_backward_terms(self, shape: tuple[int, ...], group: dict[str, Any]) -> None:
        """One trainable tensor's in-backward terms: its accumulator (low rank between refreshes
        where `lowrank_accumulator_bytes` allows, full otherwise and at a refresh) and, as a
        single-parameter step unit, its gradient; a low-rank accumulator's back-projection
        (one full-size temporary at the last micro-step) counts with the unit's step transient."""
        g = self.stored(shape)
        low = lowrank_accumulator_bytes(self.method, shape, group, self.dtype) if self.low_rank_acc else None
        self.acc_steady += g if low is None else low
        self.acc_refresh += g
        self.largest_grad = max(self.largest_grad, g)
        self.largest_unit = max(self.largest_unit, g)
        if low is not None:
            self.unit_transient = max(self.unit_transient, g)

    def chunks(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Every rank's part of a `shape` tensor under FSDP2 (torch.chunk's rows)."""
        return [(rows, *shape[1:]) for rows in optimizers.shard_rows(shape[0], self.shard)]

    def finish(self) -> None:
        """Places the whole-state tensors on their owner ranks (`optimizers.assign_owners`, as the
        optimizers do) and sets ``state`` to the largest rank's total, ``state_ranks`` to each's."""
        owners = optimizers.assign_owners([(c, s) for c, s, _ in self.owned], self.shard)
        for (_, state, shared), r in zip(self.owned, owners):
            self.state_ranks[r] += state
            self.shared_ranks[r] = max(self.shared_ranks[r], shared)
        self.state_ranks = [a + b for a, b in zip(self.state_ranks, self.shared_ranks)]
        self.state = max(self.state_ranks)

    def stored_weight(self, shape: tuple[int, ...]) -> None:
        """A parameter's storage on this rank, and its FSDP2 unit's (unsharded and rank 0's)."""
        self.weights += self.stored(shape)
        self.unit_full[self.unit] = self.unit_full.get(self.unit, 0) + math.prod(shape) * self.dtype.itemsize
        self.unit_mine[self.unit] = self.unit_mine.get(self.unit, 0) + self.stored(shape)


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
        t.transient = max(t.transient, pair)
        t.unit_transient = max(t.unit_transient, pair)
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
    proj_group: dict[str, Any] | None,
    proj_targets: Sequence[str],
    factor: FactorSpec | None,
    factor_targets: Sequence[str],
    factor_rank: int,
    density: float,
    warm_start: bool = False,
    restarts: bool = False,
    heads: dict[str, Any] | None = None,
) -> None:
    """Adds every parameter to `t`: factorized targets as their factors (or, in a warm start, as
    their trained W0), projected targets with their whole low-rank state, a whole-matrix method's
    weights in their matrix group (`MethodSpec.matrix_role`, as the trainer's param groups), the
    rest as dense trainable tensors (the query and key weights with the `heads` group options, if
    any)."""
    for s in shapes:
        t.unit = _layer_of(s.name)
        if factor is not None and s.linear in factor_targets:
            t.params += _tally_factorized(t, *s.shape, factor, factor_rank, density, warm_start, restarts)
            continue
        target = s.linear in proj_targets
        # nn.Embedding's weight is the only 2-D parameter of the model that no nn.Linear holds.
        role = t.method.matrix_role(target=target, embedding=s.linear is None, ndim=len(s.shape))
        if proj_group is not None and target:
            group: dict[str, Any] | None = proj_group
        elif role is not None:
            group = t.method.matrix_group(role)
        else:
            group = heads if s.linear in HEAD_TARGETS else None
        t.trainable_tensor(s.shape, group)
        t.params += math.prod(s.shape)
        t.trainable += math.prod(s.shape)
    t.weights += t.index_bytes  # a buffer: not sharded


@dataclass(frozen=True)
class SavedBytes:
    """Bytes a LLaMA decoder block (HF LlamaDecoderLayer, SDPA, SiLU MLP, RMSNorm) saves for
    backward per token, by precision: ``block_h`` per hidden unit outside the MLP's i-wide
    tensors, ``mlp_i`` per intermediate unit, ``final_norm_h`` for the final RMSNorm (whose output
    the head reads), ``residual`` the residual stream's itemsize, ``weight_cast`` the bytes per
    element of each linear weight's autocast copy (0 without autocast).

    fp32 (measured with `saved_tensor_bytes`, exact): each RMSNorm saves its input x, x rsqrt(.)
    and its output (3 h); SDPA saves q and k after RoPE, v and its output (4 h; that output is
    already laid out as o_proj's input, so it is one storage): 10 h x 4 B; the MLP saves the gate,
    its SiLU, up and their product (4 i x 4 B). bf16-pure: a norm keeps x in fp32 (4 B), x rsqrt(.)
    cast back (2 B) and its output (2 B): 2 x 8 + 4 x 2 = 24. bf16-mixed: the residual stream stays
    fp32; a norm saves x and x rsqrt(.) (8 B) while each linear saves its own bf16 cast of its
    input (q, k, v: three of the first norm's output, gate and up: two of the second's): 8 + 6 +
    8 + 8 + 4 = 34, the final norm 8 + the head's cast 2, and autocast keeps a bf16 copy of every
    linear weight until backward. Every precision adds per block two fp32 rsqrt per token and
    SDPA's fp32 logsumexp per head.
    """

    block_h: int
    mlp_i: int
    final_norm_h: int
    residual: int
    weight_cast: int


SAVED_BYTES: dict[str, SavedBytes] = {
    "fp32": SavedBytes(40, 16, 12, 4, 0),
    "bf16-mixed": SavedBytes(34, 8, 10, 4, 2),
    "bf16-pure": SavedBytes(24, 8, 8, 2, 0),
}


@dataclass(frozen=True)
class LossBytes:
    """The loss's memory (bytes): `saved` for backward (part of the activations), `forward` live
    beside the activations at the end of the forward, `backward` live beside them while the
    loss's backward runs."""

    saved: int
    forward: int
    backward: int


def loss_bytes(
    kind: str, tokens: int, vocab: int, hidden: int, act: torch.dtype, chunk: int = DEFAULT_CHUNK_TOKENS
) -> LossBytes:
    """Memory of the training loss over `tokens` rows (N) of vocabulary V at activation dtype e.

    ``standard``: the (N, V) logits at e, an fp32 copy when e is not fp32, the fp32 log-softmax
    saved for backward (4 N V) with the labels (8 N) and the reduction's weight (4); its backward
    holds the NLL's (N, V) gradient and the log-softmax's input gradient (2 x 4 N V) beside the
    saved log-softmax (the cast of that gradient back to e comes after both are freed).
    The chunked kinds (never the (N, V) logits) take their terms from `effpretrain.loss.loss_bytes`,
    the formula their own tests check against a measurement: ``saved`` is what they hold from the
    forward to the backward (``chunked``: dH and dW, 4 N h + 4 V h; ``chunked_recompute``: one fp32
    logsumexp a token), and their transient lives while the loss runs: in the forward for
    ``chunked`` (its backward only scales dH and dW in place), in both for ``chunked_recompute``.
    The shifted labels (8 N) live during the forward.
    """
    N, V, e = tokens, vocab, act.itemsize
    if kind == "standard":
        return LossBytes(4 * N * V + 8 * N + 4, N * V * e + (4 * N * V if e != 4 else 0), 8 * N * V)
    from effpretrain.loss import loss_bytes as own_terms

    terms = own_terms(kind, N, V, hidden, act, chunk)  # ValueError naming an unknown kind
    backward = terms["transient"] if kind == "chunked_recompute" else 0
    return LossBytes(terms["saved"], terms["transient"] + 8 * N, backward)


@dataclass(frozen=True)
class Activations:
    """Saved-for-backward bytes of one micro-batch, by part (see `activation_terms`)."""

    blocks: tuple[int, ...]  # what each decoder block keeps until its backward
    block_full: int  # one block's full saved set (a checkpointed block's recompute)
    base: int  # token ids, RoPE tables, final norm, autocast weight copies
    loss: LossBytes

    @property
    def total(self) -> int:
        return sum(self.blocks) + self.base + self.loss.saved


def activation_terms(
    preset: str,
    vocab_size: int | None,
    batch_size: int,
    seq_len: int,
    checkpointed: Collection[int],
    dtype: str,
    *,
    rank_inputs: int = 0,
    rank: int = 0,
    linear_weights: tuple[int, int] = (0, 0),
    loss: str = "standard",
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Activations:
    """The saved activations of one micro-batch of N = `batch_size` x `seq_len` tokens.

    A full block saves ``N (block_h h + mlp_i i) + N (8 + 4 heads) + rank_inputs N r e`` bytes
    (`SavedBytes`; `rank_inputs`: the N x r tensors the factorized layers of a block save, at the
    activation itemsize e: `FactorSpec.rank_saves` per layer); a checkpointed block (in `checkpointed`) keeps only its input
    (``N h`` at the residual itemsize). The base: token ids (8 N), the RoPE cos/sin tables
    (2 T d at the residual itemsize, saved once unless every block is checkpointed), the final
    norm (``final_norm_h N h + 4 N``) and, under autocast, the bf16 copy of the head's weight;
    under autocast a full block also saves the bf16 copies of its linear weights (a checkpointed
    block casts them again in its recompute). `linear_weights`: (elements of one block's linear
    weights, of the head's). The loss's part is `loss_bytes`.
    """
    p, sb, e = PRESETS[preset], SAVED_BYTES[dtype], precision(dtype).activations.itemsize
    V, N = vocab_size or p.vocab, batch_size * seq_len
    full = (
        N * (sb.block_h * p.hidden + sb.mlp_i * p.intermediate + 8 + 4 * p.heads)
        + rank_inputs * N * rank * e
        + sb.weight_cast * linear_weights[0]
    )
    blocks = tuple(N * p.hidden * sb.residual if i in checkpointed else full for i in range(p.layers))
    rope = (
        0
        if all(i in checkpointed for i in range(p.layers))
        else 2 * seq_len * (p.hidden // p.heads) * sb.residual
    )
    base = 8 * N + rope + N * (sb.final_norm_h * p.hidden + 4) + sb.weight_cast * linear_weights[1]
    lb = loss_bytes(loss, N, V, p.hidden, precision(dtype).activations, loss_chunk_tokens)
    if loss == "chunked":
        # The head's product does not run through autograd: nothing saves the final norm's output
        # (as the head's input, e N h) nor autocast's copy of the head's weight; dH is held at the
        # residual stream's dtype, not the fp32 that `effpretrain.loss.loss_bytes` assumes.
        base -= N * p.hidden * e + sb.weight_cast * linear_weights[1]
        lb = dataclasses.replace(lb, saved=lb.saved - (4 - sb.residual) * N * p.hidden)
    return Activations(blocks, full, base, lb)


def checkpointed_layers(spec: int | Collection[int], layers: int) -> frozenset[int]:
    """The decoder layers checkpointed by `spec`: an int k, every k-th layer from layer 0 (0: none),
    or the layer indices themselves."""
    if isinstance(spec, int):
        return frozenset(range(0, layers, spec)) if spec > 0 else frozenset()
    return frozenset(spec)


def activation_bytes(
    preset: str,
    vocab_size: int | None,
    batch_size: int,
    seq_len: int,
    activation_checkpointing: int | Collection[int],
    dtype: str,
) -> int:
    """Saved activations of one micro-batch of a dense model with the standard loss
    (`activation_terms`)."""
    ck = checkpointed_layers(activation_checkpointing, PRESETS[preset].layers)
    return activation_terms(preset, vocab_size, batch_size, seq_len, ck, dtype).total


def _linear_elements(
    shapes: Iterable[ParamShape], factor: FactorSpec | None, targets: Sequence[str], rank: int, density: float
) -> tuple[int, int]:
    """Elements of one decoder block's linear weights (a factorized target's factors, sparse values
    and frozen W0) and of the head's: what autocast casts to bf16 in a forward."""
    block = head = 0
    for s in shapes:
        if s.linear is None or _layer_of(s.name) not in (0, None):
            continue
        n = math.prod(s.shape)
        if factor is not None and s.linear in targets:
            counts = factor.param_counts(*s.shape, rank, density)
            n = counts["trainable"] + counts["frozen"]
        if _layer_of(s.name) == 0:
            block += n
        else:
            head += n
    return block, head


def _layer_of(name: str) -> int | None:
    """The decoder layer a parameter belongs to (``model.layers.<i>.``), else None."""
    parts = name.split(".")
    if "layers" in parts and parts.index("layers") + 1 < len(parts):
        index = parts[parts.index("layers") + 1]
        return int(index) if index.isdigit() else None
    return None


@dataclass(frozen=True)
class DistTerms:
    """Per-rank bytes a data-parallel run adds: `buckets`, DDP's gradient buckets (one full
    gradient, allocated when DDP wraps the model and live at every moment of a step); with
    `grads_in_buckets` (``gradient_as_bucket_view=True``, the trainer's) the gradients are views
    into them, so no gradient is counted beside them; without it every gradient is a second copy.
    `gather`: FSDP2's unsharded parameters during forward and backward (the root unit's, which
    stay gathered, and two decoder layers': the current and the prefetched one, less the shards
    already counted); `reduce`: FSDP2's reduce-scatter input in backward (the largest unit's full
    gradient)."""

    buckets: int = 0
    grads_in_buckets: bool = False
    gather: int = 0
    reduce: int = 0


def _dist_terms(t: _Tally, sharding: str, world_size: int, bucket_view: bool) -> DistTerms:
    if world_size > 1 and sharding == "ddp":
        return DistTerms(buckets=t.grads, grads_in_buckets=bucket_view)
    if t.shard <= 1:
        return DistTerms()
    layers = [u for u in t.unit_full if u is not None] or [None]
    big = max(layers, key=lambda u: t.unit_full[u])
    unsharded = lambda u: t.unit_full.get(u, 0) - t.unit_mine.get(u, 0)  # noqa: E731
    gather = unsharded(None) + 2 * unsharded(big)
    return DistTerms(gather=gather, reduce=max(t.unit_full.values(), default=0))


def data_bytes(shuffle_buffer: int, seq_len: int) -> int:
    """The training data's memory during a step: the shuffle pool (`data.shuffle_buffer` rows of
    int32 ids and one int32 length each, ``4 P (T + 1)``) and the copy the trainer's step takes of
    it to undo a skipped step's draw: ``8 P (T + 1)``; 0 without a shuffle buffer."""
    return 8 * shuffle_buffer * (seq_len + 1)


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
        m["fsdp_gather"] = dist.gather
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
    out["block_backward"] = worst
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
    return out


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


def _peak(moments: dict[str, dict[str, int]]) -> tuple[int, str, dict[str, int]]:
    name = max(moments, key=lambda k: sum(moments[k].values()))
    terms = {k: v for k, v in moments[name].items() if v}
    return sum(terms.values()), name, terms


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
    activation_checkpointing: int | Collection[int] = 0,
    world_size: int = 1,
    sharding: str = "none",
    warm_start: bool = False,
    grad_accum: int = 1,
    loss: str = "standard",
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    restarts: bool = False,
    ddp_bucket_view: bool = True,
    data: int = 0,
    update_in_backward: bool = False,
    grad_clip: float = 0.0,
) -> Estimate:
    """Analytic memory of training `preset` with optimizer `method` (see module docstring).

    `dtype` is a `PRECISIONS` name. Under FSDP2 each parameter is split on dim 0 into
    `world_size` chunks with torch.chunk's sizes and the figures are rank 0's (the largest share).
    `warm_start`: the full-rank warm-start phase of a kind that has one (ReLoRA's W0 trained with
    the run's optimizer in a plain group, the factors frozen); ignored for other kinds.
    `activation_checkpointing`: every k-th layer (an int) or the layer indices. `restarts`: the
    run restarts (merges or refactorizes) factors, whose transient the step moment includes.
    `data`: the training data's bytes during a step (`data_bytes`; the trainer's runs).
    The peak is the largest moment of `peak_moments`.

    `update_in_backward` (``train.update_in_backward``): ``grads`` is the in-backward gradient
    figure between refreshes, accumulators + gradients in flight (`in_backward_terms`), and the
    moments are `in_backward_moments` (a refresh step's larger accumulators included in the
    peak). Detail keys: ``update_in_backward``, ``grads_all_parameters`` (every trainable
    gradient: the normal path's figure), ``grad_accumulators``, ``grad_accumulators_at_refresh``,
    ``grads_in_flight``, ``grads_at_refresh``, ``in_backward_step_transient`` and
    ``peak_between_refreshes``. Under FSDP2 the accumulators are per-rank shards (assumed: the
    in-backward FSDP2 path reduce-scatters every micro-step, so no unsharded gradient is kept);
    under DDP no gradient bucket is counted (assumed: each final gradient is all-reduced on its
    own in its hook, `InBackward`'s ``reduce``). Low-rank accumulators only with `grad_clip` 0
    (``train.grad_clip``): with clipping on every accumulator is full, so that the clipping norm
    is the whole gradient's in every launch mode (`effpretrain.in_backward`).
    """
    from effpretrain.config import OptimConfig

    optim_cfg = optim_cfg or OptimConfig(name=method)
    prec = precision(dtype)
    mspec = optimizers.method_spec(method)
    shard = world_size if sharding == "fsdp2" else 1
    t = _Tally(mspec, prec.params, shard, whole_state=shard > 1 and mspec.fsdp2_whole_state)
    t.low_rank_acc = shard == 1 and grad_clip <= 0
    factor = factor_spec(factor_kind) if factor_kind != "none" else None
    targets = list(factor_targets or ATTN_MLP_TARGETS)
    shapes = model_param_shapes(preset, vocab_size)
    _tally_params(
        t,
        shapes,
        projection_group(optim_cfg) if mspec.projects else None,
        list(optim_cfg.targets),
        factor,
        targets,
        factor_rank,
        density,
        warm_start,
        restarts,
        head_group(method, PRESETS[preset].hidden // PRESETS[preset].heads),
    )
    t.finish()
    p = PRESETS[preset]
    ck = checkpointed_layers(activation_checkpointing, p.layers)
    rank_saves = 0 if factor is None or (warm_start and factor.warm_starts) else factor.rank_saves
    acts = activation_terms(
        preset,
        vocab_size,
        batch_size,
        seq_len,
        ck,
        dtype,
        rank_inputs=len(set(targets) & set(ATTN_MLP_TARGETS)) * rank_saves,
        rank=factor_rank,
        linear_weights=_linear_elements(shapes, factor, targets, factor_rank, density),
        loss=loss,
        loss_chunk_tokens=loss_chunk_tokens,
    )
    t.block_temporaries = 2 * batch_size * seq_len * (p.hidden + p.intermediate) * prec.activations.itemsize
    ib = in_backward_terms(t, grad_accum) if update_in_backward else None
    # In backward, DDP's buckets are not used (assumed: each final gradient is reduced in its hook).
    dist = _dist_terms(t, "none" if ib and sharding == "ddp" else sharding, world_size, ddp_bucket_view)
    if ib is None:
        moments = peak_moments(t, acts, ck, grad_accum, dist, data)
    else:
        moments = in_backward_moments(t, acts, ck, grad_accum, dist, data, ib)
    peak, moment, terms = _peak(moments)
    detail = {
        "preset": preset,
        "method": method,
        "dtype": dtype,
        "factor": factor_kind,
        "world_size": world_size,
        "sharding": sharding,
        "sparse_index_bytes": t.index_bytes,
        "optimizer_state_per_rank": t.state_ranks,
        "checkpointed_layers": sorted(ck),
        "loss": loss,
        "peak_phase": "optimizer_step" if moment == "optimizer_step" else "forward_backward",
        "peak_moment": moment,
        "peak_terms": terms,
    }
    if ib is not None:
        detail.update(_in_backward_detail(t, ib, moments))
    grads = t.grads if ib is None else ib.grads
    return Estimate(t.weights, grads, t.state, acts.total, t.params, t.trainable, detail, peak=peak)


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
        "in_backward_step_transient": ib.step_transient,
        "peak_between_refreshes": _peak(steady)[0],
    }


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
    from effpretrain.errors import ConfigError

    budget = cfg.train.memory_budget_gb
    if budget is None:
        raise ConfigError("train.activation_checkpointing=auto needs train.memory_budget_gb")
    layers = PRESETS[cfg.model.preset].layers
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
    terms = sorted(d.get("peak_terms", {}).items(), key=lambda kv: -kv[1])[:top]
    lines.append(f"  peak at {d.get('peak_moment', '?')} ({d.get('peak_phase', '?')}), largest terms:")
    lines += [f"    {name:<22}{b / 1e9:>10.3f} GB" for name, b in terms]
    return "\n".join(lines)

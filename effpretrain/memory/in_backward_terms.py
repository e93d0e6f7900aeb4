"""The gradient terms of updates in backward: accumulators (low rank between refreshes where the update reads G only through R) and the gradients in flight, and the moments they add."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import optimizers
from optimizers import projection as proj
from optimizers.projected_adam import ComputedBasis

if TYPE_CHECKING:
    from effpretrain.memory.terms import _Tally


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

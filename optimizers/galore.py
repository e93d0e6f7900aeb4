"""GaLore: AdamW on the low-rank projection of each weight's gradient (PAPER.md 2.3)."""

from __future__ import annotations

from typing import Any

import torch

from optimizers import projection as proj
from optimizers.projected_adam import ProjectedAdam


class GaLoreAdamW(ProjectedAdam):
    """GaLore-AdamW (Zhao et al. 2024), drop-in for ``galore_torch.GaLoreAdamW``.

    For a projected m x n weight W with gradient G, every T steps a rank-r basis P is computed from
    G in fp32 (right side if m >= n: P is r x n; left otherwise: P is m x r; ``proj_type`` as in
    galore-torch). Each step:

        R = G P^T (right) or P^T G (left)
        M <- beta1 M + (1 - beta1) R,   V <- beta2 V + (1 - beta2) R^2,   N = M / (sqrt(V) + eps)
        W <- W - eta_t alpha back(N)    with back(N) = N P (right) or P N (left)
        W <- W - eta lambda W           (decoupled weight decay, applied after, as galore-torch)

    with eta_t = eta sqrt(1 - beta2^t) / (1 - beta1^t). With ``adam_convention="torch"`` the
    torch.optim.AdamW placement of eps and weight decay is used instead (see `ProjectedAdam`).
    Moments are kept across refreshes. Groups without ``rank`` run plain AdamW. With
    ``basis="svd"`` the numerics are galore-torch's; the default ``"randomized_svd"`` computes the
    basis much faster (benchmarks/optimizer_step.py).

    Group keys (paper symbol): ``rank`` (r), ``update_proj_gap`` (T, 200), ``scale`` (alpha, 1.0;
    the paper uses 0.25), ``proj_type`` ("std"), ``basis`` ("randomized_svd" | "svd" | "random" |
    "identity"), ``oversample`` (p), ``power_iters`` (q), ``warm_start``, ``seed``; and ``lr``
    (eta, 1e-3), ``betas`` (beta1, beta2; 0.9, 0.999), ``eps`` (1e-6), ``weight_decay`` (lambda, 0),
    ``correct_bias`` (True), ``adam_convention`` ("reference").

    State per projected weight: ``step``, ``refresh``, ``seed`` (ints), ``exp_avg``, ``exp_avg_sq``
    (low-rank, parameter dtype) and ``basis`` (P, parameter dtype). Memory for an m x n weight of
    itemsize s with k = min(r, m, n): right side 2 s m k + s k n; left side 2 s k n + s m k;
    non-projected 2 s m n (see `ProjectedAdam.state_bytes`).
    """

    def _projected_step(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        side = self._side(p, group)
        if side == "full":
            super()._projected_step(p, grad, state, group)
            return
        basis = self._current_basis(p, grad, state, group)
        if basis is None:
            return
        # R is needed only inside Adam: the op-by-op path may write N into its buffer.
        norm, step_size = self._adam(proj.project(grad, basis, side), state, group, reuse_x=True)
        # W <- W - eta_t alpha back(N) as one fused addmm_: no m x n temporary for back(N).
        self._decay(p, group, before=True)
        left, right = (norm, basis) if side == "right" else (basis, norm)
        p.addmm_(left, right, alpha=-step_size * float(group[self.SCALE_KEY]))
        self._decay(p, group, before=False)

    def _projected_update(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        low: torch.Tensor,
        norm: torch.Tensor,
        basis: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
    ) -> tuple[torch.Tensor, float]:
        # Used for proj_type "full". alpha folds into the step's scalar factor: one fewer m x n
        # temporary than back(N) * alpha.
        return self._back(norm, basis, p, group), float(group[self.SCALE_KEY])


__all__ = ["GaLoreAdamW"]

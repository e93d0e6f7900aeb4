"""GaLore: AdamW on the low-rank projection of each weight's gradient (Zhao et al. 2024)."""

from __future__ import annotations

from optimizers.projected_adam import Direction, ProjectedAdam, ProjectedStep


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

    PROJECTED_GRAD_ONLY = True  # the update is alpha back(Adam(R)): G enters only through R

    def _projected_update(self, s: ProjectedStep) -> tuple[Direction, float]:
        """alpha back(N). On one side back(N) = N P or P N is returned as that factor pair, so that
        it is applied as one fused addmm_ into W with no m x n temporary; alpha folds into the
        step's scalar factor."""
        alpha = float(s.group["scale"])
        if s.side == "right":
            return (s.norm, s.basis), alpha
        if s.side == "left":
            return (s.basis, s.norm), alpha
        return s.back(s.norm), alpha


__all__ = ["GaLoreAdamW"]

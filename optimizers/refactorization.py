"""Balanced re-split of low-rank factor pairs (the benchmark's "weight refactorization").

A factorized weight W = B A (B is m x r, A is r x n; any constant scale such as alpha / r sits
outside and is unaffected) is invariant under B A = (B M)(M^-1 A) for every invertible r x r M,
so the split between the two factors is a free choice that the model never sees but the optimizer
does: gradients are dL/dB = G A^T and dL/dA = B^T G, so badly scaled factors give badly scaled
updates. Glentis et al. (2025, section "restarts") periodically reset the split to the balanced one

    B A = U S V^T (thin SVD, rank r),    B <- U S^(1/2),    A <- S^(1/2) V^T,

after which B^T B = A A^T = S (diagonal and equal), which they report conditions training best.

The m x n product is never formed. With thin QR factorizations B = Q_B R_B and A^T = Q_A R_A
(Q_B m x r, Q_A n x r, orthonormal columns; R_B, R_A r x r),

    B A = Q_B (R_B R_A^T) Q_A^T,    R_B R_A^T = U_c S V_c^T (an r x r SVD),
    U = Q_B U_c,    V = Q_A V_c,

which costs O((m + n) r^2 + r^3) instead of the O(m n min(m, n)) of an SVD of B A. For the
llama_1b MLP shapes (m = 2048, n = 5461, r = 512) that is two skinny QRs and a 512 x 512 SVD
(see benchmarks/refactorization.py for the measured speedup).

Pure torch: knows nothing about modules or optimizers. Under FSDP2 `refactorize_` accepts the
sharded (DTensor) factors: each is gathered whole (`DTensor.full_tensor()`, one all-gather of B and
of A per pair), every rank computes the same balanced split of the whole pair, and each writes back
only its own shard, so refactorization operates on whole factors, identically on every rank
(transient cost: one full B and A per pair at a time).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from optimizers._sharded import whole, write_whole_
from optimizers.precision import full_fp32

__all__ = ["balanced_factors", "refactorize_"]


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    # fp32 at least: bf16/fp16 QR and SVD are either unsupported or far too inexact; keep fp64 as is.
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _core_svd(Bf: Tensor, Af: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """The rank-k SVD U S Vh of B A from two thin QRs and the small core's SVD (S descending),
    each component signed so that the result depends on B A only; and the core's size."""
    Q_B, R_B = torch.linalg.qr(Bf)  # m x r', r' x r (r' = min(m, r))
    Q_A, R_A = torch.linalg.qr(Af.T)  # n x r'', r'' x r
    U_c, S, Vh_c = torch.linalg.svd(R_B @ R_A.T, full_matrices=False)  # S descending
    core = max(U_c.shape)
    U = (Q_B @ U_c)[:, :k]  # m x k, orthonormal columns
    Vh = (Vh_c @ Q_A.T)[:k]  # k x n, orthonormal rows
    # Fix the SVD's per-component sign so the result depends on B A only (idempotence).
    rows = U.abs().argmax(dim=0)
    sign = torch.sign(U[rows, torch.arange(k, device=U.device)])
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return U * sign, S[:k], Vh * sign[:, None], core


def _split_roots(S: Tensor, tol: Tensor) -> tuple[Tensor, Tensor]:
    """S^1/2 for B's columns and A's rows; a direction below `tol` (torch.linalg.matrix_rank's
    threshold: round-off) gets a zero column of B and an RMS-scaled row of A, so it can learn."""
    alive = S > tol
    root = S.sqrt()
    if bool(alive.all()):
        return root, root
    rms = root[alive].pow(2).mean().sqrt()
    return torch.where(alive, root, torch.zeros_like(root)), torch.where(alive, root, rms.expand_as(root))


@full_fp32()
def balanced_factors(B: Tensor, A: Tensor, rank: int | None = None) -> tuple[Tensor, Tensor]:
    """Returns the balanced split (U S^1/2, S^1/2 V^T) of B A without forming B A.

    With `rank` = k the split is that of the rank-k truncated SVD of B A (its k largest singular
    triplets; Eckart-Young's best rank-k approximation), which is how LORO retracts a step back to
    rank k (optimizers/loro.py): the same two thin QRs and one small-core SVD.

    Computed in fp32 (fp64 if an input is fp64) and returned in that dtype; inputs are not
    modified. See the module docstring for the maths.

    The result is canonical, i.e. a function of the product B A only (for distinct singular
    values): each column of U is signed so that its largest-magnitude entry is positive (the
    sign freedom u_i v_i^T = (-u_i)(-v_i)^T of the SVD is fixed), so re-splitting an already
    balanced pair returns the same pair.

    Exactly rank-deficient products (singular value 0, up to fp32 round-off): the balanced split
    would give a zero column of B *and* a zero row of A, a direction that never receives gradient
    again (the "both factors zero" trap). For those directions the column of B is set to zero and
    the row of A to the corresponding unit right singular vector scaled to the RMS row norm of the
    non-degenerate part, so the product is unchanged and the direction can still learn (as in LoRA's
    B = 0, A random init). If the whole product is zero (e.g. a zero-initialised B that has not been
    stepped yet) the inputs are returned unchanged (as copies in the compute dtype).

    Args:
        B: m x r factor.
        A: r x n factor.
        rank: keep the k = `rank` largest directions (None: all r); the inner dimension r may then
            exceed min(m, n).

    Returns:
        (B', A'), m x k and k x n, with B' A' = B A (truncated to rank k), B'^T B' = A' A'^T = diag(S).

    Raises:
        ValueError: if shapes do not chain or k > min(m, n) (the balanced split has only
            min(m, n) nonzero directions, so k - min(m, n) of them would be dead).
    """
    if B.ndim != 2 or A.ndim != 2 or B.shape[1] != A.shape[0]:
        raise ValueError(
            f"refactorization needs B (m x r) and A (r x n); got {tuple(B.shape)} and {tuple(A.shape)}"
        )
    m, r = B.shape
    n = A.shape[1]
    k = r if rank is None else rank
    if not 1 <= k <= min(m, n):
        raise ValueError(f"rank {k} exceeds min(m, n)={min(m, n)} of a {m} x {n} factor pair")
    dtype = _compute_dtype(B, A)
    Bf = B.detach().to(dtype)
    Af = A.detach().to(dtype)

    U, S, Vh, core = _core_svd(Bf, Af, k)
    s_max = S[0]
    if s_max == 0:
        if k < r:  # a zero product truncated: B zero, A's rows orthonormal (still learnable)
            return torch.zeros_like(U), Vh
        return Bf.clone(), Af.clone()
    root_B, root_A = _split_roots(S, s_max * core * torch.finfo(dtype).eps)
    return U * root_B, root_A[:, None] * Vh


@torch.no_grad()
@full_fp32()
def refactorize_(pairs: Iterable[tuple[Tensor, Tensor]]) -> None:
    """Re-splits each (B, A) pair in place into its balanced form B = U S^1/2, A = S^1/2 V^T.

    The product B A is preserved up to fp32 round-off (relative error ~1e-6); the tensors keep
    their identity, dtype and device (results are computed in fp32 and cast back with `copy_`), so
    optimizer state keyed by the parameters stays attached. Optimizer moments of B and A are in the
    old coordinates afterwards; reset them (optimizers.momentum_reset.reset_) as the benchmark does.

    Args:
        pairs: (B, A) with B m x r and A r x n, e.g. `effpretrain.models.factorized.factor_pairs(model)`.
            A scale such as alpha / r applied outside B A is unaffected.

    Raises:
        ValueError: see `balanced_factors`.
    """
    for B, A in pairs:
        B_new, A_new = balanced_factors(whole(B), whole(A))
        write_whole_(B, B_new)
        write_whole_(A, A_new)

"""SWAN: stateless row standardisation and whitening for hidden matrices, AdamW for the rest."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from optimizers._matrix import MatrixOptimizer
from optimizers.precision import full_fp32
from optimizers.writer import written


def grad_norm(g: torch.Tensor, eps: float) -> torch.Tensor:
    """GradNorm: each row standardised over the n columns, (G - g_bar 1^T) / (s 1^T) with g_bar
    and s the rows' mean and (population) standard deviation; s is floored at `eps`. fp32."""
    x = g.float()
    mean = x.mean(dim=1, keepdim=True)
    centred = x - mean
    std = centred.square().mean(dim=1, keepdim=True).sqrt().clamp_min(eps)
    return centred / std


@full_fp32()
def inverse_sqrt_newton_schulz(a: torch.Tensor, steps: int) -> torch.Tensor:
    """A^{-1/2} of a symmetric positive definite k x k matrix by the coupled Newton-Schulz
    iteration: with c = ||A||_F (so the spectrum of A / c lies in (0, 1]), Y_0 = A / c, Z_0 = I,
    T = (3 I - Z Y) / 2, Y <- Y T, Z <- T Z; Z -> (A / c)^{-1/2}, so A^{-1/2} ~ Z / sqrt(c).
    Converges for every such spectrum (quadratically once near I; eigenvalues near 0 take more
    steps)."""
    c = a.norm().clamp_min(1e-30)
    y = a / c
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    z = eye.clone()
    for _ in range(steps):
        t = 0.5 * (3.0 * eye - z @ y)
        y = y @ t
        z = t @ z
    return z / c.sqrt()


@full_fp32()
def grad_whitening(x: torch.Tensor, steps: int) -> torch.Tensor:
    """GradWhitening: (X X^T)^{-1/2} X for a wide (m <= n) X, X (X^T X)^{-1/2} for a tall one
    (the Gram matrix of the short side, which is invertible for a full-rank X; both are the polar
    factor U V^T of X = U S V^T)."""
    if x.shape[0] <= x.shape[1]:
        return inverse_sqrt_newton_schulz(x @ x.T, steps) @ x
    return x @ inverse_sqrt_newton_schulz(x.T @ x, steps)


class SWAN(MatrixOptimizer):
    """SWAN (Ma, Gong, Scetbon and Meeds, "SWAN: SGD with Normalization and Whitening Enables
    Stateless LLM Training", ICML 2025) for ``matrix=True`` groups (attention and MLP weights),
    AdamW for embeddings, head and vectors.

    For a matrix weight W (m x n) with gradient G, learning rate eta, weight decay lambda:

        G~ <- GradNorm(G) = (G - g_bar 1^T) / (s 1^T)   (row mean g_bar, row std s; `grad_norm`)
        D  <- GradWhitening(G~) = (G~ G~^T)^{-1/2} G~    (`grad_whitening`, Newton-Schulz, k steps)
        D  <- D ||G~||_F / ||D||_F                       (if ``rescale``: the paper's optional
                                                          rescaling, so the update has G~'s RMS, 1)
        W  <- W (1 - eta lambda) - eta D

    computed in fp32 and applied in the parameter's dtype. Options (every group): ``ns_steps`` k
    (10), ``norm_eps`` (1e-8, the floor on s), ``rescale`` (True).

    State: none for matrix weights beyond the python int ``step``: 0 bytes; AdamW's ``2 s numel``
    for the other parameters (s the itemsize; `state_bytes`).
    """

    MATRIX_DEFAULTS: ClassVar[dict[str, Any]] = {"ns_steps": 10, "norm_eps": 1e-8, "rescale": True}

    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        if int(group["ns_steps"]) < 1:
            raise ValueError(f"ns_steps must be >= 1, got {group['ns_steps']!r}")

    def _matrix_update(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        x = grad_norm(g, group["norm_eps"])
        d = grad_whitening(x, int(group["ns_steps"]))
        if group["rescale"]:
            d = d * (x.norm() / d.norm().clamp_min(1e-30))
        with written(p) as w:
            w.mul_(1.0 - group["lr"] * group["weight_decay"])
            w.add_(d.to(w.dtype), alpha=-group["lr"])


__all__ = ["SWAN", "grad_norm", "grad_whitening", "inverse_sqrt_newton_schulz"]

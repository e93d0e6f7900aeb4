"""SinkGD: stateless alternating row and column normalisation for hidden matrices, AdamW for the rest."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from optimizers._matrix import MatrixOptimizer
from optimizers.writer import written


def sinkhorn_normalise(g: torch.Tensor, iterations: int, eps: float = 1e-30) -> torch.Tensor:
    """L alternating normalisations of an m x n matrix (fp32), Sinkhorn-like: each iteration
    rescales every row to l2 norm sqrt(n), then every column to l2 norm sqrt(m)
    (X <- sqrt(n) Q(X)^{-1} X, X <- sqrt(m) X R(X)^{-1}, Q and R the diagonal row and column
    norms). Both constraints hold together at the fixed point (sum of squares m n either way);
    the iteration approaches it geometrically. Norms are floored at `eps` (a zero row stays zero)."""
    m, n = g.shape
    x = g.float()
    for _ in range(iterations):
        x = x * (math.sqrt(n) / x.norm(dim=1, keepdim=True).clamp_min(eps))
        x = x * (math.sqrt(m) / x.norm(dim=0, keepdim=True).clamp_min(eps))
    return x


class SinkGD(MatrixOptimizer):
    """SinkGD (Scetbon, Ma, Gong and Meeds, "Gradient Multi-Normalization for Stateless and
    Scalable LLM Training", 2025) for ``matrix=True`` groups (attention and MLP weights), AdamW
    for embeddings, head and vectors.

    For a matrix weight W (m x n) with gradient G, learning rate eta, weight decay lambda:

        D <- SR_L(G)    (`sinkhorn_normalise`: L alternating row / column normalisations, so that
                         rows have norm sqrt(n) and columns sqrt(m): every entry RMS 1)
        W <- W (1 - eta lambda) - eta D

    computed in fp32, applied in the parameter's dtype. Options (every group): ``iterations`` L (5).

    State: none for matrix weights beyond the python int ``step``: 0 bytes; AdamW's ``2 s numel``
    for the other parameters (s the itemsize; `state_bytes`).
    """

    MATRIX_DEFAULTS: ClassVar[dict[str, Any]] = {"iterations": 5}

    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        if int(group["iterations"]) < 1:
            raise ValueError(f"iterations must be >= 1, got {group['iterations']!r}")

    def _matrix_update(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        d = sinkhorn_normalise(g, int(group["iterations"]))
        with written(p) as w:
            w.mul_(1.0 - group["lr"] * group["weight_decay"])
            w.add_(d.to(w.dtype), alpha=-group["lr"])


__all__ = ["SinkGD", "sinkhorn_normalise"]

"""Muon: Newton-Schulz orthogonalised momentum for hidden matrices, AdamW for everything else."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from optimizers._matrix import MatrixOptimizer, newton_schulz_orthogonalise
from optimizers.momentum_reset import RESET_KEYS
from optimizers.writer import written

MOMENTUM_BUFFER = "momentum_buffer"
"""B, Muon's momentum (torch.optim.Muon's key)."""

#: Keller Jordan's quintic coefficients (a, b, c), torch.optim.Muon's defaults.
NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
ADJUST_LR: tuple[str, ...] = ("original", "match_rms_adamw", "none")


def adjusted_lr(lr: float, shape: tuple[int, ...], how: str) -> float:
    """The learning rate Muon applies to an A x B matrix: "original" (Keller Jordan's)
    eta sqrt(max(1, A / B)); "match_rms_adamw" (Moonlight, "Muon is Scalable for LLM Training")
    0.2 eta sqrt(max(A, B)), which gives the update AdamW's RMS so that AdamW's LR and weight decay
    carry over; "none" eta."""
    a, b = shape[:2]
    if how == "original":
        return lr * math.sqrt(max(1.0, a / b))
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    return lr


class Muon(MatrixOptimizer):
    """Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training") for
    ``matrix=True`` groups (the attention and MLP weights), AdamW for embeddings, head and vectors.

    For a matrix weight W (A x B) with gradient G, momentum mu, learning rate eta, weight decay
    lambda, per step (torch.optim.Muon's rule, op for op):

        B <- mu B + (1 - mu) G                     (``momentum_buffer``, a lerp)
        U <- (1 - mu) G + mu B if nesterov else B
        O <- NS_k^{(a,b,c)}(U)                     (`newton_schulz_orthogonalise`, bf16, k steps)
        W <- W (1 - eta lambda) - eta' O,          eta' = `adjusted_lr`(eta, (A, B), adjust_lr)

    The default ``adjust_lr="match_rms_adamw"`` (Moonlight's 0.2 sqrt(max(A, B))) lets Muon share
    AdamW's learning rate, so the recipes use the benchmark's AdamW LR for both parts; torch's own
    default is "original". Other parameters: AdamW (`optimizers._matrix`).

    Options (every group): ``momentum`` mu (0.95), ``nesterov`` (True), ``ns_steps`` k (5),
    ``ns_coefficients`` (a, b, c) (`NS_COEFFICIENTS`), ``ns_eps`` (1e-7), ``adjust_lr``.

    State: ``step`` (int) and, per matrix weight, ``momentum_buffer`` B (its shape and dtype);
    AdamW's ``exp_avg``, ``exp_avg_sq`` for the other parameters. Exact bytes, s the itemsize:
    ``s A B`` per matrix weight, ``2 s numel`` per other parameter (`state_bytes`).
    """

    RESET_KEYS: ClassVar[tuple[str, ...]] = (*RESET_KEYS, MOMENTUM_BUFFER)
    """A momentum reset zeroes the matrices' momentum B too (`optimizers.momentum_reset`)."""

    MATRIX_DEFAULTS: ClassVar[dict[str, Any]] = {
        "momentum": 0.95,
        "nesterov": True,
        "ns_steps": 5,
        "ns_coefficients": NS_COEFFICIENTS,
        "ns_eps": 1e-7,
        "adjust_lr": "match_rms_adamw",
    }

    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        group["ns_coefficients"] = tuple(group["ns_coefficients"])
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {group['momentum']!r}")
        if int(group["ns_steps"]) < 1 or len(group["ns_coefficients"]) != 3:
            raise ValueError("ns_steps must be >= 1 and ns_coefficients three numbers")
        if group["adjust_lr"] not in ADJUST_LR:
            raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {group['adjust_lr']!r}")

    def _init_matrix_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        state[MOMENTUM_BUFFER] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)

    def _matrix_update(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        mu, lr = group["momentum"], group["lr"]
        buf = state[MOMENTUM_BUFFER]
        buf.lerp_(g, 1.0 - mu)
        u = g.lerp(buf, mu) if group["nesterov"] else buf
        o = newton_schulz_orthogonalise(u, group["ns_coefficients"], int(group["ns_steps"]), group["ns_eps"])
        with written(p) as w:
            w.mul_(1.0 - lr * group["weight_decay"])
            w.add_(o, alpha=-adjusted_lr(lr, tuple(p.shape), group["adjust_lr"]))

    @classmethod
    def matrix_state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """One momentum buffer: ``s A B``."""
        return math.prod(shape) * dtype.itemsize


__all__ = ["ADJUST_LR", "MOMENTUM_BUFFER", "NS_COEFFICIENTS", "Muon", "adjusted_lr"]

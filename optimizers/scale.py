"""SCALE: column-normalised SGD for every matrix, momentum on the LM head only, AdamW for vectors."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from optimizers._matrix import MatrixOptimizer
from optimizers._sharded import local
from optimizers.momentum_reset import RESET_KEYS
from optimizers.writer import written

MOMENT1 = "moment1"
"""M, the head's momentum (the reference code's key)."""


def unit_rms(x: torch.Tensor, dim: int, eps: float = 1e-8) -> torch.Tensor:
    """x / sqrt(mean(x^2 over `dim`)), the RMS floored at `eps` (fp32): dim 1 gives every row of
    a torch (out x in) weight unit RMS, i.e. every output neuron's gradient."""
    xf = x.float()
    return xf / xf.square().mean(dim=dim, keepdim=True).sqrt().clamp_min(eps)


class SCALE(MatrixOptimizer):
    """SCALE (Glentis, Li, Han and Hong, "A Minimalist Optimizer Design for LLM Pretraining",
    arXiv 2506.16659; OptimAI-Lab/Minimalist_LLM_Pretraining mem_eff_pt/pt_scale) for every matrix
    (``matrix=True`` groups), AdamW for vectors.

    The paper's "column-wise normalisation" normalises along the output dimension of y = W x: for a
    torch nn.Linear weight stored (out x in) that is each ROW (an output neuron's weights over the
    inputs, reduced over dim 1); for the embedding (vocab x hidden, used as W^T) each COLUMN
    (reduced over dim 0), as the reference code does. For a matrix weight W with gradient G,
    learning rate eta, weight decay lambda, by ``role``:

        hidden, embedding:  D <- G / RMS(G)               (`unit_rms`, dim 1; embedding: dim 0)
        head:               M <- beta M + (1 - beta) G;   D <- M / RMS(M)   (dim 1)
        W <- W (1 - eta lambda) - eta D

    with the RMS floored at 1e-8, computed in fp32. Vectors get AdamW at ``adam_lr`` (the
    reference's separate AdamW learning rate); the reference puts eps outside the bias-corrected
    sqrt (m / (sqrt(v) + eps) sqrt(bc2) / bc1), torch's AdamW used here inside: they differ only by
    eps (1e-8) placement. Options (every group): ``momentum`` beta (0.9).

    Under FSDP2 the row-normalised roles (hidden, head) step on their row shards, the embedding
    whole on its owner rank (`ROW_LOCAL_ROLES`).

    State: ``step`` (int); the head's ``moment1`` (its shape and dtype): ``s m n`` bytes; other
    matrices none (0 bytes); AdamW's ``2 s numel`` for vectors (s the itemsize; `state_bytes`).
    """

    MATRIX_DEFAULTS: ClassVar[dict[str, Any]] = {"momentum": 0.9}
    RESET_KEYS: ClassVar[tuple[str, ...]] = (*RESET_KEYS, MOMENT1)
    """A momentum reset zeroes the head's momentum too (`optimizers.momentum_reset`)."""
    #: Row normalisation is row-local: under FSDP2 hidden weights and the head step on their row
    #: shards (the head's momentum sharded like it); the embedding's column norms need it whole.
    ROW_LOCAL_ROLES: ClassVar[tuple[str, ...]] = ("hidden", "head")

    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {group['momentum']!r}")

    def _init_matrix_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        if group["role"] == "head":
            state[MOMENT1] = torch.zeros_like(p)  # an FSDP2 shard's momentum stays a shard

    def _matrix_update(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        if group["role"] == "head":
            g = local(state[MOMENT1]).lerp_(g, 1.0 - group["momentum"])
        d = unit_rms(g, dim=0 if group["role"] == "embedding" else 1)
        with written(p) as w:
            w.mul_(1.0 - group["lr"] * group["weight_decay"])
            w.add_(d.to(w.dtype), alpha=-group["lr"])

    @classmethod
    def matrix_state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """The head's momentum, ``s m n``; 0 for other matrices."""
        return math.prod(shape) * dtype.itemsize if group.get("role", "hidden") == "head" else 0


__all__ = ["MOMENT1", "SCALE", "unit_rms"]

"""Adam-mini: Adam with one second moment per parameter block (Zhang et al. 2024, arXiv 2406.16793)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from optimizers._owners import DEFAULT_BUCKET_BYTES, OwnerPlaced
from optimizers._sharded import is_dtensor
from optimizers.writer import written

#: Group key: how many consecutive dim-0 slices (rows) form one block; None: the default partition.
BLOCK_ROWS = "block_rows"


def num_blocks(shape: tuple[int, ...], block_rows: int | None) -> int:
    """Blocks of a `shape` tensor: ``rows / block_rows``; with None one per row of a matrix (an
    output neuron, or a token of an embedding) and one for a vector or a scalar (a norm's gain)."""
    rows = shape[0] if shape else 1
    if block_rows is None:
        return rows if len(shape) >= 2 else 1
    return rows // int(block_rows)


class AdamMini(OwnerPlaced, torch.optim.Optimizer):
    """Adam-mini (Zhang et al. 2024): AdamW whose second moment is one scalar per block.

    A parameter W is cut along dim 0 into B blocks of ``block_rows`` consecutive rows each (the
    group key; see `num_blocks` for its default). For the gradient G, with G_b the entries of
    block b and |b| their count, at step t:

        v_b <- beta2 v_b + (1 - beta2) mean(G_b^2)          (one scalar per block)
        W   <- W (1 - eta lambda)                            (decoupled weight decay, first)
        M   <- beta1 M + (1 - beta1) G                       (full first moment)
        W_b <- W_b - eta / (1 - beta1^t) M_b / (sqrt(v_b / (1 - beta2^t)) + eps)

    The partition (the paper's, and the reference package ``adam-mini``'s for a LLaMA model): one
    block per attention head for the query and key weights (``block_rows`` = the head size,
    given by the trainer from the model config; a key weight under grouped-query attention has
    one block per key-value head), one per output neuron (row) for every other matrix (value,
    output projection, MLP; the embedding and the LM head: one per token), one per tensor for
    norm gains (vectors, the default); ``block_rows=1`` on a bias gives one per entry (Adam).

    Args:
        params: parameters or torch param groups; a group may set ``block_rows``.
        lr: eta.
        betas: (beta1, beta2).
        eps: added to the bias-corrected sqrt(v) (1e-8, the reference's default).
        weight_decay: lambda, decoupled, applied before the update (torch.optim.AdamW's order).
        whole_matrix: under FSDP2, where a sharded parameter steps: "owner" (once, on its owner
            rank, which alone holds its state) or "gather" (on every rank).
        bucket_bytes: "owner": the most whole W and G bytes one owner gathers per collective.

    State per parameter: ``step`` (int t), ``exp_avg`` (M, the parameter's shape and dtype),
    ``exp_avg_sq`` (v, B entries in the parameter dtype). Exact bytes for a parameter of N entries,
    itemsize s and B blocks: ``s N + s B`` (`state_bytes`).

    FSDP2: a block of several rows (a head) can straddle two ranks' row shards, and a norm's
    single block always does, so every sharded parameter steps whole on one owner rank
    (optimizers/_owners.py, ``ELEMENTWISE = False``): bitwise the single-process step, the state
    whole on that rank alone (per-rank state ~1/N of the total).
    """

    ELEMENTWISE: ClassVar[bool] = False
    """Under FSDP2 every sharded parameter steps whole (its blocks are not row-shard-local)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        whole_matrix: str = "owner",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Invalid betas {betas}: each must be in [0.0, 1.0)")
        self._init_owners(whole_matrix, bucket_bytes)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            BLOCK_ROWS: None,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group, then checks that ``block_rows`` divides every parameter's rows."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["betas"] = tuple(group["betas"])
        rows = group[BLOCK_ROWS]
        if rows is None:
            return
        if int(rows) < 1:
            raise ValueError(f"block_rows must be a positive int or None, got {rows!r}")
        for p in group["params"]:
            if p.ndim == 0 or p.shape[0] % int(rows):
                raise ValueError(
                    f"block_rows={rows} does not divide the rows of a {tuple(p.shape)} parameter"
                )

    @classmethod
    def state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Exact state bytes after >= 1 step: ``s (N + B)`` for N entries and B blocks (`num_blocks`
        of the group's ``block_rows``, default None); ``step`` is a python int (0 bytes)."""
        shape = tuple(shape)
        return (math.prod(shape) + num_blocks(shape, group.get(BLOCK_ROWS))) * dtype.itemsize

    def _whole_step_params(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        return [(p, g) for g in self.param_groups for p in g["params"] if is_dtensor(p)]

    def _init_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        state["step"] = 0
        state["exp_avg"] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        blocks = num_blocks(tuple(p.shape), group[BLOCK_ROWS])
        state["exp_avg_sq"] = torch.zeros(blocks, dtype=p.dtype, device=p.device)

    def _param_step(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """One Adam-mini step of a plain (whole) parameter (see the class docstring)."""
        if not state:
            self._init_state(p, group, state)
        beta1, beta2 = group["betas"]
        lr, v, m = group["lr"], state["exp_avg_sq"], state["exp_avg"]
        blocks = v.numel()
        g = grad.reshape(blocks, -1)
        v.mul_(beta2).add_(torch.mean(g * g, dim=1), alpha=1.0 - beta2)
        state["step"] += 1
        t = state["step"]
        m.lerp_(grad, 1.0 - beta1)
        denom = (v.sqrt() / math.sqrt(1.0 - beta2**t)).add_(group["eps"])
        factor = (1.0 / (1.0 - beta1**t)) / denom
        update = (m.reshape(blocks, -1) * factor.view(blocks, 1)).view(p.shape)
        with written(p) as w:
            if group["weight_decay"] > 0.0:
                w.mul_(1.0 - lr * group["weight_decay"])
            w.add_(update.mul_(lr), alpha=-1.0)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimisation step over every parameter that has a gradient (placed by
        `OwnerPlaced._placed_step`: under FSDP2 every weight steps whole, since a head or norm
        block can straddle two ranks' rows).

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).
        """
        return self._placed_step(
            closure,
            steps_whole=lambda group, p: True,
            step_one=lambda w, g, state, group, index: self._param_step(w, g, state, group),
            # State in the parameter's dtype: an owner steps a bf16 weight as its fp32 value.
            init_state=lambda like, group, state, index: self._init_state(like, group, state),
            skip_zero=False,
        )


__all__ = ["BLOCK_ROWS", "AdamMini", "num_blocks"]

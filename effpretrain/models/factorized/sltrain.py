"""SLTrain: low rank plus a fixed random sparse support, one fused autograd Function."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from effpretrain.models.factorized.layers import FactorizedLinear, _kaiming_, init_on_cpu_, sparse_nnz

logger = logging.getLogger("effpretrain")


def _sparse_plus_low_rank(B: Tensor, A: Tensor, values: Tensor, index: Tensor, scale: float) -> Tensor:
    """W = s B A + S as one fresh m x n tensor: s B A, scaled in place, then S's entries added in place.

    The support is distinct, so index_add_ is a scatter; the order of the operations is fixed so that
    the forward and the backward's recomputation produce the same W bit for bit.
    """
    w = torch.mm(B, A).mul_(scale)
    w.view(-1).index_add_(0, index, values)
    return w


class _SparsePlusLowRankLinear(torch.autograd.Function):
    """y = x W^T + b with W = s B A + S, saving x, B, A, the values and the index but never W.

    With G = dy and X = x as (tokens x m) and (tokens x n) matrices, dW = G^T X (m x n) and:
    dx = G W (W recomputed from the saved tensors, then freed); dvalues = dW at the support
    (gathered from the flat m n entries); dB = (s dW) A^T; dA = B^T (s dW); db = sum of G's rows.
    The operations run in the order autograd runs them through the dense graph (scale first, then
    the factor products), so the results equal the dense path's.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        B: Tensor,
        A: Tensor,
        values: Tensor,
        index: Tensor,
        bias: Tensor | None,
        scale: float,
    ) -> Tensor:
        w = _sparse_plus_low_rank(B, A, values, index, scale)
        y = F.linear(x, w, bias)
        del w  # the point of this Function: the dense weight does not outlive the forward
        ctx.scale, ctx.x_shape = scale, x.shape
        # Only what a needed gradient reads: W's recomputation (for dx) reads B, A, values and the
        # index; dW = G^T X reads x, then dB reads A, dA reads B and dvalues the index.
        need_x, need_b, need_a, need_v = ctx.needs_input_grad[:4]
        need_w = need_b or need_a or need_v
        ctx.save_for_backward(
            x if need_w else None,
            B if need_x or need_a else None,
            A if need_x or need_b else None,
            values if need_x else None,
            index if need_x or need_v else None,
        )
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, B, A, values, index = ctx.saved_tensors
        need_x, need_b, need_a, need_v, _, need_bias, _ = ctx.needs_input_grad
        g = dy.reshape(-1, dy.shape[-1])
        dx = d_b = d_a = d_v = d_bias = None
        if need_x:
            w = _sparse_plus_low_rank(B, A, values, index, ctx.scale)
            dx = torch.mm(g, w).view(ctx.x_shape)
            del w  # freed before dW is formed: one m x n transient at a time
        if need_b or need_a or need_v:
            dw = torch.mm(g.t(), x.reshape(-1, x.shape[-1]))
            if need_v:
                d_v = dw.view(-1).index_select(0, index)
            dw.mul_(ctx.scale)
            d_b = torch.mm(dw, A.t()) if need_b else None
            d_a = torch.mm(B.t(), dw) if need_a else None
        if need_bias:
            d_bias = g.sum(0)
        return dx, d_b, d_a, d_v, None, d_bias, None


class SLTrainLinear(FactorizedLinear):
    """Sparse plus low-rank: y = (s B A + S) x + b, S on a fixed random support (SLTrain).

    The support is floor(delta m n) distinct flat indices into the m x n matrix, drawn once from
    `torch.Generator().manual_seed(seed)` and stored as the persistent int64 buffer `sparse_index`
    (so it is saved in the state dict and restored exactly); `sparse_values` holds the trainable
    entries, init U(+-1/sqrt(n)). B = 0, A Kaiming.

    Memory: the forward materialises W = s B A + S (one m x n tensor) only while it computes y and
    saves for backward x, B, A, the values and the index, never W. With x and every parameter
    requiring grad, the bytes one forward saves (each storage counted once) are

        saved = bytes(x) + r (m + n) e + nnz e + 8 nnz

    with e the bytes per element of the dtype the product runs in: the parameters' dtype, or under
    autocast the autocast dtype (x, B, A and the values saved are then cast copies). A gradient that
    is not needed drops what only it reads (without dx, W is not recomputed and the values are not
    saved). Outside autocast B, A and the values are the parameters themselves, so what a forward
    adds to memory until its backward is x (often shared with the neighbouring layers), not an
    m x n weight per layer as autograd through the dense formula keeps (a llama_1b MLP layer in bf16
    at rank 512, density 0.03: 11.0 MB plus x here, 33.4 MB plus x there; about 2.4 GB less per
    forward over the model; benchmarks/sltrain_saved.py).
    The backward recomputes W for dx (one more B A product, 2 m n r FLOPs per step, not counted
    by `FactorSpec.flops_per_token`, like any recomputation), frees it, then forms the dense
    gradient dW = dy^T x from which the values', B's and A's gradients are taken: at most one m x n
    transient at a time. Outputs and gradients equal autograd through the dense formula.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        density: float = 0.03,
        seed: int = 0,
        bias: nn.Parameter | bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, rank, alpha, bias, device, dtype)
        self.density = float(density)
        self.seed = int(seed)
        nnz = sparse_nnz(out_features, in_features, density)
        gen = torch.Generator().manual_seed(self.seed)
        # Sorted indices: coalesced, cache-friendly scatter; the set is what matters.
        support = torch.randperm(out_features * in_features, generator=gen)[:nnz].sort().values
        self.register_buffer("sparse_index", support.to(device=device), persistent=True)
        self.sparse_values = nn.Parameter(torch.empty(nnz, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A Kaiming, B zero, sparse values U(+-1/sqrt(n)); the support is fixed for life."""
        _kaiming_(self.A)
        nn.init.zeros_(self.B)
        bound = 1.0 / math.sqrt(self.in_features)
        init_on_cpu_(self.sparse_values, lambda x: nn.init.uniform_(x, -bound, bound))

    def forward(self, x: Tensor) -> Tensor:
        tensors = [x, self.B, self.A, self.sparse_values]
        bias = self.bias
        device = x.device.type
        if not torch.is_autocast_enabled(device):
            return _SparsePlusLowRankLinear.apply(*tensors, self.sparse_index, bias, self.scale)
        # Autocast does not reach inside a custom Function: cast its inputs (as torch.amp.custom_fwd
        # does; the casts' backward returns the gradients in the parameters' dtype) and run it as is.
        dtype = torch.get_autocast_dtype(device)
        tensors = [t.to(dtype) for t in tensors]
        bias = None if bias is None else bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return _SparsePlusLowRankLinear.apply(*tensors, self.sparse_index, bias, self.scale)

    @torch.no_grad()
    def dense_weight(self) -> Tensor:
        B, A, values = self.B.float(), self.A.float(), self.sparse_values.float()
        return _sparse_plus_low_rank(B, A, values, self.sparse_index, self.scale).to(self.B.dtype)

    def extra_repr(self) -> str:
        nnz = self.sparse_index.numel()
        return f"{super().extra_repr()}, density={self.density:g}, nnz={nnz}, seed={self.seed}"

"""Factorized linear layers and the model surgery that installs them.

Notation (docs/methods.md): a target Linear computes y = W x + b with W m x n (out x in); r is the
rank, alpha a fixed scale, s = alpha / r. Every layer keeps its factors as B (m x r) and A (r x n).

| layer         | effective weight           | trainable           | frozen | init                           |
|---------------|----------------------------|---------------------|--------|--------------------------------|
| LowRankLinear | s B A                      | B, A: r (m + n)     | -      | B, A Kaiming-uniform           |
| LoRALinear    | W0 + s B A                 | B, A: r (m + n)     | W0: mn | B = 0, A Kaiming, W0 kept      |
| ReLoRALinear  | W0 + s B A, merged every N | B, A: r (m + n)     | W0: mn | as LoRA                        |
| SLTrainLinear | s B A + S (fixed support)  | B, A + S values nnz | -      | B = 0, A Kaiming, S U(+-1/rtn) |
| CoLALinear    | none: y = B sigma(s A x)   | B, A: r (m + n)     | -      | B, A N(0, (r (m + n))^-1/2)    |
| CoLAMLinear   | as CoLA, saves only s A x  | B, A: r (m + n)     | -      | as CoLA                        |

(nnz = floor(delta m n); "rtn" is sqrt(n); SLTrain also holds an int64 index buffer of nnz
elements; a bias, if the original Linear had one, is kept and trained.) "Kaiming-uniform" is
nn.Linear's default init, U(+-1/sqrt(fan_in)): fan_in = n for A and r for B.

Sources: Low-Rank and restarts, Glentis et al. 2025 (the benchmark); LoRA, Hu et al. 2021;
ReLoRA, Lialin et al. 2023; SLTrain, Han et al. 2024; CoLA and CoLA-M, Liu et al. 2025. Two known bugs of public ReLoRA-style code
are avoided by construction: B and A are never both zero-initialised (no gradient would ever
reach either), and the optimizer state is only reset or pruned after B A was merged into W0 (else
the update is lost).

Every layer offers `factor_pair()` -> (B, A) for optimizers.refactorization.refactorize_ (SLTrain's
sparse part is not part of the pair and is left alone) and, except CoLA's (no dense equivalent),
`dense_weight()` -> the m x n effective weight (for export and merging).
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from optimizers._sharded import whole, write_whole_
from optimizers.momentum_reset import prune_, reset_, unwrap_optimizer

__all__ = [
    "COLA_ACTIVATIONS",
    "CoLALinear",
    "CoLAMLinear",
    "FACTOR_KINDS",
    "FactorSpec",
    "FactorizedLinear",
    "LoRALinear",
    "LowRankLinear",
    "ReLoRALinear",
    "SLTrainLinear",
    "TARGETS",
    "apply_factorization",
    "begin_warm_start_",
    "end_warm_start_",
    "factor_pairs",
    "factor_spec",
    "factorized_param_counts",
    "merge_factorized_",
    "relora_merge_",
    "sparse_nnz",
    "warm_start_layers",
    "warm_start_params",
    "warming_up",
]

logger = logging.getLogger("effpretrain")

TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _kaiming_(t: Tensor) -> None:
    # nn.Linear's default: kaiming_uniform(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    nn.init.kaiming_uniform_(t, a=math.sqrt(5))


def sparse_nnz(m: int, n: int, density: float) -> int:
    """floor(density * m * n), exact for decimal densities (0.29 * 100 is 29, not 28)."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"SLTrain density must be in (0, 1], got {density}")
    return math.floor(Fraction(str(density)) * m * n)


class FactorizedLinear(nn.Module):
    """Shared base: shapes, the scale s = alpha / r, the factors B (m x r) and A (r x n), a bias.

    Subclasses define `forward` and `dense_weight`. `bias`: None/False for none, the (trainable)
    bias parameter of the Linear being replaced, or True for a new one initialised as nn.Linear's.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        bias: nn.Parameter | bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= rank <= min(in_features, out_features):
            raise ValueError(f"rank {rank} must be in [1, min(m, n)={min(in_features, out_features)}]")
        self.in_features = in_features
        self.out_features = out_features
        self.rank = rank
        self.alpha = float(alpha)
        self.scale = self.alpha / rank
        kw = {"device": device, "dtype": dtype}
        self.B = nn.Parameter(torch.empty(out_features, rank, **kw))
        self.A = nn.Parameter(torch.empty(rank, in_features, **kw))
        if bias is True:
            bias = nn.Parameter(torch.empty(out_features, **kw))
            bound = 1.0 / math.sqrt(in_features)
            nn.init.uniform_(bias, -bound, bound)
        self.register_parameter("bias", None if bias is None or bias is False else bias)

    def factor_pair(self) -> tuple[nn.Parameter, nn.Parameter]:
        """(B, A), the pair refactorization re-splits; B A is all of the low-rank part."""
        return self.B, self.A

    def _low_rank_fp32(self) -> Tensor:
        return self.scale * (self.B.detach().float() @ self.A.detach().float())

    def dense_weight(self) -> Tensor:
        """The m x n effective weight, computed in fp32 and returned in the factors' dtype."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"alpha={self.alpha:g}, bias={self.bias is not None}"
        )


class LowRankLinear(FactorizedLinear):
    """Pure factorization y = s B (A x) + b with no dense weight (benchmark section "Low-Rank").

    Both factors Kaiming-uniform (B is not zero: B A is the whole weight, so a zero B would start
    the layer at W = 0). Memory O((m + n) r) for weights, grads and Adam state.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        bias: nn.Parameter | bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, rank, alpha, bias, device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _kaiming_(self.A)
        _kaiming_(self.B)

    def forward(self, x: Tensor) -> Tensor:
        # Scale the r-dim intermediate: cheaper than scaling the output.
        return F.linear(F.linear(x, self.A) * self.scale, self.B, self.bias)

    @torch.no_grad()
    def dense_weight(self) -> Tensor:
        return self._low_rank_fp32().to(self.B.dtype)


class LoRALinear(FactorizedLinear):
    """LoRA for pretraining: y = W0 x + s B (A x) + b, W0 frozen at its random init.

    `weight` is W0 (requires_grad False), by default the very Parameter of the replaced Linear, so
    no copy is made. B = 0 and A Kaiming, so the model starts exactly at W0 and B receives gradient
    G (A x)^T != 0 from the first step.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        bias: nn.Parameter | bool | None = None,
        weight: nn.Parameter | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, rank, alpha, bias, device, dtype)
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
            _kaiming_(weight)
        if tuple(weight.shape) != (out_features, in_features):
            raise ValueError(f"W0 has shape {tuple(weight.shape)}, expected {(out_features, in_features)}")
        weight.requires_grad_(False)
        self.weight = weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A Kaiming-uniform, B zero (W0 untouched)."""
        _kaiming_(self.A)
        nn.init.zeros_(self.B)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.A) * self.scale, self.B)

    @torch.no_grad()
    def dense_weight(self) -> Tensor:
        return (self.weight.float() + self._low_rank_fp32()).to(self.weight.dtype)


class ReLoRALinear(LoRALinear):
    """LoRA whose update is periodically merged into W0 and restarted (ReLoRA).

    Every N steps `merge_and_reinit_()`: W0 <- W0 + s B A (fp32, cast back), then A Kaiming and
    B = 0 again, so the layer's function is unchanged by the merge and the next N steps learn a new
    rank-r update on top: the sum of updates can reach full rank. The optimizer state of B and A
    must then be reset or pruned (see `relora_merge_`), always after the merge.

    Full-rank warm start (ReLoRA's authors train the model full rank before the first LoRA cycle;
    `factor.warm_start_steps`): `begin_warm_start_` makes W0 trainable and freezes B (= 0) and A, so
    the layer is a plain Linear y = W0 x + b being trained; `end_warm_start_` switches back. Only
    `requires_grad` changes: the parameters, and so the state_dict keys, are the same in both phases.
    """

    @torch.no_grad()
    def merge_and_reinit_(self) -> None:
        """W0 <- W0 + s B A (fp32 then cast), then A <- Kaiming, B <- 0. Output is preserved.

        Under FSDP2 (DTensor W0, B, A) the merge runs on the whole tensors (gathered on every
        rank) and the new A is drawn whole on every rank from the same RNG state (the trainer's
        ranks share it), each rank keeping its shard: the result is a single process's.
        """

        w, b, a = whole(self.weight), whole(self.B), whole(self.A)
        write_whole_(self.weight, (w.float() + self.scale * (b.float() @ a.float())).to(w.dtype))
        new_a = torch.empty(a.shape, dtype=a.dtype, device=a.device)
        _kaiming_(new_a)
        write_whole_(self.A, new_a)
        self.B.zero_()


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
        nn.init.uniform_(self.sparse_values, -bound, bound)

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


#: CoLA's nonlinearities sigma, by name. SiLU is the paper's (the model's hidden_act); "identity"
#: makes CoLA Low-Rank exactly (the acceptance test), so it is kept as a choice, not a config knob.
COLA_ACTIVATIONS: dict[str, Any] = {"silu": F.silu, "identity": lambda z: z}
#: Each activation's backward, dz = sigma'(z) dh: the kernels autograd itself runs for it (SiLU's
#: ``silu_backward``), so CoLA-M's gradients are CoLA's bit for bit, without a nested autograd
#: call in a backward (which `torch.compile` cannot trace).
COLA_ACTIVATION_GRADS: dict[str, Any] = {
    "silu": lambda dh, z: torch.ops.aten.silu_backward(dh, z),
    "identity": lambda dh, z: dh,
}


class CoLALinear(FactorizedLinear):
    """Low-rank activation (CoLA, Liu et al. 2025): y = B sigma(s A x) + b, no dense weight.

    The paper replaces every attention and MLP linear by ``B sigma(A x)``, sigma the model's
    activation (SiLU), with no scale; here s = alpha / r multiplies the r-dim pre-activation as in
    `LowRankLinear` (the recipes set alpha = r, so s = 1 as in the paper). With sigma the identity
    this is `LowRankLinear` operation for operation. Because of sigma, B A is not the layer's
    weight: no dense m x n W exists, so `dense_weight` refuses (export ships the factors) and the
    pair cannot be refactorized (`FactorSpec.refactorizable` is False).

    Init (the authors' alvin-zyl/CoLA cola/cola_layer.py, written here from its formula): A and B
    i.i.d. N(0, sigma_0^2) with sigma_0 = (r (m + n))^(-1/4), so that each entry of B A has
    variance r sigma_0^4 = 1 / (m + n) (Xavier's, for the product).

    Memory: autograd saves, per layer and forward, besides x and the parameters (as for Low-Rank),
    two N x r tensors: sigma's input s A x (for sigma') and its output (the second product's
    input): ``FactorSpec.rank_saves = 2``. `CoLAMLinear` keeps one.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        bias: nn.Parameter | bool | None = None,
        activation: str = "silu",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, rank, alpha, bias, device, dtype)
        if activation not in COLA_ACTIVATIONS:
            raise ValueError(f"CoLA activation {activation!r}: choose one of {', '.join(COLA_ACTIVATIONS)}")
        self.activation = activation
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A, B ~ N(0, (r (m + n))^(-1/2)): Var((B A)_ij) = 1 / (m + n)."""
        std = (self.rank * (self.in_features + self.out_features)) ** -0.25
        nn.init.normal_(self.A, std=std)
        nn.init.normal_(self.B, std=std)

    def forward(self, x: Tensor) -> Tensor:
        act = COLA_ACTIVATIONS[self.activation]
        return F.linear(act(F.linear(x, self.A) * self.scale), self.B, self.bias)

    def dense_weight(self) -> Tensor:
        raise TypeError(
            f"{type(self).__name__} has no dense weight: y = B {self.activation}(A x) is not linear in x"
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"


class _LowRankActivation(torch.autograd.Function):
    """y = B sigma(z) + b with z = s A x, saving x, A, B and z (N x r) but not sigma(z).

    Backward, with G = dy: h = sigma(z) recomputed (r-dim, cheap); dB = G^T h; dh = G B;
    dz = sigma'(z) dh (`COLA_ACTIVATION_GRADS`: the kernel autograd runs for sigma in the plain
    forward); dA = s dz^T x; dx = s dz A; db = sum of G's rows.
    """

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, A: Tensor, B: Tensor, bias: Tensor | None, scale: float, act: str
    ) -> Tensor:
        z = F.linear(x, A) * scale
        y = F.linear(COLA_ACTIVATIONS[act](z), B, bias)
        ctx.scale, ctx.act = scale, act
        ctx.save_for_backward(x, A, B, z)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, A, B, z = ctx.saved_tensors
        need_x, need_a, need_b, need_bias = ctx.needs_input_grad[:4]
        g = dy.reshape(-1, dy.shape[-1])
        if need_b:
            h = COLA_ACTIVATIONS[ctx.act](z)
            d_b = torch.mm(g.t(), h.reshape(-1, h.shape[-1]))
        else:
            d_b = None
        dh = torch.mm(g, B).view(z.shape)
        dz = COLA_ACTIVATION_GRADS[ctx.act](dh, z) * ctx.scale
        d_a = torch.mm(dz.reshape(-1, dz.shape[-1]).t(), x.reshape(-1, x.shape[-1])) if need_a else None
        dx = torch.matmul(dz, A) if need_x else None
        d_bias = g.sum(0) if need_bias else None
        return dx, d_a, d_b, d_bias, None, None


class CoLAMLinear(CoLALinear):
    """CoLA-M: `CoLALinear`'s function, init and parameters, keeping only the rank-r activation.

    The authors' CoLA-M (alvin-zyl/CoLA cola/modeling_colam.py) restructures the decoder block so
    that gradient checkpointing keeps only the low-rank activations sigma(A x) and the residual
    stream, and recomputes the rest. Here it is a layer that saves, of its own activations, only
    the N x r pre-activation z = s A x and recomputes sigma(z) (r-dim) in its backward: one N x r
    tensor per layer instead of CoLA's two (``FactorSpec.rank_saves = 1``), outputs and gradients
    equal to `CoLALinear`'s. It composes with ``train.activation_checkpointing``, which on a
    checkpointed block keeps only the block's input (less than the paper's CoLA-M, at the cost of
    recomputing the whole block). The recompute (sigma on N x r) is not counted in the FLOPs.
    """

    def forward(self, x: Tensor) -> Tensor:
        tensors, bias, device = [x, self.A, self.B], self.bias, x.device.type
        if not torch.is_autocast_enabled(device):
            return _LowRankActivation.apply(*tensors, bias, self.scale, self.activation)
        # As SLTrainLinear: autocast does not reach inside a custom Function, so cast as it would.
        dtype = torch.get_autocast_dtype(device)
        tensors = [t.to(dtype) for t in tensors]
        bias = None if bias is None else bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return _LowRankActivation.apply(*tensors, bias, self.scale, self.activation)


@dataclass(frozen=True)
class FactorSpec:
    """Every per-kind fact about a factorization (`factor.kind`), read by config, estimator,
    trainer, leaderboard and tests.

    Attributes:
        name: the registry name (``factor.kind``).
        layer: the FactorizedLinear subclass that replaces a target Linear.
        frozen_dense: keeps the replaced m x n weight as a frozen W0 (LoRA, ReLoRA).
        sparse: adds a fixed random support of nnz = floor(density m n) trainable values and an
            int64 index buffer (SLTrain).
        refactorizable: restarts may rebalance its (B, A) pair (weight refactorization).
        merges_at_restart: restarts merge B A into W0 and re-initialise the factors, resetting only
            their state, with the jagged LR (ReLoRA); this replaces refactorization and reset.
        materializes_dense: the forward forms the dense m x n weight (SLTrain as implemented).
        warm_starts: may train its frozen W0 full rank, factors frozen, for the first
            `factor.warm_start_steps` steps (ReLoRA's warm start); needs `frozen_dense`.
        rank_saves: how many tokens x r tensors its forward saves for backward per layer: 1 for
            the scaled intermediate s (A x) (the second product's input); 0 for SLTrain, whose
            Function saves only x (shared with the block) and its parameters; 2 for CoLA (sigma's
            input and output), 1 for CoLA-M (sigma's input only, its output recomputed).
        dense_equivalent: the layer is linear in x with an m x n weight (`dense_weight`), so export
            can merge it into a plain Linear. False for CoLA (y = B sigma(A x)): export ships the
            factors (effpretrain/export.py).
    """

    name: str
    layer: type[FactorizedLinear]
    frozen_dense: bool = False
    sparse: bool = False
    refactorizable: bool = True
    merges_at_restart: bool = False
    materializes_dense: bool = False
    warm_starts: bool = False
    rank_saves: int = 1
    dense_equivalent: bool = True

    def __post_init__(self) -> None:
        if self.warm_starts and not self.frozen_dense:
            raise ValueError(f"factor kind {self.name!r}: warm_starts needs frozen_dense (a W0 to train)")
        if self.refactorizable and not self.dense_equivalent:
            raise ValueError(f"factor kind {self.name!r}: refactorizing needs B A to be the weight")

    def param_counts(
        self, m: int, n: int, rank: int, density: float = 0.03, bias: bool = False
    ) -> dict[str, int]:
        """Elements one factorized m x n (out x in) layer holds, without building it.

        trainable = r (m + n) [+ nnz if sparse] [+ m with a bias]; frozen = m n if frozen_dense,
        else 0; index_elements = nnz = floor(density m n) if sparse (int64), else 0.
        """
        nnz = sparse_nnz(m, n, density) if self.sparse else 0
        trainable = rank * (m + n) + (m if bias else 0) + nnz
        return {"trainable": trainable, "frozen": m * n if self.frozen_dense else 0, "index_elements": nnz}

    def flops_per_token(self, m: int, n: int, rank: int, tokens_per_step: int | None = None) -> float:
        """Training FLOPs (forward + backward) per token of one factorized m x n layer.

        Low-rank y = B (A x): 6 r (m + n); a frozen W0 adds 4 m n (no weight gradient); a layer
        that materialises its dense weight costs 6 m n per token plus, once per step, the product
        B A (2 m n r) and its backward (4 m n r), spread over `tokens_per_step` (ignored when None).
        """
        if self.materializes_dense:
            return 6.0 * m * n + (6.0 * m * n * rank / tokens_per_step if tokens_per_step else 0.0)
        return 6.0 * rank * (m + n) + (4.0 * m * n if self.frozen_dense else 0.0)

    def restart_transient_bytes(self, m: int, n: int, rank: int) -> int:
        """Bytes one m x n layer's restart holds at once (fp32): a merge (`merges_at_restart`)
        forms s B A and W0 + s B A (``2 * 4 m n``); a refactorization rebalances B and A through
        fp32 copies and their QR factors (``2 * 4 r (m + n)``); 0 for a kind with neither."""
        if self.merges_at_restart:
            return 8 * m * n
        return 8 * rank * (m + n) if self.refactorizable else 0


FACTOR_KINDS: dict[str, FactorSpec] = {
    s.name: s
    for s in (
        FactorSpec("lowrank", LowRankLinear),
        FactorSpec("lora", LoRALinear, frozen_dense=True),
        FactorSpec(
            "relora",
            ReLoRALinear,
            frozen_dense=True,
            refactorizable=False,
            merges_at_restart=True,
            warm_starts=True,
        ),
        FactorSpec(
            "sltrain",
            SLTrainLinear,
            sparse=True,
            materializes_dense=True,
            rank_saves=0,
        ),
        FactorSpec("cola", CoLALinear, refactorizable=False, rank_saves=2, dense_equivalent=False),
        FactorSpec("cola_m", CoLAMLinear, refactorizable=False, rank_saves=1, dense_equivalent=False),
    )
}


def factor_spec(kind: str) -> FactorSpec:
    """The registry row for `kind`; ValueError naming the choices otherwise."""
    try:
        return FACTOR_KINDS[kind]
    except KeyError:
        raise ValueError(
            f"unknown factorization kind {kind!r}; choose one of {', '.join(FACTOR_KINDS)}"
        ) from None


def factorized_param_counts(
    m: int, n: int, kind: str, rank: int, density: float = 0.03, bias: bool = False
) -> dict[str, int]:
    """Elements one factorized m x n layer of `kind` holds (see `FactorSpec.param_counts`)."""
    return factor_spec(kind).param_counts(m, n, rank, density, bias)


def _param_counts(model: nn.Module) -> tuple[int, int]:
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def apply_factorization(
    model: nn.Module,
    kind: str,
    rank: int,
    alpha: float,
    targets: Sequence[str] = TARGETS,
    density: float = 0.03,
    seed: int = 0,
) -> dict[str, Any]:
    """Replaces, in place, every nn.Linear whose attribute name is in `targets` by a factorized layer.

    Works on transformers' LlamaForCausalLM (the default targets are its attention and MLP
    projections; embeddings, norms and lm_head are untouched) and on any module tree. All checks
    run before anything is replaced, so a failure leaves the model unchanged. New parameters are
    created on the replaced weight's device and dtype, initialised from torch's global RNG (seed it
    for reproducibility); LoRA/ReLoRA keep the original weight object as the frozen W0. SLTrain
    supports are drawn from a generator seeded by crc32(f"{seed}/{module name}"), so they are
    reproducible and distinct per layer. Logs (logger "effpretrain") what it replaced and the
    parameter counts before and after.

    Args:
        model: the model to modify.
        kind: a `FACTOR_KINDS` name ("lowrank", "lora", "relora", "sltrain", "cola", "cola_m").
        rank: r, at most min(m, n) of every target.
        alpha: the scale numerator (s = alpha / r).
        targets: attribute names of the Linear modules to replace.
        density: SLTrain's delta.
        seed: base seed of SLTrain's supports.

    Returns:
        {"kind", "rank", "alpha", "density" (sltrain only), "replaced": [module names],
        "params_before", "params_after", "trainable_params", "frozen_params", "index_elements"}.

    Raises:
        ValueError: unknown kind; rank < 1; rank > min(m, n) of a target (naming it); no module
            matched `kind`/`targets`.
    """
    spec = factor_spec(kind)
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if spec.sparse:
        sparse_nnz(1, 1, density)  # validates density before any surgery
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    found = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and name.rpartition(".")[2] in targets
    ]
    if not found:
        raise ValueError(
            f"apply_factorization(kind={kind!r}) replaced nothing: no nn.Linear named one of {list(targets)} "
            f"in {type(model).__name__}"
        )
    for name, mod in found:
        if rank > min(mod.out_features, mod.in_features):
            raise ValueError(
                f"rank {rank} exceeds min(m, n)={min(mod.out_features, mod.in_features)} of {name}"
            )

    params_before, trainable_before = _param_counts(model)
    cls = spec.layer
    for name, lin in found:
        w = lin.weight
        kw: dict[str, Any] = {"bias": lin.bias, "device": w.device, "dtype": w.dtype}
        if spec.sparse:
            kw.update(density=density, seed=zlib.crc32(f"{seed}/{name}".encode()))
        if spec.frozen_dense:
            kw["weight"] = w
        _replace(model, name, cls(lin.in_features, lin.out_features, rank, alpha, **kw))

    params_after, trainable_after = _param_counts(model)
    index_elements = sum(m.sparse_index.numel() for m in model.modules() if isinstance(m, SLTrainLinear))
    per_target: dict[str, int] = {}
    for name, _ in found:
        key = name.rpartition(".")[2]
        per_target[key] = per_target.get(key, 0) + 1
    logger.info(
        "apply_factorization: %s (rank=%d, alpha=%g%s) replaced %d Linear layers (%s); "
        "params %d -> %d, trainable %d -> %d",
        kind,
        rank,
        alpha,
        f", density={density:g}" if spec.sparse else "",
        len(found),
        ", ".join(f"{k} x{v}" for k, v in per_target.items()),
        params_before,
        params_after,
        trainable_before,
        trainable_after,
    )
    for name, _ in found:
        logger.debug("apply_factorization: %s -> %s", name, cls.__name__)
    report: dict[str, Any] = {
        "kind": kind,
        "rank": rank,
        "alpha": float(alpha),
        "replaced": [name for name, _ in found],
        "params_before": params_before,
        "params_after": params_after,
        "trainable_params": trainable_after,
        "frozen_params": params_after - trainable_after,
        "index_elements": index_elements,
    }
    if spec.sparse:
        report["density"] = float(density)
    return report


def factorized_layers(model: nn.Module) -> list[tuple[str, FactorizedLinear]]:
    """(name, layer) for every factorized layer of `model`, in module order."""
    return [(name, mod) for name, mod in model.named_modules() if isinstance(mod, FactorizedLinear)]


def factor_pairs(model: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """(B, A) of every factorized layer, for optimizers.refactorization.refactorize_ / Restarts."""
    return [layer.factor_pair() for _, layer in factorized_layers(model)]


@torch.no_grad()
def merge_factorized_(model: nn.Module) -> int:
    """Replaces every factorized layer by a plain nn.Linear holding its dense_weight() (for export).

    The new Linear has the same outputs up to the rounding of (B A) x vs B (A x) and keeps the
    original bias parameter. Returns the number of layers replaced.

    Raises:
        TypeError: a layer has no dense equivalent (CoLA); nothing is replaced then.
    """
    layers = factorized_layers(model)
    kinds = tuple(spec.layer for spec in FACTOR_KINDS.values() if not spec.dense_equivalent)
    bad = [(name, layer) for name, layer in layers if isinstance(layer, kinds)]
    if bad:
        raise TypeError(f"{bad[0][0]} ({type(bad[0][1]).__name__}) has no dense weight to merge")
    for name, layer in layers:
        w = layer.dense_weight()
        # Built on the meta device so no throwaway weight is allocated and initialised.
        lin = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
        lin.weight = nn.Parameter(w)
        lin.bias = layer.bias
        _replace(model, name, lin)
    return len(layers)


@torch.no_grad()
def relora_merge_(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    prune_ratio: float | None = None,
) -> int:
    """ReLoRA restart: merge every ReLoRALinear (W0 += s B A; A Kaiming, B = 0), then fix its state.

    The merge always happens first, so no update is lost. With an optimizer, the state of the
    merged B and A is then either reset (prune_ratio None: moments and step zeroed,
    optimizers.momentum_reset.reset_) or magnitude-pruned (ReLoRA's choice, prune_ratio 0.999: keep
    the largest 0.1% of each moment, optimizers.momentum_reset.prune_). Other parameters' state is
    untouched. Pair with a jagged LR (optimizers.restarts.recovery_factor).

    Returns:
        The number of layers merged.
    """
    layers = [m for _, m in factorized_layers(model) if isinstance(m, ReLoRALinear)]
    for layer in layers:
        layer.merge_and_reinit_()
    if optimizer is not None and layers:
        params: Iterable[Tensor] = [p for layer in layers for p in layer.factor_pair()]
        if prune_ratio is None:
            reset_(optimizer, params=params)
        else:
            prune_(optimizer, prune_ratio, params=params)
    return len(layers)


# ----------------------------------------------------------------------------------------------
# Full-rank warm start (ReLoRA): W0 trains first, then the factors; only requires_grad changes.


def warm_start_layers(model: nn.Module) -> list[FactorizedLinear]:
    """The factorized layers of `model` whose kind warm-starts (`FactorSpec.warm_starts`)."""
    kinds = tuple(spec.layer for spec in FACTOR_KINDS.values() if spec.warm_starts)
    return [layer for _, layer in factorized_layers(model) if isinstance(layer, kinds)]


def warm_start_params(model: nn.Module) -> list[nn.Parameter]:
    """W0 of every warm-starting layer: what the warm start trains (one plain param group)."""
    return [layer.weight for layer in warm_start_layers(model)]


def warming_up(model: nn.Module) -> bool:
    """Whether `model` is in the full-rank warm-start phase (its W0 are trainable)."""
    return any(w.requires_grad for w in warm_start_params(model))


def begin_warm_start_(model: nn.Module) -> int:
    """Enters the warm-start phase: every warm-starting layer's W0 trainable, its B and A frozen.

    Call it on a freshly factorized model (or one restored before its switch), where B = 0: the
    factor branch then adds exactly nothing, y = W0 x + b, and W0 trains as the dense model's
    weight would. Returns the number of layers.
    """
    layers = warm_start_layers(model)
    for layer in layers:
        layer.weight.requires_grad_(True)
        for p in layer.factor_pair():
            p.requires_grad_(False)
    return len(layers)


@torch.no_grad()
def end_warm_start_(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """The switch out of the warm start: W0 frozen again, B and A trainable.

    W0's gradient and its optimizer state are deleted, so its m and v memory is freed. B and A were
    frozen, so they never had a gradient and no optimizer made state for them: they start from
    fresh state (their state is not touched here, which also keeps a resumed run's restored state
    when this is applied on resuming past the switch). Returns the number of layers.
    """
    layers = warm_start_layers(model)
    state = unwrap_optimizer(optimizer).state if optimizer is not None else {}
    for layer in layers:
        layer.weight.requires_grad_(False)
        layer.weight.grad = None
        state.pop(layer.weight, None)
        for p in layer.factor_pair():
            p.requires_grad_(True)
    return len(layers)

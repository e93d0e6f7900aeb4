"""CoLA and CoLA-M: low-rank activations, y = B sigma(s A x) + b, no dense weight."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from effpretrain.models.factorized.layers import FactorizedLinear, init_on_cpu_

logger = logging.getLogger("effpretrain")


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
        init_on_cpu_(self.A, lambda x: nn.init.normal_(x, std=std))
        init_on_cpu_(self.B, lambda x: nn.init.normal_(x, std=std))

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

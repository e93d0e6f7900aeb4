"""Test-only reference for the 4-bit methods: Li et al.'s quantizers (NeurIPS 2023, "Memory Efficient
Optimizers with 4-bit States"; its default setting: first moment B128/DE, second moment
Rank-1/Linear, round to nearest) transcribed from the paper as fake quantization of fp32 moments,
independently of optimizers/moments_4bit.py (no codes, no packing: each moment is replaced by the
value its quantized form reads as), and two optimizers built on it, AdamW and GaLore, which the
tests register under a test-only name to train beside ``adamw_4bit`` and ``galore_4bit``.

``quant_scheme="blockwise"`` normalises V by blocks of 128 instead, as torchao's ``AdamW4bit`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from optimizers._adam import EXP_AVG, EXP_AVG_SQ, STEP, AdamMoments, adam_update
from optimizers.galore import GaLoreAdamW
from optimizers.projected_adam import ProjectedAdam

#: The paper's signed dynamic-exponent map at 4 bits (3 exponent bits: Dettmers' dynamic map).
DE_MAP = torch.tensor(
    [-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0]
    + [0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0]
)
#: The paper's linear map for the second moment, without zero: 1/16, 2/16, ..., 1.
LINEAR_MAP = torch.tensor([(i + 1) / 16 for i in range(16)])
BLOCK = 128


def nearest(n: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Each entry of `n` replaced by the nearest entry of `qmap`."""
    return qmap[(n.unsqueeze(-1) - qmap).abs().argmin(-1)]


def fake_blockwise(x: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """x as block-wise quantization reads it: blocks of 128 consecutive entries (zero-padded at
    the end), each normalised by its absmax, rounded to `qmap`, scaled back."""
    flat = x.reshape(-1)
    padded = torch.cat([flat, flat.new_zeros(-flat.numel() % BLOCK)]).view(-1, BLOCK)
    scale = padded.abs().amax(1, keepdim=True)
    normed = torch.where(scale > 0, padded / scale, torch.zeros_like(padded))
    return (nearest(normed, qmap) * scale).reshape(-1)[: flat.numel()].view_as(x)


def fake_rank1(x: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Non-negative x as rank-1 normalised quantization reads it: entry (i, j) of x as a matrix
    (rows = first dimension) normalised by min(max of row i, max of column j), rounded to `qmap`,
    scaled back. A vector is quantized block-wise."""
    if x.dim() < 2:
        return fake_blockwise(x, qmap)
    mat = x.reshape(x.shape[0], -1)
    scale = torch.minimum(mat.amax(1, keepdim=True), mat.amax(0, keepdim=True))
    normed = torch.where(scale > 0, mat / scale, torch.zeros_like(mat))
    return (nearest(normed, qmap) * scale).view_as(x)


def fake_quantize_(m: torch.Tensor, v: torch.Tensor, group: dict[str, Any]) -> None:
    """M and V replaced in place by what their 4-bit forms read as (unless below the size)."""
    if m.numel() < group["min_4bit_size"]:
        return
    m.copy_(fake_blockwise(m, DE_MAP))
    v.copy_(fake_rank1(v, LINEAR_MAP) if group["quant_scheme"] == "rank1" else fake_blockwise(v, LINEAR_MAP))


class PaperAdamW4bit(torch.optim.Optimizer):
    """Textbook decoupled AdamW whose fp32 moments are fake-quantized after every step:

        W <- W (1 - eta lambda);  M <- beta1 M + (1 - beta1) G;  V <- beta2 V + (1 - beta2) G^2
        W <- W - eta / (1 - beta1^t) M / (sqrt(V / (1 - beta2^t)) + eps);  M, V <- Q(M), Q(V)

    State: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (fp32): ``8 numel`` bytes."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        min_4bit_size: int = 4096,
        quant_scheme: str = "rank1",
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "min_4bit_size": min_4bit_size,
            "quant_scheme": quant_scheme,
        }
        super().__init__(params, defaults)

    @classmethod
    def state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        return 8 * math.prod(shape)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                st["step"] += 1
                g, m, v, t = p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"]
                p.mul_(1 - lr * wd)
                m.mul_(b1).add_((1 - b1) * g)
                v.mul_(b2).add_((1 - b2) * g * g)
                p.sub_(lr / (1 - b1**t) * m / ((v / (1 - b2**t)).sqrt() + eps))
                fake_quantize_(m, v, group)


class PaperMoments4bit(AdamMoments):
    """fp32 moments advanced by `adam_update`, then fake-quantized (GaLore's moment storage)."""

    def init(
        self, state: dict[str, Any], p: torch.Tensor, shape: tuple[int, ...] | None, group: dict[str, Any]
    ) -> None:
        shape = tuple(p.shape) if shape is None else shape
        for key in (EXP_AVG, EXP_AVG_SQ):
            state[key] = torch.zeros(shape, dtype=torch.float32, device=p.device)

    def update(
        self, state: dict[str, Any], x: torch.Tensor, group: dict[str, Any]
    ) -> tuple[torch.Tensor, float]:
        m, v = state[EXP_AVG], state[EXP_AVG_SQ]
        norm, step_size = adam_update(m, v, x.float(), state[STEP], group, self.fused)
        fake_quantize_(m, v, group)
        return norm.to(x.dtype), step_size

    @classmethod
    def nbytes(
        cls, numel: int, dtype: torch.dtype, group: dict[str, Any], shape: tuple[int, ...] | None = None
    ) -> int:
        return 8 * numel


class PaperGaLoreAdamW4bit(GaLoreAdamW):
    """GaLore (torch convention, as ``galore_4bit``) whose moments are `PaperMoments4bit`."""

    ADAM_DEFAULTS: ClassVar[dict[str, Any]] = {
        **ProjectedAdam.ADAM_DEFAULTS,
        "eps": 1e-8,
        "weight_decay": 1e-2,
        "adam_convention": "torch",
        "min_4bit_size": 4096,
        "quant_scheme": "rank1",
    }
    MOMENTS: ClassVar[type[AdamMoments]] = PaperMoments4bit

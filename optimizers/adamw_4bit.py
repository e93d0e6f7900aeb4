"""AdamW with 4-bit moments (Li et al., NeurIPS 2023); pure PyTorch, CPU and GPU."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from optimizers import moments_4bit
from optimizers._adam import AdamMoments
from optimizers.moments_4bit import Moments4bit
from optimizers.projected_adam import ProjectedAdam


class AdamW4bit(ProjectedAdam):
    """AdamW whose moments are stored in 4 bits (`Moments4bit`, optimizers/moments_4bit.py).

    Each step, for a parameter W with gradient G and step count t (torch.optim.AdamW's rule on
    the dequantised moments):

        M = dequant(M_q),  V = dequant(V_q)                                    (fp32)
        M <- beta1 M + (1 - beta1) G,   V <- beta2 V + (1 - beta2) G^2
        W <- W (1 - eta lambda) - eta / (1 - beta1^t) M / (sqrt(V / (1 - beta2^t)) + eps)
        M_q = quant(M; blocks of 128, signed DE map),
        V_q = quant(V; rank-1 (default, Li et al.) or blocks of 128 (torchao), linear map without 0)

    The weight is written in one place, `ProjectedAdam._apply_update` (through `optimizers.writer`).
    Moments with fewer than ``min_4bit_size`` entries stay fp32 (then this is torch's AdamW up to
    fp32 rounding). No group projects: a group with ``rank`` is refused (use ``galore_4bit``).

    Group keys: ``lr`` (eta, 1e-3), ``betas`` ((0.9, 0.999)), ``eps`` (1e-8), ``weight_decay``
    (lambda, 1e-2, torch's and torchao's default), ``min_4bit_size`` (4096), ``quant_scheme``
    ("rank1" | "blockwise"); ``correct_bias`` and ``adam_convention`` ("torch") as `ProjectedAdam`.

    State per parameter with numel L: ``step`` (int) and, for L >= min_4bit_size, ``exp_avg``,
    ``exp_avg_sq`` (uint8, ceil(L / 2)), ``exp_avg_absmax`` (fp32, ceil(L / 128)) and
    ``exp_avg_sq_row_max`` / ``exp_avg_sq_col_max`` (fp32, a and b for W read as a x b, a its first
    dimension; rank1, >= 2 dimensions) or ``exp_avg_sq_absmax`` (fp32, ceil(L / 128)). Bytes, any
    parameter dtype:

        rank-1 V:       2 ceil(L / 2) + 4 ceil(L / 128) + 4 (a + b)
        block-wise V:   2 ceil(L / 2) + 8 ceil(L / 128)          (also a 1-D parameter under rank1)
        L < min_4bit_size:  8 L                                    (fp32 exp_avg, exp_avg_sq)

    The 16-entry maps are constants, not state (no shared state). torchao's ``AdamW4bit`` holds
    2 (L / 2 + 4 L / 128) bytes of codes and scales for a size that is a multiple of 128 (the
    block-wise formula) plus two 16-entry fp32 maps per parameter.

    Under FSDP2 every weight steps whole, once, on its owner rank, which alone holds its state
    (blocks and rank-1 maxima span the tensor; optimizers/_owners.py).
    """

    PROJECTION_DEFAULTS: ClassVar[dict[str, Any]] = {}
    ADAM_DEFAULTS: ClassVar[dict[str, Any]] = {
        **ProjectedAdam.ADAM_DEFAULTS,
        "eps": 1e-8,
        "weight_decay": 1e-2,
        "adam_convention": "torch",
        **moments_4bit.GROUP_DEFAULTS,
    }
    RESET_KEYS: ClassVar[tuple[str, ...]] = moments_4bit.RESET_KEYS
    """A momentum reset zeroes the codes and every scale, so that the moments read exactly 0."""
    MOMENTS: ClassVar[type[AdamMoments]] = Moments4bit

    @classmethod
    def state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Exact bytes of one parameter's state after >= 1 step, with L = prod(shape) and the
        parameter read as a x b (a = shape[0]); `group` keys missing take the defaults:

            L >= min_4bit_size, rank-1 V (>= 2 dimensions):  2 ceil(L / 2) + 4 ceil(L / 128) + 4 (a + b)
            L >= min_4bit_size, block-wise V (or a vector):  2 ceil(L / 2) + 8 ceil(L / 128)
            L <  min_4bit_size:                              8 L

        (`Moments4bit.nbytes`; ``step`` is a python int; the maps are constants, no shared state).
        """
        return super().state_bytes(shape, group, dtype)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group with `ProjectedAdam`'s defaults, then the 4-bit keys checked."""
        super().add_param_group(param_group)
        Moments4bit.check_group(self.param_groups[-1])

    def _check_projected(self, group: dict[str, Any]) -> None:
        raise ValueError(
            "AdamW4bit does not project: a param group has 'rank' or project=True "
            "(use GaLoreAdamW4bit, optimizer 'galore_4bit', for projected 4-bit moments)"
        )


__all__ = ["AdamW4bit"]

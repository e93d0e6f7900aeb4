"""GaLore with 4-bit Adam moments (Li et al., NeurIPS 2023, on GaLore's low-rank moments)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from optimizers import moments_4bit
from optimizers._adam import AdamMoments
from optimizers.galore import GaLoreAdamW
from optimizers.moments_4bit import Moments4bit
from optimizers.projected_adam import ProjectedAdam


class GaLoreAdamW4bit(GaLoreAdamW):
    """GaLore-AdamW whose Adam moments are stored in 4 bits (`Moments4bit`).

    The update rule is `GaLoreAdamW`'s; only the storage of M and V changes, as `GaLoreAdamW8bit`
    does with 8 bits. For a projected weight with R = proj(G):

        M = dequant(M_q),  V = dequant(V_q)                                    (fp32, r-sized)
        M <- beta1 M + (1 - beta1) R,   V <- beta2 V + (1 - beta2) R^2
        N = M / (sqrt(V / (1 - beta2^t)) + eps),  W <- W (1 - eta lambda) - eta_t alpha back(N)
        M_q = quant(M; blocks of 128, signed DE map),
        V_q = quant(V; rank-1 (default, Li et al.) or blocks of 128 (torchao), linear map without 0)

    (eta_t = eta / (1 - beta1^t): ``adam_convention="torch"`` is the default here, as for the 8-bit
    GaLore; ``"reference"`` is accepted too). A moment with fewer than ``min_4bit_size`` entries
    stays fp32; non-projected parameters use the same 4-bit AdamW (`AdamW4bit`'s rule). The weight
    is written in one place, `ProjectedAdam._apply_update`.

    Group keys: those of `GaLoreAdamW`, plus ``min_4bit_size`` (4096) and ``quant_scheme``
    ("rank1" | "blockwise"). Defaults as the 8-bit GaLore: ``lr`` 1e-3, ``betas`` (0.9, 0.999),
    ``eps`` 1e-8, ``weight_decay`` 1e-2.

    State per parameter: ``step``, the 4-bit moments of `Moments4bit` (the low-rank shape a x b
    for projected params: m x k on the right side, k x n on the left) or fp32 ones, and for
    projected params ``basis`` (parameter dtype), ``refresh``, ``seed``. Memory, with L = a b the
    moment entry count (m n, a = m, when not projected; k = min(r, m, n)), s the parameter itemsize
    and B the basis entry count (k n right, m k left; 0 for the "random" basis and unprojected):

        L >= min_4bit_size, rank-1 V:      2 ceil(L / 2) + 4 ceil(L / 128) + 4 (a + b) + s B
        L >= min_4bit_size, block-wise V:  2 ceil(L / 2) + 8 ceil(L / 128) + s B
        L <  min_4bit_size:                8 L + s B                     (fp32 moments)

    Under FSDP2 a projected weight steps whole on its owner rank, as every GaLore does, and so do
    the dense weights (4-bit blocks and rank-1 maxima span the tensor).
    """

    ADAM_DEFAULTS: ClassVar[dict[str, Any]] = {
        **ProjectedAdam.ADAM_DEFAULTS,
        "eps": 1e-8,
        "weight_decay": 1e-2,
        "adam_convention": "torch",
        **moments_4bit.GROUP_DEFAULTS,
    }
    RESET_KEYS: ClassVar[tuple[str, ...]] = moments_4bit.RESET_KEYS
    """A momentum reset zeroes the codes and every scale, so that the moments read exactly 0; the
    basis and its refresh schedule are kept (`optimizers.momentum_reset`)."""
    MOMENTS: ClassVar[type[AdamMoments]] = Moments4bit

    @classmethod
    def state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Exact bytes of one parameter's state after >= 1 step: `ProjectedAdam.state_bytes` with
        the moments' term of `Moments4bit.nbytes` on the moment shape a x b (the low-rank shape of a
        projected matrix, the parameter's own otherwise), L = a b, s the itemsize, B the basis
        entries (0 unprojected or for the "random" basis):

            L >= min_4bit_size, rank-1 V:      2 ceil(L / 2) + 4 ceil(L / 128) + 4 (a + b) + s B
            L >= min_4bit_size, block-wise V:  2 ceil(L / 2) + 8 ceil(L / 128) + s B
            L <  min_4bit_size:                8 L + s B
        """
        return super().state_bytes(shape, group, dtype)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """`ProjectedAdam.add_param_group`, then the 4-bit keys checked."""
        super().add_param_group(param_group)
        Moments4bit.check_group(self.param_groups[-1])


__all__ = ["GaLoreAdamW4bit"]

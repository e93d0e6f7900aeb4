"""GaLore with 8-bit Adam moments (bitsandbytes blockwise quantisation); runs on CPU and GPU."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from optimizers.galore import GaLoreAdamW
from optimizers.projected_adam import EXP_AVG, EXP_AVG_SQ, STEP, AdamMoments, ProjectedAdam, adam_update

BLOCKSIZE = 256
"""Entries per quantisation block (bitsandbytes' 8-bit optimizers use 256)."""

EXP_AVG_ABSMAX = f"{EXP_AVG}_absmax"
"""State key of M's per-block absmax scales (fp32)."""
EXP_AVG_SQ_ABSMAX = f"{EXP_AVG_SQ}_absmax"
"""State key of V's per-block absmax scales (fp32)."""


def _bnb_functional() -> Any:
    try:
        import bitsandbytes.functional as bnb_f
    except ImportError as err:  # pragma: no cover - exercised only where bitsandbytes is missing
        raise ImportError(
            "GaLoreAdamW8bit needs bitsandbytes (>= 0.45) for its 8-bit moments: pip install bitsandbytes, "
            "or use the 'galore' optimizer (GaLoreAdamW, 16/32-bit moments) instead."
        ) from err
    return bnb_f


class BlockwiseMoments8bit(AdamMoments):
    """Moment storage in 8 bits: bitsandbytes' dynamic tree quantisation, per-block absmax.

    Each step a moment is dequantised to fp32, advanced by `adam_update`, and requantised:

        M = dequant(M_q, a_M),  V = dequant(V_q, a_V)   (a: per-block absmax, blocks of 256 entries)
        M <- beta1 M + (1 - beta1) x,  V <- beta2 V + (1 - beta2) x^2   (fp32)
        M_q, a_M = quant(M; signed dynamic map),  V_q, a_V = quant(V; unsigned dynamic map)

    A moment with fewer than ``min_8bit_size`` entries stays fp32 (as in bitsandbytes). State:
    ``exp_avg`` / ``exp_avg_sq`` (uint8) with ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (fp32,
    ceil(L / 256) each), or the two fp32 moments. The blocks are not element-wise, so under FSDP2
    dense weights step whole.

    Raises:
        ImportError: at construction, when bitsandbytes cannot be imported.
    """

    ELEMENTWISE: ClassVar[bool] = False

    def __init__(self, fused: bool | None = None) -> None:
        super().__init__(fused)
        self._bnb = _bnb_functional()
        self._qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """bitsandbytes' signed (for M) and unsigned (for V) dynamic maps on `device`, cached."""
        if device not in self._qmaps:
            self._qmaps[device] = (
                self._bnb.create_dynamic_map(signed=True).to(device),
                self._bnb.create_dynamic_map(signed=False).to(device),
            )
        return self._qmaps[device]

    @staticmethod
    def _is_8bit(numel: int, group: dict[str, Any]) -> bool:
        return numel >= int(group["min_8bit_size"])

    def init(
        self, state: dict[str, Any], p: torch.Tensor, shape: tuple[int, ...] | None, group: dict[str, Any]
    ) -> None:
        shape = tuple(p.shape) if shape is None else shape
        numel = math.prod(shape)
        if not self._is_8bit(numel, group):
            state[EXP_AVG] = torch.zeros(shape, dtype=torch.float32, device=p.device)
            state[EXP_AVG_SQ] = torch.zeros(shape, dtype=torch.float32, device=p.device)
            return
        blocks = -(-numel // BLOCKSIZE)
        q_signed, q_unsigned = self._maps(p.device)
        # Zero moments quantise to the code nearest 0 with absmax 0: dequantise to exactly 0.
        zero = torch.zeros(shape, dtype=torch.float32, device=p.device)
        for key, absmax, qmap in (
            (EXP_AVG, EXP_AVG_ABSMAX, q_signed),
            (EXP_AVG_SQ, EXP_AVG_SQ_ABSMAX, q_unsigned),
        ):
            q, qs = self._bnb.quantize_blockwise(zero, code=qmap, blocksize=BLOCKSIZE)
            state[key] = q
            state[absmax] = qs.absmax.reshape(blocks).to(torch.float32)

    def update(
        self, state: dict[str, Any], x: torch.Tensor, group: dict[str, Any]
    ) -> tuple[torch.Tensor, float]:
        m_q, v_q = state[EXP_AVG], state[EXP_AVG_SQ]
        x32 = x.float()
        if m_q.dtype != torch.uint8:
            norm, step_size = adam_update(m_q, v_q, x32, state[STEP], group, self.fused)
            return norm.to(x.dtype), step_size
        q_signed, q_unsigned = self._maps(x.device)
        m = self._bnb.dequantize_blockwise(
            m_q, absmax=state[EXP_AVG_ABSMAX], code=q_signed, blocksize=BLOCKSIZE
        )
        v = self._bnb.dequantize_blockwise(
            v_q, absmax=state[EXP_AVG_SQ_ABSMAX], code=q_unsigned, blocksize=BLOCKSIZE
        )
        norm, step_size = adam_update(m, v, x32, state[STEP], group, self.fused)
        for key, absmax, val, qmap in (
            (EXP_AVG, EXP_AVG_ABSMAX, m, q_signed),
            (EXP_AVG_SQ, EXP_AVG_SQ_ABSMAX, v, q_unsigned),
        ):
            q, qs = self._bnb.quantize_blockwise(val, code=qmap, blocksize=BLOCKSIZE)
            state[key].copy_(q)
            state[absmax].copy_(qs.absmax.reshape(-1))
        return norm.to(x.dtype), step_size

    @classmethod
    def nbytes(cls, numel: int, dtype: torch.dtype, group: dict[str, Any]) -> int:
        """2 L + 8 ceil(L / 256) for 8-bit moments (uint8 + fp32 absmax), 8 L when L < min_8bit_size."""
        if not cls._is_8bit(numel, group):
            return 2 * numel * torch.float32.itemsize
        return 2 * numel + 2 * (-(-numel // BLOCKSIZE)) * torch.float32.itemsize


class GaLoreAdamW8bit(GaLoreAdamW):
    """GaLore-AdamW whose Adam moments are stored in 8 bits (Dettmers et al. 2022 blockwise quantisation).

    The update rule is `GaLoreAdamW`'s; only the storage of M and V changes (`MOMENTS` is
    `BlockwiseMoments8bit`). Each step a moment
    is dequantised to fp32, updated, and requantised:

        M = dequant(M_q, a_M),  V = dequant(V_q, a_V)   (a: per-block absmax, blocks of 256 entries)
        M <- beta1 M + (1 - beta1) R,  V <- beta2 V + (1 - beta2) R^2   (fp32)
        N = M / (sqrt(V / (1 - beta2^t)) + eps),  W <- W (1 - eta lambda) - eta_t alpha back(N)
        M_q, a_M = quant(M; signed dynamic map),  V_q, a_V = quant(V; unsigned dynamic map)

    (eta_t = eta / (1 - beta1^t): bitsandbytes' Adam convention, ``adam_convention="torch"``, is the
    default here; ``"reference"`` is accepted too). The 8-bit format is bitsandbytes' dynamic
    tree quantisation with per-block absmax scaling, as in ``bnb.optim.AdamW8bit``; the maps
    themselves are constants, not state. As in bitsandbytes, a moment with fewer than
    ``min_8bit_size`` entries stays fp32. Non-projected parameters use the same 8-bit Adam.
    Unlike galore-torch's ``GaLoreAdamW8bit`` this never calls CUDA-only functions, never swaps
    ``p.data``, and never edits ``param_groups`` during step().

    Group keys: those of `GaLoreAdamW`, plus ``min_8bit_size`` (4096). Defaults follow
    galore-torch's 8-bit signature: ``lr`` 1e-3, ``betas`` (0.9, 0.999), ``eps`` 1e-8,
    ``weight_decay`` 1e-2.

    State per parameter: ``step``, ``exp_avg`` / ``exp_avg_sq`` (uint8, the low-rank shape for
    projected params) with ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (fp32, ceil(numel / 256)
    each), and for projected params ``basis`` (parameter dtype), ``refresh``, ``seed``.
    Memory, with L the moment entry count (m k right side, k n left side, m n not projected;
    k = min(r, m, n)), s the parameter itemsize and B the basis entry count (k n right, m k left):

        L >= min_8bit_size:  2 L + 8 ceil(L / 256) + s B
        L <  min_8bit_size:  8 L + s B                    (fp32 moments)

    (B = 0 for non-projected params and for the "random" basis).

    Raises:
        ImportError: at construction, when bitsandbytes cannot be imported.
    """

    ADAM_DEFAULTS: ClassVar[dict[str, Any]] = {
        **ProjectedAdam.ADAM_DEFAULTS,
        "eps": 1e-8,
        "weight_decay": 1e-2,
        "adam_convention": "torch",
        "min_8bit_size": 4096,
    }
    MOMENTS: ClassVar[type[AdamMoments]] = BlockwiseMoments8bit


__all__ = ["BLOCKSIZE", "EXP_AVG_ABSMAX", "EXP_AVG_SQ_ABSMAX", "BlockwiseMoments8bit", "GaLoreAdamW8bit"]

"""GaLore with 8-bit Adam moments (bitsandbytes blockwise quantisation); runs on CPU and GPU."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from optimizers.projected_adam import ProjectedAdam, itemsize
from optimizers.galore import GaLoreAdamW

BLOCKSIZE = 256
"""Entries per quantisation block (bitsandbytes' 8-bit optimizers use 256)."""


def _bnb_functional() -> Any:
    try:
        import bitsandbytes.functional as bnb_f
    except ImportError as err:  # pragma: no cover - exercised only where bitsandbytes is missing
        raise ImportError(
            "GaLoreAdamW8bit needs bitsandbytes (>= 0.45) for its 8-bit moments: pip install bitsandbytes, "
            "or use the 'galore' optimizer (GaLoreAdamW, 16/32-bit moments) instead."
        ) from err
    return bnb_f


class GaLoreAdamW8bit(GaLoreAdamW):
    """GaLore-AdamW whose Adam moments are stored in 8 bits (Dettmers et al. 2022 blockwise quantisation).

    The update rule is `GaLoreAdamW`'s; only the storage of M and V changes. Each step a moment
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

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self._bnb = _bnb_functional()
        self._qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        super().__init__(params, *args, **kwargs)

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

    # Block-wise quantised moments are not element-wise: under FSDP2 dense weights step whole.
    SHARDED_DENSE: ClassVar[bool] = False

    def _init_moments(
        self, state: dict[str, Any], shape: tuple[int, ...], p: torch.Tensor, group: dict[str, Any]
    ) -> None:
        numel = math.prod(shape)
        if not self._is_8bit(numel, group):
            state["exp_avg"] = torch.zeros(shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(shape, dtype=torch.float32, device=p.device)
            return
        blocks = -(-numel // BLOCKSIZE)
        q_signed, q_unsigned = self._maps(p.device)
        # Zero moments quantise to the code nearest 0 with absmax 0: dequantise to exactly 0.
        zero = torch.zeros(shape, dtype=torch.float32, device=p.device)
        for key, qmap in (("exp_avg", q_signed), ("exp_avg_sq", q_unsigned)):
            q, qs = self._bnb.quantize_blockwise(zero, code=qmap, blocksize=BLOCKSIZE)
            state[key] = q
            state[f"{key}_absmax"] = qs.absmax.reshape(blocks).to(torch.float32)

    def _adam(
        self, x: torch.Tensor, state: dict[str, Any], group: dict[str, Any], reuse_x: bool = False
    ) -> tuple[torch.Tensor, float]:
        # reuse_x is a hint only: the 8-bit path works on dequantised fp32 copies anyway.
        state["step"] += 1
        m_q, v_q = state["exp_avg"], state["exp_avg_sq"]
        x32 = x.float()
        if m_q.dtype != torch.uint8:
            norm, step_size = self._adam_math(m_q, v_q, x32, state["step"], group)
            return norm.to(x.dtype), step_size
        q_signed, q_unsigned = self._maps(x.device)
        m = self._bnb.dequantize_blockwise(
            m_q, absmax=state["exp_avg_absmax"], code=q_signed, blocksize=BLOCKSIZE
        )
        v = self._bnb.dequantize_blockwise(
            v_q, absmax=state["exp_avg_sq_absmax"], code=q_unsigned, blocksize=BLOCKSIZE
        )
        norm, step_size = self._adam_math(m, v, x32, state["step"], group)
        for key, val, qmap in (("exp_avg", m, q_signed), ("exp_avg_sq", v, q_unsigned)):
            q, qs = self._bnb.quantize_blockwise(val, code=qmap, blocksize=BLOCKSIZE)
            state[key].copy_(q)
            state[f"{key}_absmax"].copy_(qs.absmax.reshape(-1))
        return norm.to(x.dtype), step_size

    @classmethod
    def _moment_bytes(cls, numel: int, dtype: torch.dtype, group: dict[str, Any]) -> int:
        """2 L + 8 ceil(L / 256) for 8-bit moments (uint8 + fp32 absmax), 8 L when L < min_8bit_size."""
        if not cls._is_8bit(numel, group):
            return 2 * numel * itemsize(torch.float32)
        return 2 * numel + 2 * (-(-numel // BLOCKSIZE)) * itemsize(torch.float32)


__all__ = ["BLOCKSIZE", "GaLoreAdamW8bit"]

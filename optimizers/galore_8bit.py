"""GaLore with 8-bit Adam moments (bitsandbytes blockwise quantisation); runs on CPU and GPU."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from optimizers._sharded import is_dtensor, local, row_sharded_like
from optimizers._streams import legacy_stream, ordered_on
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
    ceil(L / 256) each), or the two fp32 moments. The blocks are not element-wise: under FSDP2 a
    dense weight steps whole on its owner rank, unless its rows are whole blocks (`steps_shards`):
    then each rank steps and holds its own rows, with the scales shaped (rows, row entries / 256).

    Raises:
        ImportError: at construction, when bitsandbytes cannot be imported.
    """

    ELEMENTWISE: ClassVar[bool] = False

    def __init__(self, fused: bool | None = None) -> None:
        super().__init__(fused)
        self._bnb = _bnb_functional()
        self._qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._zeros: dict[torch.device, tuple[int, int]] = {}

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

    @classmethod
    def steps_shards(cls, shape: tuple[int, ...]) -> bool:
        """Rows of whole blocks: a weight whose rows hold a multiple of 256 entries (a 4096-wide
        embedding or head) is quantised in the same blocks whether it is whole or split into
        FSDP2's row shards, and Adam is element-wise within a block, so each rank steps its own
        rows (bitwise the whole step) and holds their codes and scales (``exp_avg_absmax`` shaped
        ``(rows, row_entries / 256)``, sharded with the rows). Any other weight steps whole."""
        return len(shape) >= 2 and math.prod(shape[1:]) % BLOCKSIZE == 0

    def _zero_codes(self, device: torch.device) -> tuple[int, int]:
        """The codes a zero moment quantises to (absmax 0) under the signed and unsigned maps."""
        if device not in self._zeros:
            zero = torch.zeros(BLOCKSIZE, dtype=torch.float32, device=device)
            maps = self._maps(device)
            # The quantize runs on the legacy stream (as in `update`); so does the read of its code.
            with ordered_on(legacy_stream(device), device, used=(zero, *maps)):
                self._zeros[device] = tuple(  # type: ignore[assignment]
                    int(self._bnb.quantize_blockwise(zero, code=qmap, blocksize=BLOCKSIZE)[0][0])
                    for qmap in maps
                )
        return self._zeros[device]

    def adopt_whole(self, state: dict[str, Any], p: torch.Tensor) -> None:
        """Moments and scales loaded whole (plain tensors, the scales flat) become this rank's rows
        of them, laid out as `init` lays them out; no communication (each rank keeps its chunk)."""
        from torch.distributed.tensor import distribute_tensor

        for key in (EXP_AVG, EXP_AVG_SQ, EXP_AVG_ABSMAX, EXP_AVG_SQ_ABSMAX):
            v = state.get(key)
            if v is None or is_dtensor(v):
                continue
            rows = v if v.shape == p.shape else v.reshape(p.shape[0], -1)  # scales: per row
            state[key] = distribute_tensor(
                rows.to(local(p).device), p.device_mesh, p.placements, src_data_rank=None
            )

    def init(
        self, state: dict[str, Any], p: torch.Tensor, shape: tuple[int, ...] | None, group: dict[str, Any]
    ) -> None:
        """Zero moments of `shape`, or for None this rank's rows of FSDP2-sharded `p` (a weight
        that `steps_shards`), as DTensors sharded like it; 8-bit or fp32 by the whole size."""
        numel = p.numel() if shape is None else math.prod(shape)
        mine = tuple(local(p).shape) if shape is None else shape
        device = local(p).device
        if not self._is_8bit(numel, group):
            tensors = {
                k: torch.zeros(mine, dtype=torch.float32, device=device) for k in (EXP_AVG, EXP_AVG_SQ)
            }
        else:
            # Zero moments quantise to the code nearest 0 with absmax 0 (dequantised: exactly 0).
            scales = (
                (mine[0], math.prod(mine[1:]) // BLOCKSIZE) if shape is None else (-(-numel // BLOCKSIZE),)
            )
            tensors = {}
            for key, absmax, code in zip(
                (EXP_AVG, EXP_AVG_SQ), (EXP_AVG_ABSMAX, EXP_AVG_SQ_ABSMAX), self._zero_codes(device)
            ):
                tensors[key] = torch.full(mine, code, dtype=torch.uint8, device=device)
                tensors[absmax] = torch.zeros(scales, dtype=torch.float32, device=device)
        for key, t in tensors.items():
            if shape is not None:
                state[key] = t
            else:
                state[key] = row_sharded_like(p, t, (p.shape[0], *t.shape[1:]))

    def update(
        self, state: dict[str, Any], x: torch.Tensor, group: dict[str, Any]
    ) -> tuple[torch.Tensor, float]:
        """One Adam step of the moments (local rows, for a sharded state)."""
        m_q, v_q = local(state[EXP_AVG]), local(state[EXP_AVG_SQ])
        x32 = local(x).float()
        if m_q.dtype != torch.uint8:
            norm, step_size = adam_update(m_q, v_q, x32, state[STEP], group, self.fused)
            return norm.to(x.dtype), step_size
        if not x32.numel():  # a rank without rows of this weight: nothing to quantise
            norm, step_size = adam_update(x32.clone(), x32.clone(), x32, state[STEP], group, self.fused)
            return norm.to(x.dtype), step_size
        a_m, a_v = local(state[EXP_AVG_ABSMAX]), local(state[EXP_AVG_SQ_ABSMAX])
        q_signed, q_unsigned = self._maps(x32.device)
        m = self._bnb.dequantize_blockwise(m_q, absmax=a_m.reshape(-1), code=q_signed, blocksize=BLOCKSIZE)
        v = self._bnb.dequantize_blockwise(v_q, absmax=a_v.reshape(-1), code=q_unsigned, blocksize=BLOCKSIZE)
        norm, step_size = adam_update(m, v, x32, state[STEP], group, self.fused)
        # bitsandbytes' quantize launches on the legacy default stream whatever the current one
        # (optimizers/_streams.py): it runs there, after the moments are written on the current
        # stream, and so do the copies of its outputs (allocated there); the current stream
        # waits for them before the next dequantize reads the codes.
        with ordered_on(legacy_stream(x32.device), x32.device, used=(m, v, m_q, a_m, v_q, a_v)):
            for codes, absmax, val, qmap in ((m_q, a_m, m, q_signed), (v_q, a_v, v, q_unsigned)):
                q, qs = self._bnb.quantize_blockwise(val, code=qmap, blocksize=BLOCKSIZE)
                codes.copy_(q)
                absmax.copy_(qs.absmax.reshape(absmax.shape))
        return norm.to(x.dtype), step_size

    @classmethod
    def nbytes(
        cls, numel: int, dtype: torch.dtype, group: dict[str, Any], shape: tuple[int, ...] | None = None
    ) -> int:
        """2 L + 8 ceil(L / 256) for 8-bit moments (uint8 + fp32 absmax), 8 L when L < min_8bit_size."""
        if not cls._is_8bit(numel, group):
            return 2 * numel * torch.float32.itemsize
        return 2 * numel + 2 * (-(-numel // BLOCKSIZE)) * torch.float32.itemsize

    @classmethod
    def part_nbytes(cls, numel: int, part: int, dtype: torch.dtype, group: dict[str, Any]) -> int:
        """A rank's rows of a weight that `steps_shards`: 8-bit or fp32 as the whole weight is
        (``numel`` against ``min_8bit_size``), ``2 part + 8 ceil(part / 256)`` or ``8 part`` bytes."""
        if not cls._is_8bit(numel, group):
            return 2 * part * torch.float32.itemsize
        return 2 * part + 2 * (-(-part // BLOCKSIZE)) * torch.float32.itemsize


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
    each; shaped (rows, row entries / 256) and row-sharded for an FSDP2 weight that
    `BlockwiseMoments8bit.steps_shards`), and for projected params ``basis`` (parameter dtype), ``refresh``, ``seed``.
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
    RESET_KEYS: ClassVar[tuple[str, ...]] = (STEP, EXP_AVG, EXP_AVG_SQ, EXP_AVG_ABSMAX, EXP_AVG_SQ_ABSMAX)
    """A momentum reset zeroes the codes and their scales: a zero scale reads exactly 0, where
    code 0 alone is -0.99 of its block's scale under the signed map (`optimizers.momentum_reset`)."""
    MOMENTS: ClassVar[type[AdamMoments]] = BlockwiseMoments8bit


__all__ = ["BLOCKSIZE", "EXP_AVG_ABSMAX", "EXP_AVG_SQ_ABSMAX", "BlockwiseMoments8bit", "GaLoreAdamW8bit"]

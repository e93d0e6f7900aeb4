"""4-bit Adam moments (Li et al., NeurIPS 2023, "Memory Efficient Optimizers with 4-bit States"):
the quantizers and `Moments4bit`, the moment storage that `AdamW4bit` and `GaLoreAdamW4bit` share.

A moment of L entries is stored as L 4-bit codes, two per byte (``ceil(L / 2)`` uint8), plus fp32
scales. Quantizing x: normalise by its scale to [-1, 1] (M) or [0, 1] (V), take the nearest entry
of a 16-entry map (ties go up), store its index; dequantizing: map[code] * scale.

* First moment M (both schemes): blocks of `BLOCKSIZE` = 128 consecutive entries of the flattened
  moment (the last block may be partial), scale = the block's absmax, and the signed
  dynamic-exponent (DE) map `SIGNED_DE_MAP` (bitsandbytes' dynamic map generalised to 4 bits: 3
  exponent levels 10^-2, 10^-1, 10^0 with 1, 2 and 4 fractions each, their negatives, 0 and 1).
* Second moment V, ``quant_scheme="rank1"`` (Li et al.'s, the default): rank-1 normalisation of
  the moment as a matrix (rows = its first dimension, columns = the rest): with r_i the largest
  entry of row i and c_j of column j, entry (i, j) is scaled by min(r_i, c_j); the map is linear
  without zero, `UNSIGNED_LINEAR_MAP` = (k + 1) / 16, k = 0..15, so that no nonzero V (the
  denominator of the update) is rounded to 0. A 1-D moment has no columns: it uses blocks of 128.
* V, ``quant_scheme="blockwise"`` (torchao's ``AdamW4bit``): blocks of 128 with their absmax and
  the same linear map.

Each step the moments are dequantised to fp32, advanced by `adam_update` (whose update direction
uses these fp32 moments), then quantised again. A moment with fewer than ``min_4bit_size`` entries
(default 4096, as bitsandbytes' and torchao's) stays fp32. The maps are constants of this module,
not state. Blocks and rank-1 scales span the whole tensor: under FSDP2 every weight steps whole on
its owner rank (`Moments4bit.ELEMENTWISE` is False), which alone holds its state.

Differences from the two references, by design: Li et al.'s code quantizes only tensors of >= 2
dimensions with more than 4096 entries (here: any tensor of >= ``min_4bit_size`` entries, as
bitsandbytes and torchao count it); torchao quantizes only tensors whose size is a multiple of 128
(here any size: a partial last block, an odd count with a half-used last byte) and stores each
block's absmax clipped at 1e-12 and a copy of the map per tensor (here the exact absmax, 0 for a
zero block, which then reads exactly 0, and no map in the state).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from optimizers._adam import EXP_AVG, EXP_AVG_SQ, STEP, AdamMoments, adam_update
from optimizers._sharded import local
from optimizers.galore_8bit import EXP_AVG_ABSMAX, EXP_AVG_SQ_ABSMAX

BLOCKSIZE = 128
"""Entries per quantisation block (Li et al.'s B128, torchao's ``block_size``)."""
CHUNK = 1 << 16
"""Entries encoded or decoded at a time (a multiple of 2 and of `BLOCKSIZE`): bounds the int32
code indices, the only full-width temporary of the codec, to ``4 CHUNK`` bytes."""

QUANT_SCHEMES: tuple[str, ...] = ("rank1", "blockwise")
"""How V is normalised: Li et al.'s rank-1 normalisation, or torchao's blocks of 128."""
GROUP_DEFAULTS: dict[str, Any] = {"min_4bit_size": 4096, "quant_scheme": "rank1"}
"""The 4-bit group keys and their defaults (both 4-bit optimizers' ``ADAM_DEFAULTS`` take them)."""

EXP_AVG_SQ_ROW_MAX = f"{EXP_AVG_SQ}_row_max"
"""State key of V's per-row maxima r_i (fp32, one per row), ``quant_scheme="rank1"``."""
EXP_AVG_SQ_COL_MAX = f"{EXP_AVG_SQ}_col_max"
"""State key of V's per-column maxima c_j (fp32, one per column), ``quant_scheme="rank1"``."""

RESET_KEYS: tuple[str, ...] = (
    STEP,
    EXP_AVG,
    EXP_AVG_SQ,
    EXP_AVG_ABSMAX,
    EXP_AVG_SQ_ABSMAX,
    EXP_AVG_SQ_ROW_MAX,
    EXP_AVG_SQ_COL_MAX,
)
"""A momentum reset zeroes the codes and every scale: a zero scale reads exactly 0, where code 0
alone reads -0.8875 of its block's scale under the signed map and 1/16 of its scale under the
linear one (`optimizers.momentum_reset`)."""

_TINY = torch.finfo(torch.float32).tiny


def _signed_de_map() -> torch.Tensor:
    """The signed 4-bit dynamic-exponent map (16 fp32 entries, sorted): for exponent level
    i = 0, 1, 2 the midpoints of ``linspace(0.1, 1, 2^i + 1)`` (fp32) times 10^(i - 2), each with
    its negative, then 0 and 1 (Dettmers' dynamic map with 3 exponent bits in 4 bits)."""
    values = [0.0, 1.0]
    for i in range(3):
        bounds = torch.linspace(0.1, 1.0, 2**i + 1, dtype=torch.float32)
        means = ((bounds[:-1] + bounds[1:]) / 2).double() * 10.0 ** (i - 2)
        values += means.tolist() + (-means).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


SIGNED_DE_MAP: torch.Tensor = _signed_de_map()
"""M's map: -0.8875 ... -0.0055, 0, 0.0055 ... 0.8875, 1 (16 entries)."""
UNSIGNED_LINEAR_MAP: torch.Tensor = torch.arange(1, 17, dtype=torch.float32) / 16
"""V's map: (k + 1) / 16 for k = 0..15, linear and without zero."""


def _midpoints(qmap: torch.Tensor) -> torch.Tensor:
    return (qmap[:-1] + qmap[1:]) / 2


def quantize_codes(y: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """The int32 index of the nearest entry of sorted `qmap` for every entry of normalised `y`
    (a tie goes to the larger entry; values beyond the map take its end)."""
    return torch.bucketize(y, _midpoints(qmap), out_int32=True, right=True)


def pack_(codes: torch.Tensor, out: torch.Tensor) -> None:
    """Writes L codes (< 16, any integer dtype, flat) two per byte into `out` (uint8,
    ceil(L / 2)): entry 2i in the high nibble of byte i, entry 2i + 1 in its low nibble (an odd
    L leaves the last low nibble 0)."""
    torch.bitwise_left_shift(codes[0::2], 4, out=out)
    out[: codes.numel() // 2].bitwise_or_(codes[1::2])


def unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The `numel` codes `pack_` stored in `packed`, as int32 (flat)."""
    codes = torch.empty(2 * packed.numel(), dtype=torch.int32, device=packed.device)
    torch.bitwise_right_shift(packed, 4, out=codes[0::2])
    torch.bitwise_and(packed, 15, out=codes[1::2])
    return codes[:numel]


def _chunks(numel: int) -> range:
    return range(0, numel, CHUNK)


def encode_(y: torch.Tensor, qmap: torch.Tensor, codes: torch.Tensor) -> None:
    """``codes`` (uint8, ceil(L / 2)) <- the packed nearest `qmap` indices of normalised `y`
    (flat, L entries), `CHUNK` entries at a time (the int32 indices of one chunk are the only
    temporary)."""
    for start in _chunks(y.numel()):
        part = y[start : start + CHUNK]
        pack_(quantize_codes(part, qmap), codes[start // 2 : (start + part.numel() + 1) // 2])


def decode(codes: torch.Tensor, qmap: torch.Tensor, numel: int) -> torch.Tensor:
    """The `numel` map values qmap[code] of the packed `codes` (fp32, flat), `CHUNK` at a time."""
    out = torch.empty(numel, dtype=qmap.dtype, device=codes.device)
    for start in _chunks(numel):
        stop = min(start + CHUNK, numel)
        index = unpack(codes[start // 2 : (stop + 1) // 2], stop - start)
        torch.index_select(qmap, 0, index, out=out[start:stop])
    return out


def _blocks(flat: torch.Tensor) -> list[tuple[torch.Tensor, slice]]:
    """`flat` as (blocks x entries) views, each with its scales' slice: the whole blocks of
    `BLOCKSIZE`, then the partial last block, if any."""
    whole = flat.numel() // BLOCKSIZE
    out = []
    if whole:
        out.append((flat[: whole * BLOCKSIZE].view(whole, BLOCKSIZE), slice(0, whole)))
    if flat.numel() > whole * BLOCKSIZE:
        out.append((flat[whole * BLOCKSIZE :].view(1, -1), slice(whole, whole + 1)))
    return out


def blockwise_quantize_(
    y: torch.Tensor, qmap: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor
) -> None:
    """Quantizes fp32 `y` (any shape, contiguous; overwritten with its normalised values) by
    blocks of `BLOCKSIZE`: ``absmax`` (fp32, ceil(L / 128)) <- max |y| per block, ``codes`` (uint8,
    ceil(L / 2)) <- the packed nearest `qmap` indices of y / absmax (a zero block: of 0)."""
    flat = y.view(-1)
    for view, rows in _blocks(flat):
        scale = torch.linalg.vector_norm(view, ord=math.inf, dim=1)
        absmax[rows].copy_(scale)
        view.div_(scale.clamp_min_(_TINY)[:, None])
    encode_(flat, qmap, codes)


def blockwise_dequantize(
    codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, shape: tuple[int, ...]
) -> torch.Tensor:
    """The fp32 tensor of `shape` that `blockwise_quantize_` stored: qmap[code] * absmax."""
    flat = decode(codes, qmap, math.prod(shape))
    for view, rows in _blocks(flat):
        view.mul_(absmax[rows][:, None])
    return flat.view(shape)


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], -1)


def _row_chunks(mat: torch.Tensor) -> list[slice]:
    """Slices of whole rows of `mat` of at most `CHUNK` entries each (one row if a row is longer):
    the rank-1 scales min(r_i, c_j) are formed one such slice at a time."""
    step = max(1, CHUNK // max(1, mat.shape[1]))
    return [slice(i, i + step) for i in range(0, mat.shape[0], step)]


def rank1_quantize_(
    y: torch.Tensor, qmap: torch.Tensor, codes: torch.Tensor, row_max: torch.Tensor, col_max: torch.Tensor
) -> None:
    """Quantizes non-negative fp32 `y` (>= 2 dimensions, contiguous, read as rows x the rest;
    overwritten) with rank-1 normalisation: ``row_max`` <- r_i = max_j y_ij, ``col_max`` <- c_j =
    max_i y_ij, ``codes`` <- the packed nearest `qmap` indices of y_ij / min(r_i, c_j) (0 where
    that is 0: then y_ij = 0 too)."""
    mat = _as_matrix(y)
    torch.amax(mat, dim=1, out=row_max)
    torch.amax(mat, dim=0, out=col_max)
    for rows in _row_chunks(mat):
        mat[rows].div_(torch.minimum(row_max[rows, None], col_max[None, :]).clamp_min_(_TINY))
    encode_(y.view(-1), qmap, codes)


def rank1_dequantize(
    codes: torch.Tensor,
    row_max: torch.Tensor,
    col_max: torch.Tensor,
    qmap: torch.Tensor,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """The fp32 tensor of `shape` that `rank1_quantize_` stored: qmap[code_ij] * min(r_i, c_j)."""
    y = decode(codes, qmap, math.prod(shape)).view(shape)
    mat = _as_matrix(y)
    for rows in _row_chunks(mat):
        mat[rows].mul_(torch.minimum(row_max[rows, None], col_max[None, :]))
    return y


class Moments4bit(AdamMoments):
    """Moment storage in 4 bits (module docstring): M block-wise with the signed DE map; V with
    rank-1 normalisation (``quant_scheme="rank1"``, Li et al.) or block-wise (``"blockwise"``,
    torchao's scheme), with the linear map without zero.

    State per moment of L entries (a parameter, or a projected parameter's low-rank moment), when
    L >= ``min_4bit_size``: ``exp_avg`` and ``exp_avg_sq`` (uint8, ceil(L / 2): two codes per byte),
    ``exp_avg_absmax`` (fp32, ceil(L / 128)), and for V either ``exp_avg_sq_row_max`` (fp32, a)
    and ``exp_avg_sq_col_max`` (fp32, b) for a moment read as a x b (a = its first dimension,
    rank1 with >= 2 dimensions), or ``exp_avg_sq_absmax`` (fp32, ceil(L / 128)). Below
    ``min_4bit_size``: ``exp_avg`` and ``exp_avg_sq`` in fp32. Bytes: `nbytes`.

    The blocks and the rank-1 maxima span the whole tensor, so the state is not element-wise:
    under FSDP2 every weight steps whole, on its owner rank (`steps_shards` is False).
    """

    ELEMENTWISE: ClassVar[bool] = False

    def __init__(self, fused: bool | None = None) -> None:
        super().__init__(fused)
        self._maps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _maps_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The signed DE map (M) and the unsigned linear map (V) on `device`, cached."""
        if device not in self._maps:
            self._maps[device] = (SIGNED_DE_MAP.to(device), UNSIGNED_LINEAR_MAP.to(device))
        return self._maps[device]

    @staticmethod
    def is_4bit(numel: int, group: dict[str, Any]) -> bool:
        """Whether a moment of `numel` entries is quantised (else it stays fp32)."""
        return 0 < numel and numel >= int(group["min_4bit_size"])

    @staticmethod
    def rank1(shape: tuple[int, ...], group: dict[str, Any]) -> bool:
        """Whether V of `shape` is rank-1 normalised (else block-wise)."""
        return group["quant_scheme"] == "rank1" and len(shape) >= 2

    @staticmethod
    def check_group(group: dict[str, Any]) -> None:
        """Validates a group's 4-bit keys (ValueError naming the problem)."""
        if group["quant_scheme"] not in QUANT_SCHEMES:
            raise ValueError(f"quant_scheme must be one of {QUANT_SCHEMES}, got {group['quant_scheme']!r}")
        if int(group["min_4bit_size"]) < 0:
            raise ValueError(f"min_4bit_size must be >= 0, got {group['min_4bit_size']!r}")

    def init(
        self, state: dict[str, Any], p: torch.Tensor, shape: tuple[int, ...] | None, group: dict[str, Any]
    ) -> None:
        """Zero moments of `shape` (None: `p`'s): codes 0 with zero scales (read as exactly 0),
        or fp32 zeros below ``min_4bit_size``."""
        shape = tuple(local(p).shape) if shape is None else tuple(shape)
        device, numel = local(p).device, math.prod(shape)
        zeros = torch.zeros
        if not self.is_4bit(numel, group):
            state[EXP_AVG] = zeros(shape, dtype=torch.float32, device=device)
            state[EXP_AVG_SQ] = zeros(shape, dtype=torch.float32, device=device)
            return
        nbytes, blocks = -(-numel // 2), -(-numel // BLOCKSIZE)
        state[EXP_AVG] = zeros(nbytes, dtype=torch.uint8, device=device)
        state[EXP_AVG_ABSMAX] = zeros(blocks, dtype=torch.float32, device=device)
        state[EXP_AVG_SQ] = zeros(nbytes, dtype=torch.uint8, device=device)
        if self.rank1(shape, group):
            state[EXP_AVG_SQ_ROW_MAX] = zeros(shape[0], dtype=torch.float32, device=device)
            state[EXP_AVG_SQ_COL_MAX] = zeros(numel // shape[0], dtype=torch.float32, device=device)
        else:
            state[EXP_AVG_SQ_ABSMAX] = zeros(blocks, dtype=torch.float32, device=device)

    def update(
        self, state: dict[str, Any], x: torch.Tensor, group: dict[str, Any]
    ) -> tuple[torch.Tensor, float]:
        """One Adam step: dequantise M and V to fp32, advance them with x (`adam_update`, which
        returns N from these fp32 moments), quantise them back; returns (N in x's dtype, eta_t)."""
        x = local(x)
        shape = tuple(x.shape)
        if state[EXP_AVG].dtype != torch.uint8:
            norm, step_size = adam_update(
                state[EXP_AVG], state[EXP_AVG_SQ], x.float(), state[STEP], group, self.fused
            )
            return norm.to(x.dtype), step_size
        signed, unsigned = self._maps_on(x.device)
        m = blockwise_dequantize(state[EXP_AVG], state[EXP_AVG_ABSMAX], signed, shape)
        rank1 = EXP_AVG_SQ_ROW_MAX in state
        if rank1:
            v = rank1_dequantize(
                state[EXP_AVG_SQ], state[EXP_AVG_SQ_ROW_MAX], state[EXP_AVG_SQ_COL_MAX], unsigned, shape
            )
        else:
            v = blockwise_dequantize(state[EXP_AVG_SQ], state[EXP_AVG_SQ_ABSMAX], unsigned, shape)
        # The fp32 copy of a low-precision x is made after the moments, and dropped before they
        # are encoded, so that it never meets the codec's temporaries.
        x32 = x.float()
        norm, step_size = adam_update(m, v, x32, state[STEP], group, self.fused)
        del x32
        blockwise_quantize_(m, signed, state[EXP_AVG], state[EXP_AVG_ABSMAX])
        del m
        if rank1:
            rank1_quantize_(
                v, unsigned, state[EXP_AVG_SQ], state[EXP_AVG_SQ_ROW_MAX], state[EXP_AVG_SQ_COL_MAX]
            )
        else:
            blockwise_quantize_(v, unsigned, state[EXP_AVG_SQ], state[EXP_AVG_SQ_ABSMAX])
        return norm.to(x.dtype), step_size

    @classmethod
    def step_transient_bytes(cls, numel: int, dtype: torch.dtype, group: dict[str, Any]) -> int:
        """Bytes of the temporaries of one `update` of `numel`-entry moments for an input x of
        `dtype` (s its itemsize; `group` keys missing take `GROUP_DEFAULTS`), measured with the
        tensor accounting. Quantised: the dequantised M and V and the update N (fp32, 12 L) with,
        at the fused Adam kernel, x's fp32 copy (4 L, s != 4), or, while a moment is decoded or
        encoded, the int32 codes of one chunk (4 min(L, `CHUNK`)): ``12 L + 4 L`` (s != 4) or
        ``12 L + 4 min(L, CHUNK)`` (s = 4), plus per-block scales (4 ceil(L / 128), under 1%).
        fp32 moments: N and x's fp32 copy, ``4 L + 4 L [s != 4]``."""
        group = {**GROUP_DEFAULTS, **group}
        copy = 4 * numel if dtype.itemsize != 4 else 0
        if not cls.is_4bit(numel, group):
            return 4 * numel + copy
        return 12 * numel + max(copy, 4 * min(numel, CHUNK))

    @classmethod
    def nbytes(
        cls, numel: int, dtype: torch.dtype, group: dict[str, Any], shape: tuple[int, ...] | None = None
    ) -> int:
        """Bytes of M and V holding `numel` entries each (`shape`: the moment's shape, needed for
        rank-1 V), with L = numel:

            L >= min_4bit_size, rank-1 V (a x b):  2 ceil(L / 2) + 4 ceil(L / 128) + 4 (a + b)
            L >= min_4bit_size, block-wise V:      2 ceil(L / 2) + 8 ceil(L / 128)
            L <  min_4bit_size:                    8 L                  (fp32 moments)

        (`dtype` plays no part: the codes are uint8, the scales and small moments fp32.)
        """
        if not cls.is_4bit(numel, group):
            return 2 * numel * torch.float32.itemsize
        codes, scales = 2 * -(-numel // 2), 4 * -(-numel // BLOCKSIZE)
        if shape is None:
            if group["quant_scheme"] == "rank1":
                raise ValueError("rank-1 4-bit moments need the moment's shape for their bytes")
            return codes + 2 * scales
        if cls.rank1(tuple(shape), group):
            return codes + scales + 4 * (shape[0] + numel // shape[0])
        return codes + 2 * scales


__all__ = [
    "BLOCKSIZE",
    "CHUNK",
    "EXP_AVG_SQ_COL_MAX",
    "EXP_AVG_SQ_ROW_MAX",
    "GROUP_DEFAULTS",
    "QUANT_SCHEMES",
    "RESET_KEYS",
    "SIGNED_DE_MAP",
    "UNSIGNED_LINEAR_MAP",
    "Moments4bit",
    "blockwise_dequantize",
    "blockwise_quantize_",
    "decode",
    "encode_",
    "pack_",
    "quantize_codes",
    "rank1_dequantize",
    "rank1_quantize_",
    "unpack",
]

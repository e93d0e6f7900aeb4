"""How a weight's new value is rounded to its storage: counter-based noise, stochastic rounding to
bf16, and INT8 codes with per-group scales.

Noise. A stochastic rounding needs one uniform draw per element. The draws here are counter-based:
element ``i`` (its offset in the whole parameter, row-major) of parameter ``k`` at step ``t`` of a
run seeded ``s`` draws ``u = hash(hash(s, k, t) + i) / 2^24``, a pure function of those four
integers. So DDP replicas draw the same noise without communicating, an FSDP2 shard draws exactly
its rows' share of the one-process draws (it passes its first row's offset), a CPU and a GPU draw
the same, and a resumed run draws what the uninterrupted one would have with no generator state in
its checkpoint. The hash is the 32-bit "lowbias32" integer finaliser (two multiply-xorshift rounds;
constants by C. Wellons' hash prospector), computed in int64 with the multiplications split into
16-bit halves, so no intermediate exceeds 2^49 on any device; ``u`` keeps its top 24 bits and is
exactly representable in fp32, uniform on [0, 1) in steps of 2^-24.

bf16. ``x`` (fp32) rounds to one of the two bf16 values around it with probabilities that make
the result unbiased: E[round(x)] = x. With the fp32 bits of ``x`` as an integer b (sign and
magnitude), adding floor(u 2^16) to b and clearing the low 16 bits moves the magnitude up a bf16
step with probability frac (the dropped bits / 2^16) and truncates it otherwise: for either sign,
the result is x's magnitude rounded up with probability equal to its distance from the lower
value, over the step.

INT8. A weight of shape (m, n) is stored as int8 codes (m, n) and fp32 scales (m, ceil(n / g)):
row r's columns [j g, (j + 1) g) form group (r, j), whose scale is its absmax / 127 (1 where the
group is all zero); a value x of the group is code q = round(x / scale) in [-127, 127] and reads
back as q scale. Groups run along a row, so a row-sharded (FSDP2) weight never splits one. Bytes:
``m n + 4 m ceil(n / g)`` (1.03 B per element at g = 128). A new value rounds stochastically
(floor(x / scale + u): E = x / scale, unbiased) or to nearest; the scale is recomputed from the
new values at every write.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

_M32 = 0xFFFFFFFF
_K1, _K2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor | int, c: int) -> torch.Tensor | int:
    """(x c) mod 2^32 for x in [0, 2^32), without an intermediate above 2^49."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """The lowbias32 finaliser on 32-bit values (tensors of int64, or Python ints)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _K1)
    x = x ^ (x >> 15)
    x = _mul32(x, _K2)
    return x ^ (x >> 16)


def stream_key(seed: int, param: int, step: int) -> int:
    """The 32-bit key of one parameter's noise at one step of a run."""
    k = _mix32((int(seed) & _M32) ^ _GOLDEN)
    k = _mix32(k ^ (int(param) & _M32))
    return int(_mix32(k ^ (int(step) & _M32)))


def _uniform_eager(
    key: torch.Tensor, offset: torch.Tensor, n: int, device: torch.device | str
) -> torch.Tensor:
    idx = torch.arange(n, dtype=torch.int64, device=device) + offset
    # Offsets past 2^32 (tensors of more than 4G elements) fold their high bits into the key.
    k = _mix32(key ^ ((idx >> 32) & _M32))
    h = _mix32(((idx & _M32) + k) & _M32)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


_compiled: dict[str, Any] = {}


def _uniform_kernel(device: torch.device) -> Any:
    """The noise kernel for `device`: compiled once (Inductor fuses the ~20 integer passes into one
    loop: 50x faster on a CPU) where a compiler is available, else eager. Integer arithmetic and
    exact conversions only, so both give the same bits (`tests/optimizers/test_rounding.py`)."""
    kind = torch.device(device).type
    if kind not in _compiled:
        try:
            _compiled[kind] = torch.compile(_uniform_eager, dynamic=False, fullgraph=True)
        except Exception:  # no compiler backend: eager is the same function
            _compiled[kind] = _uniform_eager
    return _compiled[kind]


def uniform(
    key: int, offset: int, shape: tuple[int, ...], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """fp32 uniforms on [0, 1) for the elements ``offset, offset + 1, ...`` of a noise stream
    `key` (`stream_key`), laid out in `shape` (row-major): the compiled kernel, or the eager
    function where compilation fails (or `USE_COMPILED` is off); the same bits either way."""
    n = math.prod(shape)
    if not USE_COMPILED:
        k = torch.tensor(int(key), dtype=torch.int64, device=device)
        o = torch.tensor(int(offset), dtype=torch.int64, device=device)
        return _uniform_eager(k, o, n, device).reshape(shape)
    if _get_current_dispatch_mode() is None:
        return _uniform_compiled(key, offset, n, device).reshape(shape)
    # Under a dispatch mode (the memory measurement): the mode sees the result allocated (what the
    # fused kernel allocates), and the kernel runs outside it, its output copied in unseen.
    out = torch.empty(shape, dtype=torch.float32, device=device)
    with _disable_current_modes():
        out.view(-1).copy_(_uniform_compiled(key, offset, n, device))
    return out


#: The kernel's two block sizes: every call draws whole blocks (a static shape: one compiled graph
#: per size and device, never a recompilation) and keeps the elements it asked for.
BLOCKS = (1 << 16, 1 << 20)


def _uniform_compiled(key: int, offset: int, n: int, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    kernel = _uniform_kernel(device)
    size = BLOCKS[0] if n <= BLOCKS[0] else BLOCKS[1]
    k = torch.tensor(int(key), dtype=torch.int64, device=device)
    out = []
    try:
        # The kernel is a fixed integer function, not a model: it runs compiled whatever stance
        # the caller set (the CPU memory measurement runs models with "force_eager", under which
        # the ~20 integer passes ran eagerly: a third of a measured big step's time).
        with torch.no_grad(), _default_stance():
            for start in range(0, n, size):
                o = torch.tensor(int(offset) + start, dtype=torch.int64, device=device)
                out.append(kernel(k, o, size, device)[: min(size, n - start)])
    except Exception:  # a backend that fails at its first call (no C++ compiler): eager from now on
        _compiled[device.type] = _uniform_eager
        return _uniform_eager(k, torch.tensor(int(offset), dtype=torch.int64, device=device), n, device)
    return out[0] if len(out) == 1 else torch.cat(out)


def _default_stance() -> Any:
    """torch.compile's default stance for the block (a torch without stances: nothing to undo)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("default") if set_stance is not None else contextlib.nullcontext()


#: Whether `uniform` may use its compiled kernel (tests compare both paths).
USE_COMPILED = True


def round_bf16_(out: torch.Tensor, x: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """Writes fp32 `x` into bf16 `out`: stochastically with uniforms `u` (same shape), or to
    nearest for None. Returns `out`.

    The fp32 bits b of x, read as a signed 32-bit integer, are sign and magnitude: b + floor(u 2^16)
    carries into the magnitude exactly (no finite magnitude overflows), and clearing the low 16
    bits leaves a bf16 value. Non-finite values are written as they are (to nearest)."""
    if u is None:
        return out.copy_(x)
    x = x.float().contiguous()
    r = (u * 65536.0).to(torch.int32)
    rounded = x.view(torch.int32).add(r).bitwise_and_(-65536).view(torch.float32)
    del r
    return out.copy_(torch.where(torch.isfinite(x), rounded, x))


def int8_groups(n: int, group: int) -> int:
    """Groups per row of an n-column INT8 weight with groups of `group` columns."""
    return -(-n // group)


def int8_nbytes(shape: tuple[int, ...], group: int) -> int:
    """Bytes of an INT8 weight: codes (1 B per element) and fp32 scales (one per group)."""
    m, n = shape
    return m * n + 4 * m * int8_groups(n, group)


def dequantize_int8(
    codes: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The values of INT8 `codes` (m, n) with `scales` (m, ceil(n / group)), in `dtype` (the
    product is taken in fp32 and cast once): one (m, n) temporary of fp32 (and one of `dtype`)."""
    m, n = codes.shape
    g = scales.shape[1]
    if g * group == n:
        x = codes.to(torch.float32).reshape(m, g, group).mul_(scales.unsqueeze(2)).reshape(m, n)
    else:
        x = codes.to(torch.float32).mul_(scales.repeat_interleave(group, dim=1)[:, :n])
    return x if dtype == torch.float32 else x.to(dtype)


def quantize_int8_(
    codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, group: int, u: torch.Tensor | None
) -> None:
    """Writes fp32 `x` (m, n) into `codes` and `scales` in place: per-group scale absmax / 127,
    codes floor(x / scale + u) with uniforms `u` (stochastic) or round(x / scale) for None."""
    m, n = x.shape
    g = int8_groups(n, group)
    pad = g * group - n
    xp = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    blocks = xp.reshape(m, g, group)
    absmax = blocks.abs().amax(dim=2)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = blocks / scale.unsqueeze(2)
    if u is None:
        q = torch.round(q)
    else:
        up = torch.nn.functional.pad(u, (0, pad)) if pad else u
        q = torch.floor(q + up.reshape(m, g, group))
    q = q.clamp_(-127, 127).reshape(m, g * group)[:, :n]
    codes.copy_(q.to(torch.int8))
    scales.copy_(scale)

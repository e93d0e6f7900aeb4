"""The one place an update lands in a weight.

Every optimizer's rule writes its step through `written`::

    with written(p) as w:      # w: p's value in fp32 (p itself for a plain fp32 weight)
        w.mul_(1 - lr * wd)    # the method's own in-place arithmetic, unchanged
        w.add_(update, alpha=-lr)

On leaving the block the new value is stored once, by what the weight is:

- a plain fp32 weight: ``w`` is the weight; the rule's operations are the write (bitwise what they
  were before the writer existed);
- a bf16 or fp16 weight: ``w`` is an fp32 copy; it is rounded once into the weight, to nearest or,
  with stochastic rounding on, unbiased (`optimizers.rounding.round_bf16_`). Without the writer the
  rule's decay and its update would each round to bf16: two roundings a step;
- an `optimizers.int8.Int8Weight`: ``w`` is its dequantized value; the codes and scales are
  recomputed from the new value once, stochastically or to nearest.

The rounding's noise is counter-based (`optimizers.rounding.uniform`): keyed by the run's seed, the
parameter's index in the model (`attach`), the step (`Rounding.step`, set by the trainer before it
steps) and each element's offset in the whole parameter (an FSDP2 shard adds its first row's
offset), so DDP replicas, FSDP2 shards, CPUs and GPUs round alike and a resume needs no generator
state. Bytes: for a rounded weight of L elements, the fp32 copy ``w`` (4 L) while the rule runs,
then the noise and the rounding's temporaries over chunks of `CHUNK` elements.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from optimizers import rounding
from optimizers.int8 import Int8Weight

__all__ = [
    "CHUNK",
    "Rounding",
    "attach",
    "detach_all",
    "needs_writer",
    "rounding_of",
    "stepping",
    "transient_bytes",
    "written",
]

CHUNK = 1 << 20
"""Elements rounded at a time: bounds the noise and rounding temporaries (tens of bytes an element)."""

_ATTR = "_effpretrain_rounding"


@dataclass
class Rounding:
    """A run's rounding of weight updates: stochastic or to nearest, the noise's seed, and the
    step being taken (the trainer sets it before each optimizer step, updates in backward
    included)."""

    stochastic: bool
    seed: int = 0
    step: int = 0


def attach(params: list[tuple[int, torch.Tensor]], plan: Rounding) -> int:
    """Gives each (index, parameter) the run's `plan` and its noise index (its position in the
    model's parameter order, the same in every launch mode); returns how many got one. Only weights
    whose storage rounds (bf16, fp16, INT8) need it."""
    n = 0
    for index, p in params:
        if needs_writer(p):
            setattr(p, _ATTR, (plan, int(index)))
            n += 1
    return n


def detach_all(params: list[torch.Tensor]) -> None:
    """Removes `attach`'s plan from `params`."""
    for p in params:
        if hasattr(p, _ATTR):
            delattr(p, _ATTR)


def rounding_of(p: torch.Tensor) -> tuple[Rounding, int] | None:
    """The plan and noise index `attach` gave `p` (None: rounds to nearest)."""
    return getattr(p, _ATTR, None)


#: The parameter whose local shard a rule is stepping (`stepping`): a rule given the shard alone
#: writes it as that parameter (its rounding plan, its rows' offset in the whole tensor).
_STEPPING: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("stepping", default=None)


@contextlib.contextmanager
def stepping(p: torch.Tensor) -> Iterator[None]:
    """Marks `p` as the parameter a rule steps through its local shard (the placement driver of
    `optimizers._owners`): `written` of that shard rounds as `p` would, with `p`'s noise index and
    its shard's row offset, not as a stranger tensor (to nearest, from row 0)."""
    token = _STEPPING.set(p)
    try:
        yield
    finally:
        _STEPPING.reset(token)


def _parameter_of(t: torch.Tensor) -> torch.Tensor:
    """The parameter `t` stands for: the one being stepped (`stepping`) when `t` is its local
    shard, else `t` itself."""
    p = _STEPPING.get()
    if p is None or p is t:
        return t
    shard = _local(p)
    plain = type(shard) is torch.Tensor and type(t) is torch.Tensor  # to_local: a new alias of it
    same = shard is t or (plain and shard.data_ptr() == t.data_ptr() and shard.shape == t.shape)
    return p if same else t


def _local(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard itself (not `to_local`'s autograd view, which for an INT8 shard
    would be a dequantized copy), else `p`."""
    return p._local_tensor if hasattr(p, "_local_tensor") else p


def needs_writer(p: torch.Tensor) -> bool:
    """Whether `p`'s storage rounds an fp32 value (bf16, fp16, INT8): its rule must write it
    through `written`, not in place."""
    t = _local(p)
    return isinstance(t, Int8Weight) or t.dtype in (torch.bfloat16, torch.float16)


def _row_offset(p: torch.Tensor) -> int:
    """The first row of `p`'s local shard in the whole tensor (0 unless an FSDP2 DTensor; rows
    split as torch.chunk splits them)."""
    if not hasattr(p, "device_mesh"):
        return 0
    c = -(-p.shape[0] // p.device_mesh.size())  # torch.chunk's rows: c each, the last ones fewer
    return min(p.shape[0], c * p.device_mesh.get_local_rank())


def _noise(p: torch.Tensor, t: torch.Tensor, start_row: int, rows: int) -> torch.Tensor | None:
    """Uniforms for rows [start_row, start_row + rows) of `p`'s local tensor `t` (None: round to
    nearest)."""
    found = rounding_of(p)
    if found is None or not found[0].stochastic:
        return None
    plan, index = found
    key = rounding.stream_key(plan.seed, index, plan.step)
    width = math.prod(t.shape[1:])
    offset = (_row_offset(p) + start_row) * width
    return rounding.uniform(key, offset, (rows, *t.shape[1:]), t.device)


def _store(p: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> None:
    """Rounds fp32 `w` into `t` (p's local storage), `CHUNK` elements of rows at a time."""
    if t.ndim == 0:
        u = _noise(p, t.reshape(1), 0, 1)
        rounding.round_bf16_(t.reshape(1), w.reshape(1), u) if t.dtype == torch.bfloat16 else t.copy_(w)
        return
    width = max(1, math.prod(t.shape[1:]))
    step = max(1, CHUNK // width)
    for r in range(0, t.shape[0], step):
        rows = min(step, t.shape[0] - r)
        u = _noise(p, t, r, rows)
        if isinstance(t, Int8Weight):
            rounding.quantize_int8_(
                t.codes[r : r + rows], t.scales[r : r + rows], w[r : r + rows], t.group, u
            )
        elif t.dtype == torch.bfloat16:
            rounding.round_bf16_(t[r : r + rows], w[r : r + rows], u)
        else:  # fp16: to nearest (no stochastic rounding for fp16 storage)
            t[r : r + rows].copy_(w[r : r + rows])


def value_fp32(p: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 copy of `p`'s value (its local shard's, for a DTensor)."""
    t = _local(p)
    if isinstance(t, Int8Weight):
        return t.dequantize(torch.float32)
    return t.detach().to(torch.float32, copy=True)


@contextlib.contextmanager
def written(p: torch.Tensor) -> Iterator[torch.Tensor]:
    """Yields `p`'s value in fp32 for the rule to update in place, then stores it once (module
    docstring). A DTensor (FSDP2 shard) yields its local shard's value and keeps its shard; so does
    the shard itself while its parameter is being stepped (`stepping`)."""
    p = _parameter_of(p)
    t = _local(p)
    if not needs_writer(t):
        yield t
        return
    w = value_fp32(t)
    yield w
    with torch.no_grad():
        _store(p, t, w)


def transient_bytes(shape: tuple[int, ...], storage: str, stochastic: bool, group: int = 128) -> int:
    """Bytes `written` holds for one weight of `shape` beyond the weight itself: its fp32 value
    (4 L, L elements) while the rule runs and while it is stored, plus the storing's temporaries
    over one chunk of rows (C elements, at most `CHUNK`; P = C rounded up to whole groups):

    - ``fp32``: 0 (the rule updates the weight itself);
    - ``bf16``: to nearest nothing more; stochastically 15 C (the noise, its integers and the
      rounded bits, 4 B each, and a finiteness mask);
    - ``int8``: to nearest 8 P (x / scale and its rounding), stochastically 12 P + 4 C (the noise
      too), each 4 P more when a row is not whole groups (its padded copy, and the noise's), plus
      8 B per group of the chunk (absmax and scale).
    """
    if storage == "fp32":
        return 0
    L = math.prod(shape)
    n = math.prod(shape[1:]) if len(shape) > 1 else 1
    rows = max(1, CHUNK // max(1, n))
    C = min(shape[0] if shape else 1, rows) * n
    if storage == "bf16":
        return 4 * L + (15 * C if stochastic else 0)
    groups = -(-n // group)
    P = (C // n) * groups * group
    pad = P != C
    if stochastic:
        chunk = (20 if pad else 12) * P + 4 * C
    else:
        chunk = (12 if pad else 8) * P
    return 4 * L + chunk + 8 * (C // n) * groups

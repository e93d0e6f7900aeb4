"""Whole-tensor statistics of FSDP2-sharded (DTensor) tensors, the same numbers on every rank.

A single process and a sharded run must agree on per-tensor statistics, so norms are summed in
fp64 (each fp32 square is exact in fp64, and fp64 sums of the same terms in any order agree to
~1e-16 relative, far below fp32's resolution) and rounded to fp32 once, whether the terms come
from one tensor or from shards added by an all-reduce.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from optimizers.writer import written

_CHUNK = 1 << 22
"""Entries per fp64 partial sum: bounds the transient fp64 copy to 32 MiB."""


@functools.cache
def _dtensor_class() -> type:
    """DTensor's class (NoneType in a torch build without distributed support)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return type(None)
    return DTensor


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (an FSDP2-sharded parameter, gradient or state tensor)."""
    return type(t) is not torch.Tensor and isinstance(t, _dtensor_class())


def shard_group(t: torch.Tensor) -> Any:
    """The process group a DTensor is split over, or None for a plain tensor."""
    return t.device_mesh.get_group() if is_dtensor(t) else None


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: in-place updates reach the DTensor), else `t` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def sum_squares_fp64(t: torch.Tensor) -> torch.Tensor:
    """sum(t^2) of a plain tensor, accumulated in fp64 (a 0-dim fp64 tensor).

    torch's fp64 norm of an fp32 tensor converts a copy first, so large tensors go chunk by chunk.
    """
    flat = t.detach().reshape(-1)
    if flat.numel() <= _CHUNK:
        return torch.linalg.vector_norm(flat, dtype=torch.float64).square()
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for chunk in flat.split(_CHUNK):
        total += torch.linalg.vector_norm(chunk, dtype=torch.float64).square()
    return total


def whole_norm(g: torch.Tensor, group: Any = None) -> torch.Tensor:
    """||G||_2 of the whole tensor (fp32) from this rank's part `g` (all-reduced over `group`)."""
    sq = sum_squares_fp64(g)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(sq, group=group)
    return sq.sqrt().float()


def whole_max_abs(g: torch.Tensor, group: Any = None) -> torch.Tensor:
    """max|G| of the whole tensor (fp32) from this rank's part `g`; an empty part counts 0."""
    m = g.abs().amax().float() if g.numel() else torch.zeros((), device=g.device)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return m


@dataclass
class CommCounter:
    """Collectives that move whole-matrix data for the optimizers (`whole`'s all-gathers, the
    owner ranks' all-to-alls) on this process, and the bytes it sent to and received from other
    ranks through them (its own part excluded). benchmarks/fsdp2_optimizer.py reads it."""

    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def reset(self) -> None:
        self.collectives = self.bytes_sent = self.bytes_received = 0


COMM = CommCounter()
"""This process's counter."""


def whole(t: torch.Tensor) -> torch.Tensor:
    """The full tensor: all-gathered for a DTensor (a collective, counted in `COMM`), `t` itself
    otherwise."""
    if not hasattr(t, "full_tensor"):
        return t
    world = t.device_mesh.size()
    if world > 1:
        mine = t.to_local().numel() * t.dtype.itemsize
        COMM.collectives += 1
        COMM.bytes_received += t.numel() * t.dtype.itemsize - mine
        COMM.bytes_sent += mine * (world - 1)
    return t.full_tensor()


def row_sharded_like(p: torch.Tensor, mine: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A DTensor of global `shape` laid out like DTensor `p` (FSDP2's dim-0 row shards: the same
    rows on every rank, ``shape[0] == p.shape[0]``), whose local part is `mine` (this rank's rows,
    contiguous). For per-row state that is not shaped like its weight (8-bit moments' scales)."""
    from torch.distributed.tensor import DTensor

    if shape[0] != p.shape[0] or mine.shape[0] != local(p).shape[0]:
        raise ValueError(f"{tuple(shape)} state does not have the rows of its {tuple(p.shape)} parameter")
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        mine, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def write_whole_(t: torch.Tensor, new: torch.Tensor) -> None:
    """t <- new, where `new` is the whole tensor, identical on every rank; a DTensor `t` keeps only
    its own shard of it (no communication). Written through `optimizers.writer.written`: one
    rounding of `new` (fp32, or `t`'s dtype) into a weight stored in fewer bits."""
    if hasattr(t, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        new = distribute_tensor(new, t.device_mesh, t.placements, src_data_rank=None).to_local()
    with torch.no_grad(), written(t) as w:
        w.copy_(new)


def _sample(g: torch.Tensor, size: int = 256) -> torch.Tensor:
    """About `size` entries of `g` spread over it (a strided view); `g` itself when it is small
    or not contiguous (a full pass then costs about as much as taking a sample)."""
    n = g.numel()
    if n <= 16 * size or not g.is_contiguous():
        return g
    return g.as_strided((size,), (n // size,))  # one dispatch (a view plus a slice is two)


def nonzero_flags(grads: list[torch.Tensor]) -> list[bool]:
    """[G != 0 anywhere, for G in grads] with one host synchronisation per device (two when
    some large gradient's sample is all zero, as in a checkpoint loader's dummy step).

    Uses ||G||_2 != 0 (a fused multi-tensor norm, several times faster than an inf-norm or
    any() on CPU), first on a strided sample of each large G; inf/nan count as nonzero. A
    gradient whose every entry is below ~1e-19 (squares underflow in fp32) also reads as
    zero, which is harmless.
    """
    flags: list[bool] = [True] * len(grads)
    sharded = [g for g in grads if is_dtensor(g)]
    if sharded:
        # FSDP2: a shard may be zero where the whole gradient is not; decide on the whole one,
        # identically on every rank (the projected step has collectives).
        import torch.distributed as dist

        norms = torch.stack([n.float() for n in torch._foreach_norm([local(g) for g in grads], ord=2)])
        nonzero = norms.ne(0).float()
        dist.all_reduce(nonzero, op=dist.ReduceOp.MAX, group=sharded[0].device_mesh.get_group())
        return [bool(v) for v in nonzero.tolist()]
    by_device: dict[torch.device, list[int]] = {}
    for i, g in enumerate(grads):
        by_device.setdefault(g.device, []).append(i)
    for idx in by_device.values():
        # A strided sample of ~256 entries proves "nonzero" for almost every real gradient of
        # a large matrix at a fraction of a full pass; only a gradient whose sample is all zero
        # gets a full norm. Both answers are exact: a nonzero sample entry is a nonzero entry.
        views = [_sample(grads[i]) for i in idx]
        if len(views) == 1:  # one norm: no list of results to stack
            norms = [float(torch.linalg.vector_norm(views[0], dtype=torch.float32))]
        else:
            norms = torch.stack(torch._foreach_norm(views, ord=2, dtype=torch.float32)).tolist()
        unsure = []
        for i, view, norm in zip(idx, views, norms):
            flags[i] = norm != 0.0  # nan (an inf/nan entry) counts as nonzero
            if not flags[i] and view is not grads[i]:
                unsure.append(i)
        if unsure:
            norms = torch.stack(
                torch._foreach_norm([grads[i] for i in unsure], ord=2, dtype=torch.float32)
            ).tolist()
            for i, norm in zip(unsure, norms):
                flags[i] = norm != 0.0
    return flags

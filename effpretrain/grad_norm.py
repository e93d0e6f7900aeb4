"""The global gradient norm and clipping, the same number in one process, DDP and FSDP2."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, Shard

from optimizers._sharded import local, sum_squares_fp64


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Global gradient norm over all (sharded or plain) gradients, clipped to `max_norm` if > 0.

    The norm is the same number however the gradients are split: every rank sums the squares
    of its own part (a DTensor's local shard, or the whole tensor) in fp64, the sharded partial
    sums are added across ranks (one all-reduce), and only the square root is rounded to fp32.
    fp64 sums of the same terms in another order agree to ~1e-13 relative, far below fp32's
    resolution, so one process, DDP and FSDP2 get the same fp32 norm and clip coefficient (up to
    a tie at an fp32 rounding boundary), and clipping keeps them bitwise equal whenever the
    gradients themselves are (an fp32 norm summed per shard differs in the last bits, which a
    basis or refactorization SVD then amplifies).

    Returns:
        The total norm (before clipping), identical on every rank.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    dev = local(params[0].grad).device
    sharded = torch.zeros((), dtype=torch.float64, device=dev)
    whole = torch.zeros((), dtype=torch.float64, device=dev)
    mesh = None
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(pl, Shard) for pl in g.placements):
            sharded += sum_squares_fp64(g.to_local())
            mesh = g.device_mesh
        else:
            whole += sum_squares_fp64(local(g))
    if mesh is not None:
        import torch.distributed as dist

        dist.all_reduce(sharded, group=mesh.get_group())
    total = (sharded + whole).sqrt().float()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_grad_norm_ rule
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(local(p.grad))
        for dtype, grads in by_dtype.items():
            torch._foreach_mul_(grads, coef.to(dtype))
    return float(total)

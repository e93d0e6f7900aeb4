"""The Adam kernel of the projected methods (and any method with an Adam part): the bias-corrected
normalised update in the reference (Kingma and Ba) or torch convention, fused where torch's fused
Adam kernel takes the tensors, decoupled weight decay, and the moment storage."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from optimizers._sharded import local
from optimizers.writer import written

_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_HAS_FUSED_ADAM = hasattr(torch, "_fused_adam_")  # torch.optim.Adam(fused=True)'s kernel

ADAM_CONVENTIONS: tuple[str, ...] = ("reference", "torch")

# State keys (torch's names where torch has one).
STEP = "step"
"""t, the parameter's own Adam step count (int)."""
EXP_AVG = "exp_avg"
"""M, Adam's first moment."""
EXP_AVG_SQ = "exp_avg_sq"
"""V, Adam's second moment."""


def fusable(m: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether torch's fused Adam kernel can advance these moments: plain (not DTensor or other
    subclass), contiguous tensors of one float dtype and shape on one CPU or CUDA device."""
    return (
        _HAS_FUSED_ADAM
        and type(m) is type(v) is type(x) is torch.Tensor
        and m.dtype == v.dtype == x.dtype in _FUSED_DTYPES
        and x.device.type in ("cpu", "cuda")  # the kernel itself refuses tensors on two devices
        and m.shape == x.shape
        and x.is_contiguous()  # the kernel reads memory in order: it needs contiguous tensors
        and m.is_contiguous()
        and v.is_contiguous()
    )


def adam_update(
    m: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor,
    t: int,
    group: dict[str, Any],
    fused: bool | None = None,
) -> tuple[torch.Tensor, float]:
    """One Adam step of the moments: updates M, V in place with x at step t; returns (N, eta_t).

    M <- beta1 M + (1 - beta1) x;  V <- beta2 V + (1 - beta2) x^2;  then, per the group's
    ``adam_convention``,
    reference: N = M / (sqrt(V) + eps), eta_t = eta sqrt(1 - beta2^t) / (1 - beta1^t);
    torch:     N = M / (sqrt(V / (1 - beta2^t)) + eps), eta_t = eta / (1 - beta1^t).
    (Without bias correction both factors are 1.)

    The fast path is torch's fused Adam kernel (`_fused_normalised`), one pass instead of seven
    element-wise ones; it needs bias correction and `fusable` tensors. The op-by-op path
    (`_unfused_normalised`) computes the same quantities; the two differ by fp32 rounding only.

    Args:
        m: M, updated in place.
        v: V, updated in place.
        x: R (projected) or G (dense), shaped like M.
        t: the step count after this step (>= 1).
        group: the param group (``betas``, ``eps``, ``lr``, ``correct_bias``, ``adam_convention``).
        fused: None takes the fused path wherever it applies; True requires it (ValueError where
            it cannot run); False takes the op-by-op path.
    """
    beta1, beta2 = group["betas"]
    bc1 = 1.0 - beta1**t if group["correct_bias"] else 1.0
    bc2 = 1.0 - beta2**t if group["correct_bias"] else 1.0
    can_fuse = group["correct_bias"] and fusable(m, v, x)
    if fused and not can_fuse:
        raise ValueError(
            "fused Adam needs bias correction and plain contiguous CPU/CUDA tensors of one float "
            f"dtype (got {type(x).__name__} {x.dtype} on {x.device}, correct_bias={group['correct_bias']})"
        )
    if can_fuse if fused is None else fused:
        return _fused_normalised(m, v, x, t, group, bc1, bc2)
    return _unfused_normalised(m, v, x, group, bc1, bc2)


def _unfused_normalised(
    m: torch.Tensor, v: torch.Tensor, x: torch.Tensor, group: dict[str, Any], bc1: float, bc2: float
) -> tuple[torch.Tensor, float]:
    """`adam_update` op by op (any tensors, DTensor shards included); N is written over the
    buffer of sqrt(V), so only one temporary is allocated."""
    beta1, beta2 = group["betas"]
    m.mul_(beta1).add_(x, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(x, x, value=1.0 - beta2)
    denom = v.sqrt()
    if group["adam_convention"] == "torch":
        denom.div_(math.sqrt(bc2)).add_(group["eps"])
        step_size = group["lr"] / bc1
    else:
        denom.add_(group["eps"])
        step_size = group["lr"] * math.sqrt(bc2) / bc1
    return torch.div(m, denom, out=denom), step_size


def _fused_normalised(
    m: torch.Tensor, v: torch.Tensor, x: torch.Tensor, t: int, group: dict[str, Any], bc1: float, bc2: float
) -> tuple[torch.Tensor, float]:
    """`adam_update` (bias-corrected) in one pass of torch's fused Adam kernel.

    The kernel updates M and V as Adam does and then a "parameter" P by
    P <- P - (lr / bc1) M / (sqrt(V) / sqrt(bc2) + eps'). Starting from P = 0 with
    lr = -bc1 / sqrt(bc2) and eps' = eps / sqrt(bc2) leaves P = M / (sqrt(V) + eps) (the
    reference convention's N); lr = -bc1 and eps' = eps leave the torch convention's N. Three
    dispatches (zeros, the step count, the kernel) instead of seven element-wise passes; this
    matters for small low-rank moments, whose step is dominated by per-operation overhead.
    """
    beta1, beta2 = group["betas"]
    norm = torch.zeros_like(m)
    steps = torch.full((), float(t), dtype=torch.float32, device=m.device)
    if group["adam_convention"] == "torch":
        lr, eps, step_size = -bc1, group["eps"], group["lr"] / bc1
    else:
        root = math.sqrt(bc2)
        lr, eps, step_size = -bc1 / root, group["eps"] / root, group["lr"] * root / bc1
    torch._fused_adam_(
        [norm], [x], [m], [v], [], [steps],
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
    )  # fmt: skip
    return norm, step_size


def _decay(p: torch.Tensor, group: dict[str, Any], before: bool) -> None:
    """W <- W (1 - eta lambda) if this is the convention's moment for it (torch: before the update)."""
    lr, wd = group["lr"], group["weight_decay"]
    if group["adam_convention"] == "torch":
        if before and wd != 0.0:
            p.mul_(1.0 - lr * wd)
    elif not before and wd > 0.0:
        p.add_(p, alpha=-lr * wd)  # galore-torch's exact operation


def _check_adam(g: dict[str, Any]) -> None:
    if g["lr"] < 0.0:
        raise ValueError(f"Invalid learning rate: {g['lr']} - should be >= 0.0")
    b1, b2 = g["betas"]
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"Invalid betas {g['betas']}: each must be in [0.0, 1.0)")
    if g["eps"] < 0.0:
        raise ValueError(f"Invalid epsilon value: {g['eps']} - should be >= 0.0")
    if g["adam_convention"] not in ADAM_CONVENTIONS:
        raise ValueError(f"adam_convention must be one of {ADAM_CONVENTIONS}, got {g['adam_convention']!r}")


# ---------------------------------------------------------------------- moment storage


class AdamMoments:
    """Moment storage: where a parameter's M and V live and how one Adam step advances them.

    This one keeps ``exp_avg`` and ``exp_avg_sq`` in the parameter dtype (2 s L bytes for L
    entries each, s the itemsize) and advances them with `adam_update`. A method with another
    storage (GaLore-8bit's quantised blocks) subclasses it and names its class in
    `ProjectedAdam.MOMENTS`.

    Args:
        fused: `adam_update`'s ``fused`` (None: the fused kernel wherever it applies).
    """

    ELEMENTWISE: ClassVar[bool] = True
    """Under FSDP2, non-projected weights step shard by shard (element-wise moments). Storage
    whose moments are not element-wise sets False: such weights then step on the whole tensor."""

    def __init__(self, fused: bool | None = None) -> None:
        self.fused = fused

    def init(
        self, state: dict[str, Any], p: torch.Tensor, shape: tuple[int, ...] | None, group: dict[str, Any]
    ) -> None:
        """Allocates zero M and V of `shape`, or, for None, shaped like `p` itself (an FSDP2 shard
        stays a shard)."""
        for key in (EXP_AVG, EXP_AVG_SQ):
            if shape is None:
                state[key] = torch.zeros_like(p)
            else:
                state[key] = torch.zeros(shape, dtype=p.dtype, device=p.device)

    @classmethod
    def steps_shards(cls, shape: tuple[int, ...]) -> bool:
        """Whether a non-projected weight of `shape` steps its FSDP2 row shards on each rank (its
        moments sharded like it, the same numbers as the whole step) rather than whole on an owner
        rank: any weight for element-wise moments."""
        return cls.ELEMENTWISE

    def adopt_whole(self, state: dict[str, Any], p: torch.Tensor) -> None:
        """Makes moments loaded whole for FSDP2-sharded `p`, which `steps_shards`, this rank's rows
        (a checkpoint written while such a weight stepped whole on an owner rank). Element-wise
        moments were always saved sharded: nothing to do."""

    @classmethod
    def part_nbytes(cls, numel: int, part: int, dtype: torch.dtype, group: dict[str, Any]) -> int:
        """Bytes of the moments a rank holds for `part` entries of a `numel`-entry weight that
        `steps_shards` (its row shard)."""
        return cls.nbytes(part, dtype, group)

    def update(
        self, state: dict[str, Any], x: torch.Tensor, group: dict[str, Any]
    ) -> tuple[torch.Tensor, float]:
        """Advances M and V with x at step ``state[STEP]`` (already counted); returns (N, eta_t).
        FSDP2-sharded (DTensor) moments advance as their local shards."""
        return adam_update(
            local(state[EXP_AVG]), local(state[EXP_AVG_SQ]), local(x), state[STEP], group, self.fused
        )

    @classmethod
    def nbytes(
        cls, numel: int, dtype: torch.dtype, group: dict[str, Any], shape: tuple[int, ...] | None = None
    ) -> int:
        """Bytes of M and V holding `numel` entries each: 2 numel s (s = itemsize). `shape`, the
        moments' shape, is for storage whose scales follow it (4-bit rank-1 V)."""
        return 2 * numel * dtype.itemsize


def adamw_step_(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    lr_mult: float = 1.0,
) -> None:
    """One decoupled-weight-decay Adam step in place, in the exact operation order of
    torch.optim.AdamW's single-tensor path (decay first, lerp for m, eps added after the
    bias-corrected sqrt), so that it is bitwise torch's; `step` is the already advanced count t.
    `lr_mult` scales the Adam step only, not the decay (Stable-SPAM's)."""
    with written(p) as w:  # one rounding for a weight stored in fewer bits (`optimizers.writer`)
        w.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        if lr_mult != 1.0:
            step_size = step_size * lr_mult
        denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
        w.addcdiv_(exp_avg, denom, value=-step_size)

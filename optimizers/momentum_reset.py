"""In-place optimizer state surgery: momentum reset and magnitude pruning of moments.

**Momentum reset** (Glentis et al. 2025, "restarts"; Stable-SPAM resets every 500 steps): zero
Adam's first and second moments m, v and restart the step counter t, so that the next update is
that of a freshly built optimizer,

    t <- 0,  m <- 0,  v <- 0   =>   next step: t = 1, m = (1 - beta1) g, v = (1 - beta2) g^2,

including the restarted bias correction 1 - beta^t. The benchmark rebuilds the whole optimizer;
zeroing in place is equivalent for Adam-family state and keeps every tensor (and its memory,
device placement and any FSDP sharding) where it is.

**Magnitude pruning** (ReLoRA, Lialin et al. 2023): instead of zeroing, keep only the largest
(1 - ratio) fraction of each moment tensor's entries by magnitude (ReLoRA uses ratio 0.999 for the
LoRA factors at each merge) and leave the step counter alone.

Works on any optimizer whose state uses torch's names: torch.optim.Adam/AdamW (`step` is a float
tensor, zeroed in place; `max_exp_avg_sq` with amsgrad) and this package's optimizers (`step` is a
python int, set to 0; projection optimizers keep low-rank `exp_avg`/`exp_avg_sq`); a class whose
moments live under other names declares them in ``RESET_KEYS`` (`reset_keys`): Muon's
``momentum_buffer``, and the 8-bit optimizers' codes with their per-block scales, zeroed together
(code 0 of the signed map is -0.99, so zeroed codes under a kept scale would not read 0). Entries not named
in `keys` (projection `basis`, `seed`, `refresh` counters, ...) are never touched, so an optimizer
whose basis-refresh schedule must survive a reset has to count it in its own key, not in `step`.
Accepts wrappers that hold the real optimizer in `.optimizer` (Accelerate's AcceleratedOptimizer,
optimizers.restarts.Restarts).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["MOMENT_KEYS", "RESET_KEYS", "prune_", "reset_", "reset_keys", "unwrap_optimizer"]

# Adam-family moment tensors under torch's names (max_exp_avg_sq: AMSGrad's running max of v).
MOMENT_KEYS: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
RESET_KEYS: tuple[str, ...] = ("step", *MOMENT_KEYS)


def reset_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The state keys whose zeroing is `optimizer`'s momentum reset: its class's ``RESET_KEYS``
    where it declares one (state under other names: Muon's ``momentum_buffer``, the 8-bit
    moments' codes with their scales, zeroed together so that they read exactly 0), else torch's
    Adam names (`RESET_KEYS`)."""
    return tuple(getattr(type(unwrap_optimizer(optimizer)), "RESET_KEYS", RESET_KEYS))


def unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Follows `.optimizer` links (Accelerate, Restarts, ...) to the optimizer that owns `state`."""
    seen = set()
    while (
        isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and id(optimizer) not in seen
    ):
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    return optimizer


def _selected_states(optimizer: torch.optim.Optimizer, params: Iterable[Tensor] | None) -> list[dict]:
    inner = unwrap_optimizer(optimizer)
    if params is None:
        return [inner.state[p] for g in inner.param_groups for p in g["params"] if p in inner.state]
    managed = {id(p) for g in inner.param_groups for p in g["params"]}
    out = []
    for p in params:
        if id(p) not in managed:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is not managed by this optimizer")
        # No entry yet means the optimizer never stepped it: nothing to reset.
        if p in inner.state:
            out.append(inner.state[p])
    return out


@torch.no_grad()
def reset_(
    optimizer: torch.optim.Optimizer,
    params: Iterable[Tensor] | None = None,
    keys: Sequence[str] | None = None,
) -> int:
    """Zeroes the named state entries of `params` in place (momentum reset).

    Tensors are zeroed with `zero_()` (same object, dtype and device; torch's float `step` tensor
    included); python numbers are set to 0. Entries not in `keys` are left exactly as they are.

    Args:
        optimizer: a torch.optim.Optimizer, or a wrapper with the real one in `.optimizer`.
        params: the parameters whose state to reset; all of the optimizer's by default. Parameters
            without state yet (never stepped) are skipped.
        keys: state keys to reset; None: the optimizer's own (`reset_keys`: torch's Adam/AdamW with
            amsgrad and this package's Adam-style optimizers ``("step", "exp_avg", "exp_avg_sq",
            "max_exp_avg_sq")``, plus what a class declares in ``RESET_KEYS``).

    Returns:
        The number of state entries reset (tensors zeroed plus integer counters set to 0).

    Raises:
        ValueError: if a given parameter is not in any of the optimizer's param groups.
    """
    keys = reset_keys(optimizer) if keys is None else keys
    count = 0
    for st in _selected_states(optimizer, params):
        for key in keys:
            if key not in st:
                continue
            value = st[key]
            if torch.is_tensor(value):
                value.zero_()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                st[key] = type(value)(0)
            else:
                raise TypeError(f"cannot reset state entry {key!r} of type {type(value).__name__}")
            count += 1
    return count


@torch.no_grad()
def prune_(
    optimizer: torch.optim.Optimizer,
    ratio: float,
    params: Iterable[Tensor] | None = None,
    keys: Sequence[str] = MOMENT_KEYS,
) -> int:
    """Zeroes, per tensor, the `ratio` fraction of entries with the smallest magnitude, in place.

    For each selected state tensor x with N entries, the floor(ratio * N) smallest |x_i| are set to
    0 and the largest N - floor(ratio * N) are kept exactly (ties broken by `topk`). The step
    counter is not touched (ReLoRA keeps it). ratio = 0 is a no-op, ratio = 1 zeroes everything.

    Args:
        optimizer: a torch.optim.Optimizer, or a wrapper with the real one in `.optimizer`.
        ratio: fraction to prune, in [0, 1] (ReLoRA: 0.999).
        params: parameters whose state to prune; all by default.
        keys: which state tensors to prune; default ``("exp_avg", "exp_avg_sq", "max_exp_avg_sq")``.

    Returns:
        The number of state tensors pruned.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"prune ratio must be in [0, 1], got {ratio}")
    selected = [
        (key, st[key])
        for st in _selected_states(optimizer, params)
        for key in keys
        if torch.is_tensor(st.get(key)) and st[key].numel()
    ]
    for key, value in selected:  # refused before anything is pruned
        if not value.is_floating_point():
            raise TypeError(
                f"cannot prune {key!r}: {value.dtype} codes (quantised moments) have no magnitude order"
            )
    for _, value in selected:
        numel = value.numel()
        # The epsilon keeps e.g. 0.999 * 1000 from flooring to 998.
        n_keep = numel - math.floor(ratio * numel + 1e-9)
        if n_keep < numel:
            keep = torch.zeros(numel, dtype=torch.bool, device=value.device)
            if n_keep > 0:
                keep[value.reshape(-1).abs().topk(n_keep, sorted=False).indices] = True
            value.masked_fill_(~keep.view(value.shape), 0)
    return len(selected)

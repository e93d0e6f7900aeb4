"""Optimizers for memory-efficient pretraining: pure PyTorch, usable in any training loop.

`OPTIMIZERS` maps a method name to ``"module:Class"``; classes are imported on first use so
that ``import optimizers`` stays cheap and an optional backend (bitsandbytes) is only needed
by the methods that use it. `build_optimizer` is the one constructor the toolkit calls.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch

from optimizers.momentum_reset import reset_
from optimizers.refactorization import refactorize_
from optimizers.restarts import Restarts, recovery_factor

OPTIMIZERS: dict[str, str] = {
    "adamw": "torch.optim:AdamW",
    "galore": "optimizers.galore:GaLoreAdamW",
    "fira": "optimizers.fira:FiraAdamW",
    "apollo": "optimizers.apollo:APOLLOAdamW",
    "apollo_mini": "optimizers.apollo:APOLLOMini",
    "stable_spam": "optimizers.stable_spam:StableSPAM",
    "spam": "optimizers.stable_spam:SPAM",
    "galore_8bit": "optimizers.galore_8bit:GaLoreAdamW8bit",
    "adamw_8bit": "optimizers.adamw_8bit:AdamW8bit",
}

# Methods that project some groups: their groups carry `rank` and friends.
PROJECTED = frozenset({"galore", "fira", "apollo", "apollo_mini", "galore_8bit"})

# Under FSDP2 these keep ALL their state whole on every rank (block-wise 8-bit moments are stepped
# on the gathered tensor; see AdamW8bit.step and ProjectedAdam.SHARDED_DENSE). Every other method
# shards its full-size state with the parameter; projected methods keep their low-rank state whole.
FSDP2_WHOLE_STATE = frozenset({"adamw_8bit", "galore_8bit"})


def get_optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """Returns the class registered under `name`; ValueError naming the choices otherwise."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(sorted(OPTIMIZERS))}")
    module, cls = OPTIMIZERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_optimizer(
    name: str, param_groups: Iterable[dict[str, Any]], **kwargs: Any
) -> torch.optim.Optimizer:
    """Constructs optimizer `name` over `param_groups` (torch format) with defaults `kwargs`.

    For torch's AdamW the multi-tensor (foreach) path is used, which is its fastest CPU/GPU
    path that is also deterministic.
    """
    cls = get_optimizer_class(name)
    if name == "adamw":
        kwargs.setdefault("foreach", True)
    return cls(list(param_groups), **kwargs)


def state_bytes(name: str, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
    """Exact bytes of optimizer state one parameter of `shape`/`dtype` holds under method `name`.

    torch's AdamW keeps exp_avg and exp_avg_sq in the parameter dtype and `step` as a float32
    scalar tensor: 2 * numel * itemsize + 4. Our own classes carry a `state_bytes` classmethod
    with their formula (see each docstring).
    """
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if name == "adamw":
        return 2 * numel * itemsize + 4
    return int(get_optimizer_class(name).state_bytes(tuple(shape), group, dtype))


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Sums numel * element_size over every tensor held in `optimizer.state`, on this process.

    A sharded (FSDP2 DTensor) state tensor counts its local shard only: the bytes this rank holds.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed support
        DTensor = ()  # noqa: N806
    inner = getattr(optimizer, "optimizer", optimizer)
    total = 0
    for st in inner.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                if isinstance(v, DTensor):
                    v = v.to_local()
                total += v.numel() * v.element_size()
    return total


__all__ = [
    "OPTIMIZERS",
    "FSDP2_WHOLE_STATE",
    "PROJECTED",
    "Restarts",
    "recovery_factor",
    "refactorize_",
    "reset_",
    "build_optimizer",
    "get_optimizer_class",
    "measured_state_bytes",
    "state_bytes",
]

"""Which optimizer the factory built with which config and in-backward engine (weak maps), and what an optimizer chain holds."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

import optimizers
from effpretrain.config import (
    RunConfig,
)
from effpretrain.in_backward import InBackward
from optimizers.momentum_reset import unwrap_optimizer
from optimizers.restarts import Restarts

# The RunConfig behind each optimizer create_optimizer returned: lets the callback see which method
# and settings it is tracking (and whether restarts are already handled) without tagging the object.
_CONFIGS: weakref.WeakKeyDictionary[torch.optim.Optimizer, RunConfig] = weakref.WeakKeyDictionary()
# The in-backward engine of each optimizer create_optimizer(update_in_backward=True) returned. The
# engine is kept alive by its hooks on the model's parameters; a weak reference here keeps the
# engine (which holds the optimizer) from holding its own key alive.
_ENGINES: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[InBackward]] = (
    weakref.WeakKeyDictionary()
)
# Engines a callback drives (marks micro-batches, finishes steps): the optimizer refuses to step
# for any other, as the Trainer's step would then silently run on whole gradients.
_DRIVEN: weakref.WeakSet[InBackward] = weakref.WeakSet()
# Models `prepare_trainer` had Accelerate prepare without a DDP wrapper: under several processes
# the callback averages their gradients in the in-backward hooks, and refuses any other model.
_UNWRAPPED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

log = logging.getLogger(__name__)


# Looking through optimizer wrappers (Accelerate's AcceleratedOptimizer, Restarts)


def _chain(optimizer: Any) -> list[torch.optim.Optimizer]:
    out: list[torch.optim.Optimizer] = []
    while isinstance(optimizer, torch.optim.Optimizer) and all(o is not optimizer for o in out):
        out.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return out


def _find_restarts(optimizer: Any) -> Restarts | None:
    return next((o for o in _chain(optimizer) if isinstance(o, Restarts)), None)


def _engine_of(optimizer: Any) -> InBackward | None:
    ref = next((_ENGINES[o] for o in _chain(optimizer) if o in _ENGINES), None)
    return ref() if ref is not None else None


def _config_of(optimizer: Any) -> RunConfig | None:
    return next((_CONFIGS[o] for o in _chain(optimizer) if o in _CONFIGS), None)


def _method_of(optimizer: Any) -> str | None:
    """The registry name of the optimizer that owns the state, if it is a registered class."""
    cfg = _config_of(optimizer)
    if cfg is not None:
        return cfg.optim.name
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    cls = type(unwrap_optimizer(optimizer))
    # Compared by name first, so that no other registered class (or its backend) is imported.
    return next(
        (n for n, s in optimizers.METHODS.items() if s.class_name == cls.__name__ and s.cls is cls), None
    )

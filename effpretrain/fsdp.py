"""FSDP2 (torch's `fully_shard`) for the trainer: sharding and its check.

Accelerate's FSDP plugin silently falls back to DDP on CPU, so the trainer applies torch's own
`torch.distributed.fsdp.fully_shard` itself (each decoder layer, then the root) and checks that
it got real sharding: every parameter becomes a DTensor sharded on dim 0 across the ranks
(uneven sizes are padded by torch, `torch.chunk` semantics). Forward and backward all-gather a
layer's parameters, backward reduce-scatters (averages) its gradients, and the optimizer steps
on the local shards, so element-wise optimizers (AdamW, the factorized methods) need no change.
With ``train.update_in_backward`` FSDP2 itself runs each sharded parameter's post-accumulate-grad
hook right after its reduce-scatter, and the trainer reduce-scatters every micro-step
(`effpretrain.in_backward`, "Several processes"). Its checkpoints are sharded
(`effpretrain.checkpoint.sharded`); its gradient norm is `effpretrain.grad_norm`'s.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from effpretrain.errors import ConfigError


def apply_fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    """Shards `model` in place with `fully_shard`: every decoder layer, then the root; returns it."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(f"dist.sharding=fsdp2: {type(model).__name__} has no model.layers to shard")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    check_sharded(model)
    return model


def check_sharded(model: torch.nn.Module) -> None:
    """ConfigError unless every parameter is a DTensor with a Shard placement (real sharding)."""
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) or not any(isinstance(pl, Shard) for pl in p.placements):
            got = type(p).__name__ if not isinstance(p, DTensor) else f"DTensor{tuple(p.placements)}"
            raise ConfigError(f"dist.sharding=fsdp2 asked for but parameter {name} is not sharded ({got})")

"""FSDP2 (torch's `fully_shard`) for the trainer: sharding and its check.

Accelerate's FSDP plugin silently falls back to DDP on CPU, so the trainer applies torch's own
`torch.distributed.fsdp.fully_shard` itself (each decoder layer, the embedding and the LM head of
an untied model, then the root) and checks that
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
    """Shards `model` in place with `fully_shard`: every decoder layer, the embedding and the head
    (`edge_units`), then the root; returns it."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(f"dist.sharding=fsdp2: {type(model).__name__} has no model.layers to shard")
    for layer in layers:
        fully_shard(layer)
    for unit in edge_units(model):
        fully_shard(unit)
    fully_shard(model)
    check_sharded(model)
    return model


def edge_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The input embedding and the LM head, each an FSDP2 unit of its own, so that each is gathered
    only for its own forward and backward (torchtitan shards them so) instead of through the whole
    step as part of the root; none for a tied model (one matrix: the root holds it)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is None or head is None or head.weight is emb.weight:
        return []
    return [emb, head]


def check_sharded(model: torch.nn.Module) -> None:
    """ConfigError unless every parameter is a DTensor with a Shard placement (real sharding)."""
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) or not any(isinstance(pl, Shard) for pl in p.placements):
            got = type(p).__name__ if not isinstance(p, DTensor) else f"DTensor{tuple(p.placements)}"
            raise ConfigError(f"dist.sharding=fsdp2 asked for but parameter {name} is not sharded ({got})")

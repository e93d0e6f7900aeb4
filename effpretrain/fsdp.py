"""FSDP2 (torch's `fully_shard`) for the trainer: sharding, gradient norms, full-state checkpoints.

Accelerate's FSDP plugin silently falls back to DDP on CPU, so the trainer applies torch's own
`torch.distributed.fsdp.fully_shard` itself (each decoder layer, then the root) and checks that
it got real sharding: every parameter becomes a DTensor sharded on dim 0 across the ranks
(uneven sizes are padded by torch, `torch.chunk` semantics). Forward and backward all-gather a
layer's parameters, backward reduce-scatters (averages) its gradients, and the optimizer steps
on the local shards, so element-wise optimizers (AdamW, the factorized methods) need no change.

Checkpoints gather a *full* state to rank 0 (`get_model_state_dict(full_state_dict=True,
cpu_offload=True)`, and every sharded optimizer state tensor through `DTensor.full_tensor()`) and
write the same files as a DDP or single-process run; every rank reads them back on resume and
keeps its own shard (`set_model_state_dict(full_state_dict=True)`, `distribute_tensor` for the
optimizer). This costs one full model + optimizer state in rank 0's CPU memory while saving, in
exchange for one checkpoint format for every launch mode; torch.distributed.checkpoint (one file
per rank) would avoid that peak at 1B+ scale and is the upgrade path.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from effpretrain.config import ConfigError


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


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (its shard for a DTensor, `t` itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor; `t` itself otherwise)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(value: torch.Tensor, ref: DTensor) -> DTensor:
    """`value` (the full tensor, identical on every rank) as a DTensor laid out like `ref`.

    Each rank keeps its own chunk of its own copy (no communication, `src_data_rank=None`).
    """
    return distribute_tensor(value.to(ref.device), ref.device_mesh, ref.placements, src_data_rank=None)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Global gradient norm over all (sharded or plain) gradients, clipped to `max_norm` if > 0.

    For DTensor gradients the per-shard norms are combined across ranks (`full_tensor()` of
    the partial total), so the returned norm and the clip coefficient are those of the whole
    model, identical on every rank.
    """
    params = [p for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    total = full(total)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model state dict on rank 0 (CPU), empty on the other ranks (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> tuple[list, list]:
    """Loads a full state dict (present on every rank) into the sharded model; (missing, unexpected)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    res = set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    return list(res.missing_keys), list(res.unexpected_keys)


def full_optimizer_state(opt: torch.optim.Optimizer) -> tuple[dict[str, Any], list[list[Any]]]:
    """`opt.state_dict()` with every DTensor state entry gathered to a full CPU tensor.

    Returns the state dict (torch's id-keyed format, as a single process saves it) and the
    [param id, key] pairs that were sharded, which `load_full_optimizer_state` needs to shard
    them again. A collective: every rank calls it and gets the same result.
    """
    sd = dict(opt.state_dict())
    sharded: list[list[Any]] = []
    state = {}
    for pid, st in sd["state"].items():
        new = {}
        for k, v in st.items():  # never mutate `st`: it is the live optimizer state
            if isinstance(v, DTensor):
                new[k] = v.full_tensor().cpu()
                sharded.append([pid, k])
            else:
                new[k] = v
        state[pid] = new
    sd["state"] = state
    return sd, sharded


def load_full_optimizer_state(
    opt: torch.optim.Optimizer, sd: dict[str, Any], sharded: list[list[Any]]
) -> None:
    """Loads a `full_optimizer_state` dict: entries listed in `sharded` become shards of their param."""
    params = [p for g in opt.param_groups for p in g["params"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    if len(ids) != len(params):
        raise ValueError(f"{len(ids)} parameters in the saved optimizer, {len(params)} in this one")
    by_id = dict(zip(ids, params))
    sd = dict(sd)
    sd["state"] = {pid: dict(st) for pid, st in sd["state"].items()}
    for pid, k in sharded:
        p = by_id[pid]
        if not isinstance(p, DTensor):
            raise ValueError(f"state {k!r} of parameter {pid} was sharded but the parameter is not")
        sd["state"][pid][k] = shard_like(sd["state"][pid][k], p)
    opt.load_state_dict(sd)

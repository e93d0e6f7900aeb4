"""`train.weight_quant: int8`: the target linear layers' weights stored as INT8 codes with per-group
scales (`optimizers.int8.Int8Weight`), dequantized for each matmul, updated through the one writer
with stochastic rounding (`optimizers.writer`).

Which weights: the ``weight`` of every `torch.nn.Linear` named in ``optim.targets`` (by default the
attention and MLP projections of every decoder layer) that is still a plain linear layer after any
factorization (a factorized layer's factors stay in the run's precision). The embedding, the head
and the norms stay in the run's precision. Each weight is quantized once, to nearest, right after
it is initialised in the run's precision and placed on its device.

State dicts hold plain tensors: a quantized ``<prefix>weight`` is saved as ``<prefix>weight_int8``
(the int8 codes) and ``<prefix>weight_scale`` (the fp32 scales), and loading puts them back into
the layer's `Int8Weight` exactly (module state-dict hooks), so checkpoints, sharded ones included,
resume bitwise. `dequantized_state` turns such a state dict back into plain ``weight``s (export).

Bytes per quantized (m, n) weight: ``m n + 4 m ceil(n / g)`` (g = `train.weight_quant_group`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from effpretrain.models.factorized import FactorizedLinear
from optimizers import rounding
from optimizers._sharded import row_sharded_like
from optimizers.int8 import Int8Weight

__all__ = [
    "CODES_SUFFIX",
    "SCALE_SUFFIX",
    "dequantized_state",
    "quantize_linear_",
    "quantize_weights_",
    "quantized_weights",
]

CODES_SUFFIX, SCALE_SUFFIX = "weight_int8", "weight_scale"


def _state_dict_hook(module: torch.nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    w = state.pop(prefix + "weight", None)
    if w is None:
        return
    inner = w._local_tensor if hasattr(w, "_local_tensor") else w
    if not isinstance(inner, Int8Weight):
        state[prefix + "weight"] = w
        return
    if hasattr(w, "to_local"):  # an FSDP2 DTensor of an Int8Weight shard: sharded by rows like it
        m, n = w.shape
        state[prefix + CODES_SUFFIX] = row_sharded_like(w, inner.codes, (m, n))
        state[prefix + SCALE_SUFFIX] = row_sharded_like(w, inner.scales, (m, inner.scales.shape[1]))
    else:
        state[prefix + CODES_SUFFIX], state[prefix + SCALE_SUFFIX] = inner.codes, inner.scales


def _load_pre_hook(
    module: torch.nn.Module,
    state: dict,
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing: list,
    unexpected: list,
    errors: list,
) -> None:
    codes, scales = state.pop(prefix + CODES_SUFFIX, None), state.pop(prefix + SCALE_SUFFIX, None)
    if codes is None and scales is None:
        return
    w = module.weight
    inner = w._local_tensor if hasattr(w, "_local_tensor") else w
    if codes is None or scales is None or not isinstance(inner, Int8Weight):
        errors.append(
            f"{prefix}weight: INT8 codes and scales must load into an INT8 weight, and come together"
        )
        return
    codes = codes.to_local() if hasattr(codes, "to_local") else codes
    scales = scales.to_local() if hasattr(scales, "to_local") else scales
    if codes.shape != inner.codes.shape or scales.shape != inner.scales.shape:
        errors.append(
            f"size mismatch for {prefix}{CODES_SUFFIX}: checkpoint {tuple(codes.shape)}, {tuple(scales.shape)}; "
            f"model {tuple(inner.codes.shape)}, {tuple(inner.scales.shape)}"
        )
        return
    with torch.no_grad():
        inner.codes.copy_(codes)
        inner.scales.copy_(scales)
    state[prefix + "weight"] = w  # loads as itself (a no-op copy), so strict loading sees it


def quantize_linear_(module: torch.nn.Module, group: int) -> None:
    """Replaces `module`'s weight by its `Int8Weight` (to nearest; same dtype, device and
    requires_grad) and installs the state-dict hooks."""
    w = module.weight
    if not isinstance(w, Int8Weight):
        q = Int8Weight.quantize(w.detach(), group, dtype=w.dtype)
        module.weight = torch.nn.Parameter(q, requires_grad=w.requires_grad)
    if not getattr(module, "_effpretrain_int8_hooks", False):
        module._register_state_dict_hook(_state_dict_hook)
        module._register_load_state_dict_pre_hook(_load_pre_hook, with_module=True)
        module._effpretrain_int8_hooks = True


def quantize_weights_(
    model: torch.nn.Module,
    targets: Iterable[str],
    group: int,
    where: Callable[[str], bool] | None = None,
    embeddings: bool = False,
) -> int:
    """Quantizes the weight of every plain `torch.nn.Linear` of `model` whose attribute name is
    in `targets` (and, with `where`, whose module name it accepts), and with `embeddings` the
    input embedding and the head (one weight when they are tied); returns how many."""
    targets, n = set(targets), 0
    edges, tied = set(), False
    if embeddings:
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        edges, tied = {id(embed), id(head)}, head is not None and head.weight is embed.weight
    for name, module in model.named_modules():
        edge = id(module) in edges
        if tied and module is head:
            continue
        if not edge and (type(module) is not torch.nn.Linear or isinstance(module, FactorizedLinear)):
            continue
        if edge or (name.rsplit(".", 1)[-1] in targets and (where is None or where(name))):
            if not isinstance(module.weight, Int8Weight):
                quantize_linear_(module, group)
                n += 1
    if tied:  # the head is the embedding's matrix: the same INT8 weight (stored once)
        head.weight = embed.weight
        quantize_linear_(head, group)
    return n


def quantized_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of `model`'s INT8 weights."""
    out = []
    for name, p in model.named_parameters():
        inner = p._local_tensor if hasattr(p, "_local_tensor") else p
        if isinstance(inner, Int8Weight):
            out.append((name, p))
    return out


def dequantized_state(
    state: dict[str, torch.Tensor], group: int, dtype: torch.dtype | None = None
) -> Iterable[tuple[str, torch.Tensor]]:
    """(key, tensor) of `state` with every ``weight_int8`` / ``weight_scale`` pair turned into its
    ``weight`` (fp32, or `dtype`), one tensor at a time (for streaming exports)."""
    for k, v in state.items():
        if k.endswith(SCALE_SUFFIX):
            continue
        if k.endswith(CODES_SUFFIX):
            base = k[: -len(CODES_SUFFIX)]
            w = rounding.dequantize_int8(v, state[base + SCALE_SUFFIX], group)
            yield base + "weight", w if dtype is None else w.to(dtype)
        else:
            yield k, v

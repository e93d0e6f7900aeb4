"""Loading a checkpoint's weights into a model: an exact match or a one-line error."""

from __future__ import annotations

from pathlib import Path

import torch

from effpretrain.errors import ConfigError


def tied_aliases(state: dict[str, torch.Tensor]) -> set[str]:
    """The keys of `state` that name a tensor an earlier key already holds (tied input and output
    embeddings: ``lm_head.weight`` is ``model.embed_tokens.weight``)."""
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    aliases = set()
    for k, v in state.items():
        v = v.to_local() if hasattr(v, "to_local") else v  # an FSDP2 shard: its local part
        if v.device.type == "meta" or v.numel() == 0:
            continue
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key in seen:
            aliases.add(k)
        else:
            seen[key] = k
    return aliases


def without_aliases(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with each tied tensor once, under its first key (what a checkpoint stores)."""
    aliases = tied_aliases(state)
    return {k: v for k, v in state.items() if k not in aliases}


def load_model_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str | Path) -> None:
    """Loads a checkpoint's model state dict into `model`, requiring an exact match.

    Every parameter and persistent buffer of `model` must be in `weights` with its shape, and
    nothing else may be, except the model's non-persistent buffers (rotary ``inv_freq``), which
    are rebuilt rather than loaded, and a tied alias (``lm_head.weight`` of a model whose head is
    its embedding), which loads with the key it is tied to. Otherwise a one-line ConfigError naming `source` (the
    checkpoint) and the first offending keys.
    """
    non_persistent = {
        f"{name}.{b}" if name else b
        for name, m in model.named_modules()
        for b in m._non_persistent_buffers_set
    }
    try:
        missing, unexpected = model.load_state_dict(
            {k: v for k, v in weights.items() if k not in non_persistent}, strict=False
        )
    except RuntimeError as e:  # a shape mismatch: torch lists each one on its own line
        detail = next((ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()), type(e).__name__)
        raise ConfigError(f"checkpoint {source} does not match the model ({detail[:200]})") from None
    aliases = tied_aliases(model.state_dict())
    missing = [k for k in missing if k not in aliases]
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint {source} does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )

"""The model a run trains, from its config: the LLaMA preset, seeded, plus factorization surgery."""

from __future__ import annotations

from typing import Any

import torch

from effpretrain.config import RunConfig
from effpretrain.errors import ConfigError
from effpretrain.models import build_model


def build_run_model(cfg: RunConfig, vocab_size: int) -> tuple[torch.nn.Module, dict[str, Any] | None]:
    """The fp32 model a run trains: the preset, seeded, plus factorization surgery if configured.

    Returns:
        The model and the surgery's report (None without a factorization).

    Raises:
        ConfigError: `data.seq_len` exceeds the positions, or the factorization rejects its options.
    """
    max_pos = cfg.model.max_position_embeddings or cfg.data.seq_len
    if cfg.data.seq_len > max_pos:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_position_embeddings={max_pos}")
    model = build_model(cfg.model.preset, vocab_size, max_pos, seed=cfg.train.seed)
    report = None
    if cfg.factor.kind != "none":
        from effpretrain.models import apply_factorization

        try:
            report = apply_factorization(
                model,
                cfg.factor.kind,
                cfg.factor.rank,
                cfg.factor.alpha,
                targets=tuple(cfg.factor.targets),
                density=cfg.factor.density,
                seed=cfg.factor.seed,
            )
        except ValueError as e:
            raise ConfigError(f"factor: {e}") from None
    return model, report

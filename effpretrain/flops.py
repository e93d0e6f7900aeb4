"""Analytic training FLOPs per token of a preset's matrix multiplies (the leaderboard's column)."""

from __future__ import annotations

from collections.abc import Sequence

from effpretrain.config import ATTN_MLP_TARGETS
from effpretrain.memory import model_param_shapes
from effpretrain.models.factorized import factor_spec
from effpretrain.models.llama import PRESETS


def flops_per_token(
    preset: str,
    vocab_size: int,
    seq_len: int,
    factor_kind: str = "none",
    factor_rank: int = 128,
    *,
    factor_targets: Sequence[str] | None = None,
    tokens_per_step: int | None = None,
) -> float:
    """Training FLOPs per token (forward + backward) of a preset's matrix multiplies.

    Counted per token, 2 FLOPs per multiply-add:

    - a trainable dense m x n linear: 6 m n (forward 2 m n, input gradient 2 m n, weight
      gradient 2 m n); the lm_head likewise 6 V h; the embedding lookup 0;
    - attention scores and the weighted sum of values: 12 L h T per token for sequence length T
      (PaLM's count; the causal mask is not exploited);
    - a factorized target (`factor_kind`, on the linears named in `factor_targets`): its
      `FactorSpec.flops_per_token` (Low-Rank 6 r (m + n); a frozen W0 adds 4 m n; SLTrain as
      implemented 6 m n plus the once-per-step B A product and its backward, 6 m n r, spread over
      `tokens_per_step` when given); the sparse scatter is not counted.

    Norms, activations, softmax, the loss and the optimizer (including basis refreshes) are not
    counted: the optimizer's cost is reported as time instead.

    Raises:
        ValueError: `factor_kind` is neither ``"none"`` nor a registered factor kind.
    """
    spec = factor_spec(factor_kind) if factor_kind != "none" else None
    targets = set(factor_targets or ATTN_MLP_TARGETS)
    p = PRESETS[preset]
    total = 12.0 * p.layers * p.hidden * seq_len
    for s in model_param_shapes(preset, vocab_size):
        if s.linear is None:  # norms, and the embedding (a lookup)
            continue
        m, n = s.shape
        if spec is not None and s.linear in targets:
            total += spec.flops_per_token(m, n, factor_rank, tokens_per_step)
        else:
            total += 6 * m * n
    return total

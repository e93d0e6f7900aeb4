"""The training objective: summed next-token cross-entropy and its target count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from effpretrain.data import IGNORE_INDEX


def token_loss_sum(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], packed: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token cross-entropies over the batch's targets (fp32), and their count.

    With logits z and targets y_{t+1} (positions whose label is IGNORE_INDEX left out), the sum is
    S = sum_t -log softmax(z_t)[y_{t+1}]; the trainer divides the global S by the global count.
    The count is a tensor, so that no device sync is forced.

    Args:
        model: a causal LM returning `.logits`.
        batch: `input_ids`, `attention_mask` and `labels` of shape (B, T).
        packed: every position is real, so SDPA takes its causal fast path without a mask; None
            checks the mask, which costs a device sync on GPU.
    """
    mask = batch["attention_mask"]
    if packed is None:
        packed = bool(mask.all())
    attn = None if packed else mask
    logits = model(input_ids=batch["input_ids"], attention_mask=attn).logits
    # Shift the labels, not the logits: a sliced (B, T-1, V) view would cost a full copy of the logits.
    labels = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss, (labels != IGNORE_INDEX).sum()

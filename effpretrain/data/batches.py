"""A step's micro-batches from the stream, split over the micro-steps and the ranks, and their global target count."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from effpretrain.data.stream import IGNORE_INDEX, TokenStream
from effpretrain.errors import ConfigError

log = logging.getLogger("effpretrain")


def count_targets(labels: torch.Tensor) -> int:
    """Tokens that are prediction targets (the model shifts labels by one)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


class Batches:
    """Optimizer-step batches for one rank.

    Global draw (in-memory corpora): the step's global rows are drawn in one call (through the
    shuffle buffer, if any) whatever the number of processes, then sliced: the rows of a step do
    not depend on the world size. Per-rank draw (`TokenStream.per_rank`: streamed corpora, each
    rank reading its own documents, as the benchmark's ``split_dataset_by_node``): each rank draws
    its own K x B rows, micro-step k taking rows [k B, (k + 1) B), so a step's rows depend on the
    world size; the step's global target count is then the sum over ranks, one all-reduce of two
    numbers (`all_reduce_sum`; the second counts ranks that stopped on bad data or an
    out-of-vocabulary token, so that every rank raises instead of waiting for them)."""

    def __init__(
        self,
        stream: TokenStream,
        batch_size: int,
        grad_accum: int,
        rank: int = 0,
        world: int = 1,
        vocab_size: int | None = None,
        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.stream, self.B, self.K, self.rank, self.world = stream, batch_size, grad_accum, rank, world
        self.vocab_size, self.all_reduce_sum = vocab_size, all_reduce_sum
        if stream.per_rank and world > 1 and all_reduce_sum is None:
            raise ValueError("per-rank batches over several processes need all_reduce_sum")

    def next_step(self) -> tuple[list[dict[str, torch.Tensor]], int]:
        """This rank's micro-batches for one optimizer step, and the step's global target count."""
        B, K = self.B, self.K
        local = self.stream.per_rank
        W, r = (1, 0) if local else (self.world, self.rank)
        try:
            rows, error = self.stream.next_rows(K * W * B), None
        except ConfigError as e:  # bad data on this rank: the others must not wait in the all-reduce
            if not (local and self.world > 1):
                raise
            rows, error = None, e
        top = int(rows["input_ids"].max()) if rows is not None else -1
        if error is None and self.vocab_size is not None and top >= self.vocab_size:
            error = ConfigError(f"token id {top} is beyond the model's vocabulary ({self.vocab_size})")
        total = count_targets(rows["labels"]) if rows is not None else 0
        if local and self.world > 1:
            # One collective: the target count, and whether any rank stopped (all ranks raise).
            summed = self.all_reduce_sum(torch.tensor([total, int(error is not None)], dtype=torch.int64))
            total, failed = (int(v) for v in summed.cpu())
            if failed and error is None:
                error = ConfigError(
                    f"{failed} other rank(s) stopped on bad data or tokens (their log says why)"
                )
        if error is not None:
            raise error
        micro = []
        for k in range(K):
            lo = (k * W + r) * B
            micro.append({key: v[lo : lo + B] for key, v in rows.items()})
        return micro, total

"""The validation set: the first `train.eval_tokens` target tokens of the held-out documents, the same rows for any batch size and number of processes."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from effpretrain.data.stream import IGNORE_INDEX
from effpretrain.errors import ConfigError

if TYPE_CHECKING:
    from effpretrain.data.tokenizer import Tokenizer

log = logging.getLogger("effpretrain")


@dataclass
class ValidationSet:
    """The fixed held-out evaluation set: rows of `seq_len` tokens in the validation order.

    Attributes:
        input_ids: (n, seq_len) int32 token ids (half the memory of int64); row i holds
            `lengths[i]` real tokens, then padding.
        lengths: (n,) real tokens per row; row i bears ``lengths[i] - 1`` targets (the model
            predicts every real token but the first).
        target_tokens: the requested size (`train.eval_tokens`).
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    target_tokens: int

    def __len__(self) -> int:
        return self.input_ids.size(0)

    @property
    def tokens(self) -> int:
        """Loss-bearing (target) tokens over all rows: sum_i (lengths[i] - 1)."""
        return int((self.lengths - 1).sum())

    def rows(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Rows [lo, hi) as a batch: input_ids, attention_mask, labels (IGNORE_INDEX on padding)."""
        ids = self.input_ids[lo:hi].long()
        pos = torch.arange(ids.size(1))
        mask = (pos[None, :] < self.lengths[lo:hi, None]).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def _chunks(items: Iterator[str], n: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _validation_token_rows(
    docs: Iterator[str], tok: Tokenizer, seq_len: int, mode: str
) -> Iterator[list[int]]:
    """Rows of real tokens from the validation documents, in order, by `TokenStream`'s row rules:
    pack joins the documents with EOS and cuts every `seq_len` tokens; truncate keeps each
    non-empty document's first `seq_len` tokens, EOS included. Documents are encoded 16 at a time
    (reading a few past the last row needed changes nothing)."""
    buffer: list[int] = []
    for chunk in _chunks(docs, 16):
        for ids in tok.encode_batch(chunk):
            if mode == "pack":
                buffer.extend(ids + [tok.eos_id])
                while len(buffer) >= seq_len:
                    yield buffer[:seq_len]
                    del buffer[:seq_len]
            elif ids:
                yield (ids + [tok.eos_id])[:seq_len]


def validation_set(corpus, tok: Tokenizer, seq_len: int, mode: str, eval_tokens: int) -> ValidationSet:
    """The fixed held-out evaluation set, defined by a token count, read once from the start of
    the validation documents (the in-memory split, or the streamed split) in their fixed order.

    With rows r_1, r_2, ... carrying c_i = len(r_i) - 1 targets, the set is the shortest prefix
    r_1..r_k with c_1 + ... + c_k >= eval_tokens: the row at which the count reaches (or passes)
    `eval_tokens` is included whole, so the set holds between eval_tokens and
    eval_tokens + seq_len - 2 targets. It does not depend on the batch size or the number of
    processes. A validation split too small for `eval_tokens` gives all of its rows (logged).

    Raises:
        ConfigError: the validation split yields no row with a target.
    """
    docs = corpus.iter_val() if corpus.streaming else iter(corpus.val)
    rows: list[torch.Tensor] = []  # int32 tensors, not lists: 10M tokens of Python ints cost ~0.4 GB
    targets = 0
    for row in _validation_token_rows(docs, tok, seq_len, mode):
        if len(row) < 2:
            continue  # no target (seq_len 1): nothing to evaluate
        rows.append(torch.tensor(row, dtype=torch.int32))
        targets += len(row) - 1
        if targets >= eval_tokens:
            break
    if not rows:
        raise ConfigError(f"{corpus.name}: the validation split is too small for one row of {seq_len} tokens")
    if targets < eval_tokens:
        log.warning(
            "%s: the validation split holds %d target tokens, fewer than train.eval_tokens=%d; "
            "evaluating on all of them",
            corpus.name,
            targets,
            eval_tokens,
        )
    ids = torch.full((len(rows), seq_len), tok.pad_id, dtype=torch.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    return ValidationSet(ids, lengths, eval_tokens)

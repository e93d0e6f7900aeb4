"""The token stream: rows of `seq_len` tokens from the training documents in a resumable, seeded order, with its shuffle buffer."""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from effpretrain.config import DataConfig
from effpretrain.data.readers import DocReader, Prefetcher
from effpretrain.errors import ConfigError

if TYPE_CHECKING:
    from effpretrain.data.tokenizer import Tokenizer

log = logging.getLogger("effpretrain")

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------
# Token stream and batches


class TokenStream:
    """Rows of `seq_len` tokens from the training documents, in a resumable order.

    pack: documents joined with EOS and cut into rows (every slot a target).
    truncate: one document per row, cut at seq_len, right-padded; pad labels are ignored.
    Documents come in a seeded permutation per epoch (in-memory corpora), or, for a streamed
    corpus (every one has a `reader`), from this rank's reader: a `DocReader` for local shards
    and hub (its share of the documents, shards in a seeded order, a seeded buffer of
    `doc_buffer` documents), a `effpretrain.data.tokens.TokenReader` for pre-tokenised shards (its share of
    a seeded document order); the rows cut from them in that order are the *source rows*.

    Row mixing. Consecutive source rows come from one document (in pack mode a standard-library
    module spans tens of rows), so a batch of consecutive rows holds one to three documents. With
    ``shuffle_buffer`` = P > 0, rows are drawn through a buffer of P source rows instead: the i-th
    row drawn takes the row in slot j_i ~ Uniform{0, ..., P-1} and the next source row takes its
    place. The slots of one call are ``randint(P, (n,))`` from a generator seeded with
    (``seed``, rows drawn before the call), so the draw is a function of the saved state alone.
    A row waits a Geometric(1/P) number of draws (mean P), so one batch of n << P rows mixes rows
    whose sources lie about P rows apart. P = 0: the source order, no buffer.

    `state_dict()` is the exact position: the epoch, the document cursor, the pending tokens, and
    with a buffer its rows and the draw counter, P x (seq_len + 1) x 4 bytes (int32 token ids and
    lengths): 2,113,536 bytes at the defaults (P = 4096, seq_len = 128); with a reader, its state
    too (`DocReader`: a shard position and the buffered texts, about 2 MB for 1000 C4 documents).

    `track_docs` (tests, debugging) records each row's document: `last_docs` holds, after every
    `next_rows`, the document of each row (in pack mode the one that supplies most of its
    tokens); the index in the corpus for in-memory sources, the reader's document id for streamed ones. It
    costs one int per buffered token and is not saved: rows buffered before a resume read -1.
    """

    def __init__(
        self,
        corpus,
        tok: Tokenizer,
        seq_len: int,
        mode: str,
        seed: int,
        chunk: int = 32,
        shuffle_buffer: int = 0,
        track_docs: bool = False,
        rank: int = 0,
        world: int = 1,
        doc_buffer: int = 0,
        prefetch: int = 0,
    ):
        self.corpus, self.tok, self.seq_len, self.mode, self.seed, self.chunk = (
            corpus,
            tok,
            seq_len,
            mode,
            seed,
            chunk,
        )
        self.shuffle_buffer, self.track_docs = shuffle_buffer, track_docs
        self.epoch, self.cursor, self.drawn = 0, 0, 0
        self.pending: list[list[int]] = []  # truncate: tokenized docs not yet emitted
        self.buffer: list[int] = []  # pack: tokens not yet emitted
        # The shuffle buffer's rows (int32 ids, right-padded) and lengths; None until first drawn from.
        self.pool_ids: torch.Tensor | None = None
        self.pool_lengths: torch.Tensor | None = None
        self.pending_docs: list[int] = []  # track_docs: parallel to pending, buffer, the pool
        self.buffer_docs: list[int] = []
        self.pool_docs: list[int] = []
        self.last_docs: torch.Tensor | None = None
        self._order: list[int] | None = None
        make_reader = getattr(corpus, "reader", None)
        if corpus.streaming and make_reader is None:  # no global stream: every rank reads its own
            raise TypeError(f"{corpus.name}: a streamed corpus needs reader(rank, world, seed, doc_buffer)")
        self.reader: DocReader | None = make_reader(rank, world, seed, doc_buffer) if make_reader else None
        self.prefetcher = (
            Prefetcher(self.reader, self._encode, chunk, prefetch)
            if self.reader is not None and prefetch
            else None
        )

    @property
    def per_rank(self) -> bool:
        """Each rank reads its own documents (a streamed corpus with a reader): `Batches` then
        draws each rank's rows from its own stream."""
        return self.reader is not None

    @classmethod
    def from_config(
        cls, corpus, tok: Tokenizer, cfg: DataConfig, rank: int = 0, world: int = 1
    ) -> TokenStream:
        """The stream a run on `cfg` reads, as this process (`rank` of `world`)."""
        return cls(
            corpus,
            tok,
            cfg.seq_len,
            cfg.mode,
            cfg.shuffle_seed,
            shuffle_buffer=cfg.shuffle_buffer,
            rank=rank,
            world=world,
            doc_buffer=cfg.doc_buffer,
            prefetch=cfg.prefetch,
        )

    # -- position ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        lengths = [len(p) for p in self.pending]
        flat = [t for p in self.pending for t in p]
        empty = torch.zeros((0, self.seq_len), dtype=torch.int32)
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "buffer": torch.tensor(self.buffer, dtype=torch.int64),
            "pending": torch.tensor(flat, dtype=torch.int64),
            "pending_lengths": torch.tensor(lengths, dtype=torch.int64),
            "drawn": self.drawn,
            "pool_ids": empty if self.pool_ids is None else self.pool_ids.clone(),
            "pool_lengths": empty[:, 0] if self.pool_lengths is None else self.pool_lengths.clone(),
            **(
                {"reader": self.reader.state_dict(self._reader_snapshot())} if self.reader is not None else {}
            ),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(sd["epoch"]), int(sd["cursor"])
        self.buffer = sd["buffer"].tolist()
        flat = sd["pending"].tolist()
        self.pending, i = [], 0
        for n in sd["pending_lengths"].tolist():
            self.pending.append(flat[i : i + n])
            i += n
        self._order = None
        if self.reader is not None:
            if "reader" not in sd:
                raise ConfigError(
                    "the checkpoint's data position has no document-reader state (another data.source)"
                )
            if self.prefetcher is not None:
                self.prefetcher.stop()
            self.reader.load_state_dict(sd["reader"])
        # Checkpoints from before the shuffle buffer hold no pool: it fills from the stream position.
        self.drawn = int(sd.get("drawn", 0))
        pool = sd.get("pool_ids")
        self.pool_ids = self.pool_lengths = None
        if pool is not None and pool.numel():
            if tuple(pool.shape) == (self.shuffle_buffer, self.seq_len):
                self.pool_ids, self.pool_lengths = pool.to(torch.int32), sd["pool_lengths"].to(torch.int32)
            else:  # only with --allow-config-change: the rows the old buffer held are not seen
                log.warning("the checkpoint's shuffle buffer %s does not fit this run: refilled", pool.shape)
        if self.track_docs:
            self.buffer_docs, self.pending_docs = [-1] * len(self.buffer), [-1] * len(self.pending)
            self.pool_docs = [-1] * self.shuffle_buffer if self.pool_ids is not None else []

    def snapshot(self) -> dict[str, Any]:
        """A cheap in-memory copy of the position (to undo a skipped step's draw)."""
        snap = {k: getattr(self, k) for k in _STREAM_FIELDS}
        snap.update(buffer=list(self.buffer), pending=[list(p) for p in self.pending])
        for k in ("buffer_docs", "pending_docs", "pool_docs"):
            snap[k] = list(snap[k])
        for k in ("pool_ids", "pool_lengths"):
            snap[k] = None if snap[k] is None else snap[k].clone()
        if self.reader is not None:
            snap["reader"] = self._reader_snapshot()
        return snap

    def restore(self, snap: dict[str, Any]) -> None:
        for k in _STREAM_FIELDS:
            setattr(self, k, snap[k])
        if self.prefetcher is not None:
            self.prefetcher.restore(snap["reader"])
        elif self.reader is not None:
            self.reader.restore(snap["reader"])

    def _reader_snapshot(self) -> dict[str, Any]:
        """The reader's position as consumed (a prefetching thread may have read further)."""
        return self.prefetcher.snapshot() if self.prefetcher is not None else self.reader.snapshot()

    # -- documents -----------------------------------------------------------------------------
    def _epoch_order(self) -> list[int]:
        if self._order is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._order = torch.randperm(len(self.corpus.train), generator=g).tolist()
        return self._order

    def _next_docs(self) -> list[tuple[int, str]]:
        """The next chunk of (document index, text), advancing the cursor (wrapping epochs)."""
        if self.reader is not None:
            return [self.reader.next_doc() for _ in range(self.chunk)]
        order = self._epoch_order()
        if self.cursor >= len(order):
            self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
            order = self._epoch_order()
        idx = order[self.cursor : self.cursor + self.chunk]
        self.cursor += len(idx)
        return [(i, self.corpus.train[i]) for i in idx]

    def _encode(self, docs: list[tuple[int, Any]]) -> list[list[int]]:
        return self.tok.encode_batch([text for _, text in docs])

    def _next_encoded(self) -> tuple[list[tuple[int, Any]], list[list[int]]]:
        """The next chunk of documents and their token ids (read ahead by the prefetcher if any)."""
        if self.prefetcher is not None:
            return self.prefetcher.next_chunk()
        docs = self._next_docs()
        return docs, self._encode(docs) if docs else []

    def _refill(self) -> None:
        for _attempt in range(10_000):
            docs, encoded = self._next_encoded()
            if docs:
                for (doc, _), ids in zip(docs, encoded):
                    if self.mode == "pack":
                        self.buffer.extend(ids)
                        self.buffer.append(self.tok.eos_id)
                        if self.track_docs:
                            self.buffer_docs.extend([doc] * (len(ids) + 1))
                    elif ids:
                        self.pending.append(ids)
                        if self.track_docs:
                            self.pending_docs.append(doc)
                return
        raise ConfigError(f"{self.corpus.name}: the corpus yields no tokens")

    # -- rows ----------------------------------------------------------------------------------
    def _source_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The next `n` source rows: ids (n, seq_len) right-padded, lengths (n,), documents."""
        L = self.seq_len
        if self.mode == "pack":
            while len(self.buffer) < n * L:
                self._refill()
            ids = torch.tensor(self.buffer[: n * L], dtype=torch.long).view(n, L)
            del self.buffer[: n * L]
            docs = []
            if self.track_docs:
                docs = [_majority(self.buffer_docs[i * L : (i + 1) * L]) for i in range(n)]
                del self.buffer_docs[: n * L]
            return ids, torch.full((n,), L, dtype=torch.long), docs
        while len(self.pending) < n:
            self._refill()
        rows, self.pending = self.pending[:n], self.pending[n:]
        docs, self.pending_docs = self.pending_docs[:n], self.pending_docs[n:]
        ids = torch.full((n, L), self.tok.pad_id, dtype=torch.long)
        lengths = torch.zeros(n, dtype=torch.long)
        for i, r in enumerate(rows):
            r = (r + [self.tok.eos_id])[:L]
            ids[i, : len(r)] = torch.tensor(r)
            lengths[i] = len(r)
        return ids, lengths, docs

    def _draw(self, n: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """`n` rows through the shuffle buffer (class docstring), filling it on first use."""
        P = self.shuffle_buffer
        if self.pool_ids is None:
            ids, lengths, self.pool_docs = self._source_rows(P)
            self.pool_ids, self.pool_lengths = ids.to(torch.int32), lengths.to(torch.int32)
        g = torch.Generator().manual_seed(_draw_seed(self.seed, self.drawn))
        slots = torch.randint(P, (n,), generator=g).tolist()
        new_ids, new_lengths, new_docs = self._source_rows(n)
        # As if one row at a time: a slot drawn again in this call gives the source row that
        # replaced it (its previous draw's), and each slot ends with its last draw's source row.
        prev, last = [], {}
        for i, j in enumerate(slots):
            prev.append(last.get(j, -1))
            last[j] = i
        at, again = torch.tensor(slots), torch.tensor(prev)
        out_ids, out_lengths = self.pool_ids[at].long(), self.pool_lengths[at].long()
        dup = again >= 0
        out_ids[dup], out_lengths[dup] = new_ids[again[dup]], new_lengths[again[dup]]
        docs = []
        if self.track_docs:
            docs = [new_docs[p] if p >= 0 else self.pool_docs[j] for j, p in zip(slots, prev)]
            for j, i in last.items():
                self.pool_docs[j] = new_docs[i]
        js, src = torch.tensor(list(last)), torch.tensor(list(last.values()))
        self.pool_ids[js] = new_ids[src].to(torch.int32)
        self.pool_lengths[js] = new_lengths[src].to(torch.int32)
        self.drawn += n
        return out_ids, out_lengths, docs

    def next_rows(self, n: int) -> dict[str, torch.Tensor]:
        """`n` rows: input_ids, attention_mask, labels (IGNORE_INDEX on padding)."""
        ids, lengths, docs = self._draw(n) if self.shuffle_buffer else self._source_rows(n)
        self.last_docs = torch.tensor(docs, dtype=torch.long) if self.track_docs else None
        if self.mode == "pack":
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        mask = (torch.arange(self.seq_len)[None, :] < lengths[:, None]).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


_STREAM_FIELDS = (
    "epoch",
    "cursor",
    "buffer",
    "pending",
    "_order",
    "drawn",
    "pool_ids",
    "pool_lengths",
    "buffer_docs",
    "pending_docs",
    "pool_docs",
)


def _majority(docs: list[int]) -> int:
    """The most frequent entry (the first of equals): the document supplying most of a row."""
    return Counter(docs).most_common(1)[0][0]


def _draw_seed(seed: int, drawn: int) -> int:
    """A 63-bit generator seed for the draw after `drawn` rows, unrelated to the epoch orders'."""
    digest = hashlib.blake2b(f"rows:{seed}:{drawn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1

"""Streamed documents with an O(1) position: the per-rank reader of local shards and of a hub dataset, and the background prefetcher."""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from effpretrain.data.files import shard_records
from effpretrain.errors import ConfigError

if TYPE_CHECKING:
    from effpretrain.data.corpus import HubCorpus, ShardedFiles

log = logging.getLogger("effpretrain")


# Streamed training documents: one rank's share, a seeded shuffle buffer, an O(1) position


class DocReader:
    """One rank's training documents through a seeded shuffle buffer of `size` documents.

    The buffer fills with the source's first `size` documents; then the i-th document read takes
    the one in slot j_i ~ Uniform{0, ..., size-1} and the source's next document takes its place
    (the rule of `datasets`' ``IterableDataset.shuffle``, whose default the benchmark uses with
    1000). The slots of draws [1024 b, 1024 (b + 1)) come from a generator seeded with
    (seed, rank, b), so the draw is a function of the saved state. The state is the source's
    position, the draw counter and the buffered texts: restoring it costs one shard's skip at
    most, whatever the step. size = 0: the source order.

    Its `source` yields (document id, text) with `next_doc()` and has `state_dict`,
    `load_state_dict`, `snapshot` and `restore`.
    """

    BLOCK = 1024

    def __init__(self, source, size: int, seed: int, rank: int):
        self.source, self.size, self.seed, self.rank = source, size, seed, rank
        self.buffer: list[tuple[int, str]] = []
        self.drawn = 0
        self._slots: tuple[int, list[int]] | None = None

    def _slot(self) -> int:
        block, i = divmod(self.drawn, self.BLOCK)
        if self._slots is None or self._slots[0] != block:
            rng = random.Random(f"docs:{self.seed}:{self.rank}:{block}")  # str seeds: sha512, stable
            self._slots = (block, [rng.randrange(self.size) for _ in range(self.BLOCK)])
        return self._slots[1][i]

    def next_doc(self) -> tuple[int, str]:
        if not self.size:
            return self.source.next_doc()
        while len(self.buffer) < self.size:
            self.buffer.append(self.source.next_doc())
        j = self._slot()
        out, self.buffer[j] = self.buffer[j], self.source.next_doc()
        self.drawn += 1
        return out

    def state_dict(self, snap: dict[str, Any] | None = None) -> dict[str, Any]:
        """The position (or that of `snap`, a `snapshot()`): tensors, ints and strings only."""
        snap = self.snapshot() if snap is None else snap
        return {
            "source": dict(snap["source"]),
            "drawn": snap["drawn"],
            "ids": torch.tensor([i for i, _ in snap["buffer"]], dtype=torch.int64),
            "texts": [t for _, t in snap["buffer"]],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.source.load_state_dict(sd["source"])
        self.drawn = int(sd["drawn"])
        self.buffer = list(zip(sd["ids"].tolist(), sd["texts"]))

    def snapshot(self) -> dict[str, Any]:
        return {"source": self.source.snapshot(), "drawn": self.drawn, "buffer": list(self.buffer)}

    def restore(self, snap: dict[str, Any]) -> None:
        self.source.restore(snap["source"])
        self.drawn, self.buffer = snap["drawn"], list(snap["buffer"])


class Prefetcher:
    """Reads and tokenises a `DocReader`'s next chunks on a background thread, `depth` chunks
    ahead of the training thread, in the reader's own order: the consumer gets the chunks a
    single-threaded loop would read, so the batches are bitwise the same.

    The reader runs ahead of what has been consumed; every chunk carries the reader's snapshot
    after it, so `snapshot()` is the position of the last chunk consumed, and `stop()` puts the
    reader back there (the chunks read ahead are read again after a restore). An error in the
    thread (bad data) is raised where the consumer reaches that chunk."""

    def __init__(
        self, reader: DocReader, encode: Callable[[list[Any]], list[list[int]]], chunk: int, depth: int
    ):
        self.reader, self.encode, self.chunk, self.depth = reader, encode, chunk, depth
        self._thread: threading.Thread | None = None
        self._pos: dict[str, Any] | None = None  # the reader's snapshot after the last consumed chunk

    def _run(self, out: queue.Queue, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                docs = [self.reader.next_doc() for _ in range(self.chunk)]
                self._put(out, stop, (docs, self.encode(docs), self.reader.snapshot()))
        except BaseException as e:  # handed to the consumer, raised where it would have been
            self._put(out, stop, e)

    @staticmethod
    def _put(out: queue.Queue, stop: threading.Event, item: Any) -> None:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def next_chunk(self) -> tuple[list[tuple[int, Any]], list[list[int]]]:
        if self._thread is None:
            self._pos = self.reader.snapshot()
            self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._queue, self._stop), name="effpretrain-tokenize", daemon=True
            )
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.stop()
            raise item
        docs, encoded, self._pos = item
        return docs, encoded

    def snapshot(self) -> dict[str, Any]:
        return self.reader.snapshot() if self._thread is None else self._pos

    def stop(self) -> None:
        """Ends the thread and puts the reader back at the consumed position."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.reader.restore(self._pos)

    def restore(self, snap: dict[str, Any]) -> None:
        self.stop()
        self.reader.restore(snap)


class DocPosition:
    """A document source whose position is a small dict of ints and strings (`state_dict`):
    its `snapshot()` is that dict, and `restore(snap)` reloads it only when the position moved
    (undoing a skipped step's draw costs nothing when the draw read no document)."""

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:
        return self.state_dict()

    def restore(self, snap: dict[str, Any]) -> None:
        if snap != self.state_dict():
            self.load_state_dict(snap)


class _LocalShardDocs(DocPosition):
    """One rank's raw training documents from local shards, epoch after epoch.

    Rank r of W reads shards i with i % W == r when there are at least W shards, else every shard
    and its records i with i % W == r (`datasets.distributed.split_dataset_by_node`'s two ways);
    each epoch visits the rank's shards in a seeded order, each from its start. The position is
    (epoch, shard_pos, in_shard): `load_state_dict` reopens one shard and skips `in_shard`
    records of it, never the records of earlier shards."""

    def __init__(self, corpus: ShardedFiles, rank: int, world: int, seed: int):
        n = len(corpus.files)
        self.corpus, self.rank, self.world, self.seed = corpus, rank, world, seed
        self.shards = list(range(rank, n, world)) if n >= world else list(range(n))
        self.stride = 1 if n >= world else world
        self.epoch = self.shard_pos = self.in_shard = 0
        self.opened = 0  # shards opened (tests: a resume opens one)
        self._it: Iterator[tuple[int, str]] | None = None
        self._order: tuple[int, list[int]] | None = None
        self._found = False  # a document in this epoch: an epoch without one means none at all

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            order = list(self.shards)
            random.Random(f"shards:{self.seed}:{self.epoch}").shuffle(order)
            self._order = (self.epoch, order)
        return self._order[1]

    def next_doc(self) -> tuple[int, str]:
        while True:
            if self._it is None:
                order = self._epoch_order()
                if self.shard_pos >= len(order):
                    if not self._found:
                        raise ConfigError(
                            f"{self.corpus.name}: too few documents: rank {self.rank} of {self.world} "
                            "has no training documents"
                        )
                    self.epoch, self.shard_pos, self._found = self.epoch + 1, 0, False
                    continue
                self._shard = order[self.shard_pos]
                self._it = shard_records(self.corpus.files[self._shard], self.corpus.field, self.in_shard)
                self.opened += 1
            try:
                index, text = next(self._it)
            except StopIteration:
                self._it, self.shard_pos, self.in_shard = None, self.shard_pos + 1, 0
                continue
            self.in_shard = index + 1
            if index % self.stride == self.rank % self.stride and self.corpus.is_train(text):
                self._found = True
                return (self._shard << 32) | index, text

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "shard_pos": self.shard_pos, "in_shard": self.in_shard}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.shard_pos, self.in_shard = (
            int(sd["epoch"]),
            int(sd["shard_pos"]),
            int(sd["in_shard"]),
        )
        self._it, self._found = None, True


class _HubDocs(DocPosition):
    """One rank's raw training documents of a `datasets` stream, epoch after epoch: shards in a
    seeded order per epoch (``shuffle(seed, buffer_size=1)``: no buffer inside `datasets`, whose
    contents its state would not keep; `DocReader` holds the buffer), split by
    ``split_dataset_by_node`` as the benchmark does. The position is the epoch and
    ``IterableDataset.state_dict()`` (shard and offset in it): O(1) to restore."""

    def __init__(self, corpus: HubCorpus, rank: int, world: int, seed: int):
        from datasets.distributed import split_dataset_by_node

        ds = corpus.load(corpus.cfg.split).shuffle(seed=seed, buffer_size=1, max_buffer_input_shards=1)
        self.ds = split_dataset_by_node(ds, rank=rank, world_size=world)
        self.corpus, self.rank, self.world = corpus, rank, world
        self.epoch, self.count, self.opened = 0, 0, 0
        self._it: Iterator[dict[str, Any]] | None = None
        self._resume: str | None = None  # the saved `datasets` state, applied at the next read
        self._found = False

    def next_doc(self) -> tuple[int, str]:
        while True:
            if self._it is None:
                self.ds.set_epoch(self.epoch)  # the shard order's seed is seed + epoch
                if self._resume:
                    # `datasets` warns that a shuffle buffer's contents are lost: its buffer holds
                    # no document between reads here (size 1), so nothing is.
                    quiet = logging.getLogger("datasets.iterable_dataset")
                    level = quiet.level
                    quiet.setLevel(logging.ERROR)
                    try:
                        self.ds.load_state_dict(json.loads(self._resume))
                    finally:
                        quiet.setLevel(level)
                self._it, self._resume = iter(self.ds), None
                self.opened += 1
            try:
                row = next(self._it)
            except StopIteration:
                if not self._found:
                    raise ConfigError(
                        f"{self.corpus.name}: too few documents: rank {self.rank} of {self.world} "
                        "has no training documents"
                    ) from None
                self.epoch, self._it, self._found = self.epoch + 1, None, False
                continue
            text = self.corpus.row_text(row)
            if self.corpus.is_train(text):
                self.count, self._found = self.count + 1, True
                return self.count - 1, text

    def state_dict(self) -> dict[str, Any]:
        hub = json.dumps(self.ds.state_dict()) if self._it is not None else self._resume
        return {"epoch": self.epoch, "count": self.count, "hub": hub or ""}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.count = int(sd["epoch"]), int(sd["count"])
        self._it, self._resume, self._found = None, sd["hub"] or None, True

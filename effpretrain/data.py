"""Corpus sources, tokenizers, and resumable batching.

Three sources:

- ``builtin`` (`Corpus`, in memory): the Python standard library's own ``.py`` sources plus the
  pydoc topics text, shipped with every interpreter (~12 MB), test folders excluded, sorted
  paths. No download.
- ``files`` (`ShardedFiles`, streamed): local shards, ``.txt`` (split into paragraph documents),
  ``.jsonl`` / ``.jsonl.gz`` / ``.json.gz`` (one document per line, ``data.text_field``) or
  ``.parquet`` (one document per row); a file, a folder or a glob of them.
- ``hub`` (`HubCorpus`, streamed): any HF dataset (name, config, split); ``data.name`` may also be
  a local dataset folder. C4 (``allenai/c4``, ``en``) is the paper's.

A streamed source is read per rank through a `DocReader` (shards in a seeded order per epoch,
each rank its own share, a seeded document buffer) whose position is O(1) to restore, and is
optionally read and tokenised ahead on a background thread (`Prefetcher`).

Batches are built from a deterministic token stream whose position (epoch, document cursor,
pending tokens, and the rows of its shuffle buffer) is a small dict of ints and tensors saved in
every checkpoint. Rows are drawn at random from a seeded buffer of ``data.shuffle_buffer`` rows
(`TokenStream`), so a batch mixes documents instead of taking consecutive rows of one. A step
draws ``grad_accum x world_size x batch_size`` rows at once (in-memory corpora); micro-step k of
rank r takes rows ``[(k W + r) B, (k W + r + 1) B)``, so 2 processes at batch B see exactly the
rows that 1 process sees at batch 2B. A streamed corpus's rank draws its own rows (`Batches`).

The validation set (`validation_set`) is the first `train.eval_tokens` target tokens of the
held-out documents, read once, in their fixed order: the same rows for any batch size and any
number of processes.
"""

from __future__ import annotations

import glob as globmod
import gzip
import hashlib
import json
import logging
import os
import queue
import random
import sysconfig
import threading
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from effpretrain.config import DataConfig
from effpretrain.errors import ConfigError

log = logging.getLogger("effpretrain")

IGNORE_INDEX = -100
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


# ----------------------------------------------------------------------------------------------
# Documents


def builtin_documents() -> list[str]:
    """The standard library's .py sources (sorted by path, tests excluded) + pydoc topics."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("test_"))
        paths.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    docs = []
    for p in sorted(paths, key=lambda q: q.relative_to(root).as_posix()):
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(text)
    try:
        from pydoc_data.topics import topics

        docs.extend(topics[k] for k in sorted(topics))
    except ImportError:  # some distributions strip pydoc_data
        pass
    if not docs:
        raise ConfigError(f"built-in corpus is empty: no .py sources found under the stdlib ({root.name})")
    return docs


# ----------------------------------------------------------------------------------------------
# Local shards: streamed record by record, never a whole corpus in memory

#: Shard types by file-name ending (longest first). `.json.gz` is JSON lines too: C4's shards
#: (`c4-train.00000-of-01024.json.gz`) are named so.
_SHARD_KINDS = (
    (".jsonl.gz", "jsonl"),
    (".json.gz", "jsonl"),
    (".jsonl", "jsonl"),
    (".parquet", "parquet"),
    (".txt", "txt"),
)
_KINDS_TEXT = ".txt, .jsonl, .jsonl.gz (.json.gz) or .parquet"
_TXT_DOC_CHARS = 4000


def shard_kind(path: Path) -> str | None:
    """`jsonl`, `parquet`, `txt`, or None for a file that is not a shard."""
    return next((kind for end, kind in _SHARD_KINDS if path.name.endswith(end)), None)


def list_shards(spec: str, key: str = "data.path") -> list[Path]:
    """The shards named by `spec`: a file, a folder (searched recursively) or a glob pattern
    (``**`` allowed), in sorted path order. ConfigError when nothing matches."""
    if any(c in spec for c in "*?["):
        found = sorted(Path(p) for p in globmod.glob(os.path.expanduser(spec), recursive=True))
        files = [p for p in found if p.is_file() and shard_kind(p)]
        if not files:
            raise ConfigError(f"{key} {spec}: no {_KINDS_TEXT} files match this pattern")
        return files
    p = Path(spec).expanduser()
    if not p.exists():
        raise ConfigError(f"{key} not found: {spec}")
    if p.is_dir():
        files = sorted(
            (q for q in p.rglob("*") if q.is_file() and shard_kind(q)),
            key=lambda q: q.relative_to(p).as_posix(),
        )
        if not files:
            raise ConfigError(
                f"{key} {spec}: no .txt, .jsonl or .parquet files in this folder ({_KINDS_TEXT})"
            )
        return files
    if shard_kind(p) is None:
        raise ConfigError(f"{key} {spec}: unsupported file type {p.suffix!r} (use {_KINDS_TEXT})")
    return [p]


def shard_records(path: Path, field: str = "text", skip: int = 0) -> Iterator[tuple[int, str]]:
    """(record index, text) for each record of one shard, from record `skip` on; the skipped
    records are counted but not parsed. A record is a non-blank line (JSON lines), a row
    (parquet) or a paragraph document (txt); its text may be blank (the caller drops it).

    Raises:
        ConfigError: naming the file and line (or row) of a corrupt gzip stream, a line that is
            not JSON or lacks the text field, a non-string text; or an empty shard (no non-blank
            document), which is never skipped silently.
    """
    kind = shard_kind(path)
    reader = {"jsonl": _jsonl_records, "parquet": _parquet_records, "txt": _txt_records}[kind]
    nonblank = 0
    for index, text in reader(path, field, skip):
        nonblank += bool(text.strip())
        yield index, text
    if skip == 0 and nonblank == 0:
        raise ConfigError(f"{path}: empty shard: no non-blank documents (the corpus is empty there)")


def _json_text(path: Path, lineno: int, line: str, field: str) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        raise ConfigError(f"{path}:{lineno}: not valid JSON") from None
    if not isinstance(obj, dict) or field not in obj:
        raise ConfigError(f"{path}:{lineno}: no text field {field!r} (set data.text_field)")
    text = obj[field]
    if not isinstance(text, str):
        raise ConfigError(f"{path}:{lineno}: field {field!r} is not a string")
    return text


def _jsonl_records(path: Path, field: str, skip: int) -> Iterator[tuple[int, str]]:
    gz = path.name.endswith(".gz")
    lineno, n = 0, 0
    try:
        with gzip.open(path, "rt", encoding="utf-8") if gz else path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):  # noqa: B007 (lineno names the failing line below)
                if not line.strip():
                    continue
                n += 1
                if n > skip:
                    yield n - 1, _json_text(path, lineno, line, field)
    except UnicodeDecodeError:
        raise ConfigError(f"{path}:{lineno + 1}: not UTF-8 text") from None
    except (OSError, EOFError, zlib.error) as e:
        what = "corrupt or truncated gzip" if gz else "unreadable"
        raise ConfigError(f"{path}:{lineno + 1}: {what} ({type(e).__name__}: {e})") from None


def _txt_records(path: Path, field: str, skip: int) -> Iterator[tuple[int, str]]:
    """Paragraphs (split at blank lines, "\\n\\n") joined into documents of up to ~4000 chars,
    read 1 MiB at a time (a paragraph split across two reads is rejoined: the tail is kept)."""
    n = 0
    cur = tail = ""
    with path.open(encoding="utf-8", errors="replace") as fh:
        while True:
            block = fh.read(1 << 20)
            parts = (tail + block).split("\n\n")
            tail = parts.pop() if block else ""
            for para in parts:
                if not para.strip():
                    continue
                if cur and len(cur) + len(para) > _TXT_DOC_CHARS:
                    n += 1
                    if n > skip:
                        yield n - 1, cur
                    cur = ""
                cur = f"{cur}\n\n{para}" if cur else para
            if not block:
                break
    if cur.strip():
        n += 1
        if n > skip:
            yield n - 1, cur


def _parquet_records(path: Path, field: str, skip: int) -> Iterator[tuple[int, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("reading .parquet needs pyarrow: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise ConfigError(f"{path}: not a readable parquet file ({type(e).__name__})") from None
    if field not in pf.schema_arrow.names:
        raise ConfigError(f"{path}: no column {field!r} (columns: {', '.join(pf.schema_arrow.names)})")
    row = 0
    for g in range(pf.num_row_groups):
        rows = pf.metadata.row_group(g).num_rows
        if row + rows <= skip:  # a resume skips whole row groups unread
            row += rows
            continue
        try:
            values = pf.read_row_group(g, columns=[field]).column(0).to_pylist()
        except Exception as e:
            raise ConfigError(f"{path}: row group {g} (row {row}) unreadable ({type(e).__name__})") from None
        for v in values:
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"{path}: row {row}: column {field!r} is not a string")
            if row >= skip:
                yield row, v or ""
            row += 1


def file_documents(path: str, field: str = "text") -> list[str]:
    """Every non-blank document of a file, folder or glob of shards, in memory (small corpora and
    tests; training streams them through `ShardedFiles`)."""
    docs = [t for f in list_shards(path) for _, t in shard_records(f, field) if t.strip()]
    if not docs:
        raise ConfigError(f"data.path {path}: the corpus is empty (no non-blank documents)")
    return docs


def held_out(text: str, every: int) -> bool:
    """A streamed document is held out for validation when a hash of its text is 0 mod `every`:
    about one in `every`, the same documents whatever the shard order, shuffle seed or number of
    processes, and duplicates of a held-out text are held out too."""
    digest = hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % every == 0


# ----------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------
# Corpus: train/val documents behind one interface


class Corpus:
    """Train and held-out documents in memory (the built-in corpus); indexed, not streamed."""

    streaming = False

    def __init__(self, train: list[str], val: list[str], name: str):
        if not train:
            raise ConfigError(
                f"{name}: too few documents: none left for training after holding out validation"
            )
        if not val:
            raise ConfigError(f"{name}: too few documents to hold out a validation split")
        self.train, self.val, self.name = train, val, name

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for d in self.train:
            h.update(d.encode("utf-8", "replace"))
            h.update(b"\0")
        return h.hexdigest()[:16]


def _split(docs: list[str], every: int) -> tuple[list[str], list[str]]:
    """Every `every`-th document (index % every == every - 1) is held out: deterministic."""
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    val = [d for i, d in enumerate(docs) if i % every == every - 1]
    return train, val


class ShardedFiles:
    """`data.source=files`: local shards (`list_shards`), streamed, never held in memory.

    Validation: the documents of `data.val_path` if set, else the `held_out` ones (one in
    `data.val_every`, by text hash) read in sorted shard order: `validation_set` stops at
    `train.eval_tokens`, so only the first shards are read. Training: every other non-blank
    document, per rank through `reader`. The built-in tokenizer trains on the first
    `data.bpe_sample_mb` MB of training text in sorted shard order (`tokenizer_sample`)."""

    streaming = True

    def __init__(self, cfg: DataConfig):
        self.cfg, self.field, self.every = cfg, cfg.text_field, cfg.val_every
        self.files = list_shards(cfg.path)
        self.val_files = list_shards(cfg.val_path, "data.val_path") if cfg.val_path else None
        self.name = f"files:{cfg.path}"
        self._fingerprint: str | None = None

    def is_train(self, text: str) -> bool:
        return bool(text.strip()) and (self.val_files is not None or not held_out(text, self.every))

    def iter_val(self) -> Iterator[str]:
        n = 0
        for f in self.val_files or self.files:
            for _, text in shard_records(f, self.field):
                if text.strip() and (self.val_files is not None or held_out(text, self.every)):
                    n += 1
                    yield text
        if not n:
            raise ConfigError(
                f"{self.name}: too few documents to hold out a validation split "
                f"(one in data.val_every={self.every}); or set data.val_path"
            )

    def tokenizer_sample(self) -> list[str]:
        """Training documents in sorted shard order up to `data.bpe_sample_mb` MB of text."""
        budget, used, docs = self.cfg.bpe_sample_mb * 1_000_000, 0, []
        for f in self.files:
            for _, text in shard_records(f, self.field):
                if self.is_train(text):
                    docs.append(text)
                    used += len(text)
                    if used >= budget:
                        return docs
        return docs

    def fingerprint(self) -> str:
        """A hash of the tokenizer sample (the built-in BPE's cache key)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for d in self.tokenizer_sample():
                h.update(d.encode("utf-8", "replace"))
                h.update(b"\0")
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def reader(self, rank: int, world: int, seed: int, doc_buffer: int) -> DocReader:
        return DocReader(_LocalShardDocs(self, rank, world, seed), doc_buffer, seed, rank)


class HubCorpus:
    """A streamed HF dataset; held-out documents come from `val_split` or the `held_out` ones."""

    streaming = True

    def __init__(self, cfg: DataConfig):
        try:
            import datasets
        except ImportError:
            raise ConfigError("data.source=hub needs the datasets package") from None
        self.cfg, self.every = cfg, cfg.val_every
        self.name = f"hub:{cfg.name}" + (f"/{cfg.config}" if cfg.config else "")
        self._datasets = datasets

    def load(self, split: str):
        try:
            return self._datasets.load_dataset(
                self.cfg.name, self.cfg.config or None, split=split, streaming=True
            )
        except Exception as e:  # network, missing dataset, bad split: all user input problems
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"cannot open dataset {self.cfg.name!r} split {split!r}: {msg}") from None

    def row_text(self, row: dict[str, Any]) -> str:
        field = self.cfg.text_field
        if field not in row:
            raise ConfigError(f"{self.name}: rows have no field {field!r} (set data.text_field)")
        if not isinstance(row[field], str):
            raise ConfigError(f"{self.name}: field {field!r} is not a string")
        return row[field]

    def is_train(self, text: str) -> bool:
        return bool(text.strip()) and (bool(self.cfg.val_split) or not held_out(text, self.every))

    def iter_val(self) -> Iterator[str]:
        """The validation split in its file order, or the training split's `held_out` documents."""
        split = self.cfg.val_split or self.cfg.split
        for row in self.load(split):
            text = self.row_text(row)
            if text.strip() and (self.cfg.val_split or held_out(text, self.every)):
                yield text

    def reader(self, rank: int, world: int, seed: int, doc_buffer: int) -> DocReader:
        return DocReader(_HubDocs(self, rank, world, seed), doc_buffer, seed, rank)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.name.encode()).hexdigest()[:16]


def load_corpus(cfg: DataConfig) -> Corpus | ShardedFiles | HubCorpus:
    if cfg.source == "builtin":
        return Corpus(*_split(builtin_documents(), cfg.val_every), "builtin")
    if cfg.source == "files":
        return ShardedFiles(cfg)
    if cfg.source == "tokens":
        from effpretrain.token_shards import TokenCorpus

        return TokenCorpus(cfg)
    return HubCorpus(cfg)


# ----------------------------------------------------------------------------------------------
# Tokenizers


@dataclass
class Tokenizer:
    """The few things the stream needs from any tokenizer."""

    name: str
    vocab_size: int
    eos_id: int
    pad_id: int
    _encode: Any

    def encode_batch(self, texts: list) -> list[list[int]]:
        # Pre-tokenised documents (data.source=tokens) are already ids: they pass through, so the
        # training stream and the validation set treat them exactly as encoded text.
        if texts and not isinstance(texts[0], str):
            return [t.tolist() if hasattr(t, "tolist") else list(t) for t in texts]
        return self._encode(texts)


def cache_dir() -> Path:
    """$EFFPRETRAIN_CACHE, else the user cache dir (platformdirs)."""
    env = os.environ.get("EFFPRETRAIN_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("effpretrain"))


def train_bpe(docs: list[str], vocab_size: int, out: Path) -> None:
    """Trains a byte-level BPE on `docs` and writes tokenizer.json atomically."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, out)


def load_tokenizer(cfg: DataConfig, corpus: Corpus | ShardedFiles | HubCorpus) -> Tokenizer:
    """`builtin-bpe` (trained on the training documents, or on local shards' first
    `data.bpe_sample_mb` MB, cached by a hash of that text) or any HF name/path."""
    if cfg.tokenizer == "builtin-bpe":
        sample = getattr(corpus, "tokenizer_sample", None)  # streamed local files: a bounded sample
        if corpus.streaming and sample is None:
            raise ConfigError(
                "data.tokenizer=builtin-bpe needs an in-memory corpus or local files; "
                "use a HF tokenizer for hub data"
            )
        from tokenizers import Tokenizer as HFTokenizer

        path = cache_dir() / "tokenizers" / f"bpe-{corpus.fingerprint()}-{cfg.vocab_size}.json"
        if not path.is_file():
            log.info(
                "training a %d-token byte-level BPE on %s (cached at %s)", cfg.vocab_size, corpus.name, path
            )
            train_bpe(sample() if sample else corpus.train, cfg.vocab_size, path)
        tok = HFTokenizer.from_file(str(path))
        eos, pad = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)

        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

        return Tokenizer(f"builtin-bpe-{cfg.vocab_size}", tok.get_vocab_size(), eos, pad, encode)
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(cfg.tokenizer)
    except Exception as e:  # not found locally or on the hub
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"cannot load tokenizer {cfg.tokenizer!r}: {msg}") from None
    eos = hf.eos_token_id
    if eos is None:
        raise ConfigError(f"tokenizer {cfg.tokenizer!r} has no eos token")
    pad = hf.pad_token_id if hf.pad_token_id is not None else eos

    def encode_hf(texts: list[str]) -> list[list[int]]:
        return hf(texts, add_special_tokens=False)["input_ids"]

    return Tokenizer(cfg.tokenizer, len(hf), eos, pad, encode_hf)


# ----------------------------------------------------------------------------------------------
# Token stream and batches


class TokenStream:
    """Rows of `seq_len` tokens from the training documents, in a resumable order.

    pack: documents joined with EOS and cut into rows (every slot a target).
    truncate: one document per row, cut at seq_len, right-padded; pad labels are ignored.
    Documents come in a seeded permutation per epoch (in-memory corpora), or, for a streamed
    corpus (every one has a `reader`), from this rank's reader: a `DocReader` for local shards
    and hub (its share of the documents, shards in a seeded order, a seeded buffer of
    `doc_buffer` documents), a `token_shards.TokenReader` for pre-tokenised shards (its share of
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

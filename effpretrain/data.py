"""Corpus sources, tokenizers, and resumable batching.

Three sources behind one interface (`Corpus`: train documents, held-out documents):

- ``builtin``: the Python standard library's own ``.py`` sources plus the pydoc topics text,
  shipped with every interpreter (~12 MB), test folders excluded, sorted paths. No download.
- ``files``: local ``.txt`` (split into paragraph documents), ``.jsonl`` (one document per line,
  ``data.text_field``) or ``.parquet`` (one document per row); a file or a folder of them.
- ``hub``: any HF dataset (name, config, split), streamed; ``data.name`` may also be a local
  dataset folder. C4 (``allenai/c4``, ``en``) is the paper's.

Batches are built from a deterministic token stream whose position (epoch, document cursor,
pending tokens, and the rows of its shuffle buffer) is a small dict of ints and tensors saved in
every checkpoint. Rows are drawn at random from a seeded buffer of ``data.shuffle_buffer`` rows
(`TokenStream`), so a batch mixes documents instead of taking consecutive rows of one. A step
draws ``grad_accum x world_size x batch_size`` rows at once; micro-step k of rank r takes rows
``[(k W + r) B, (k W + r + 1) B)``, so 2 processes at batch B see exactly the rows that 1
process sees at batch 2B.

The validation set (`validation_set`) is the first `train.eval_tokens` target tokens of the
held-out documents, read once, in their fixed order: the same rows for any batch size and any
number of processes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from collections import Counter
from collections.abc import Iterator
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


def _txt_documents(path: Path, max_chars: int = 4000) -> list[str]:
    """A .txt file becomes documents of whole paragraphs, each up to ~max_chars."""
    text = path.read_text(encoding="utf-8", errors="replace")
    docs, cur = [], ""
    for para in text.split("\n\n"):
        if not para.strip():
            continue
        if cur and len(cur) + len(para) > max_chars:
            docs.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if cur.strip():
        docs.append(cur)
    return docs


def _jsonl_documents(path: Path, field: str) -> list[str]:
    docs = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{path}:{lineno}: not valid JSON") from None
            if not isinstance(obj, dict) or field not in obj:
                raise ConfigError(f"{path}:{lineno}: no text field {field!r} (set data.text_field)")
            if not isinstance(obj[field], str):
                raise ConfigError(f"{path}:{lineno}: field {field!r} is not a string")
            if obj[field].strip():
                docs.append(obj[field])
    return docs


def _parquet_documents(path: Path, field: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("reading .parquet needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise ConfigError(f"{path}: not a readable parquet file ({type(e).__name__})") from None
    if field not in table.column_names:
        raise ConfigError(f"{path}: no column {field!r} (columns: {', '.join(table.column_names)})")
    return [t for t in table.column(field).to_pylist() if isinstance(t, str) and t.strip()]


_READERS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}


def file_documents(path: str, field: str = "text") -> list[str]:
    """Documents from a file or folder of .txt/.jsonl/.parquet files (sorted paths)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"data.path not found: {path}")
    if p.is_dir():
        files = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in _READERS)
        if not files:
            raise ConfigError(f"data.path {path}: no .txt, .jsonl or .parquet files in this folder")
    else:
        if p.suffix not in _READERS:
            raise ConfigError(
                f"data.path {path}: unsupported file type {p.suffix!r} (use .txt, .jsonl, .parquet)"
            )
        files = [p]
    docs: list[str] = []
    for f in files:
        kind = _READERS[f.suffix]
        if kind == "txt":
            docs.extend(_txt_documents(f))
        elif kind == "jsonl":
            docs.extend(_jsonl_documents(f, field))
        else:
            docs.extend(_parquet_documents(f, field))
    if not docs:
        raise ConfigError(f"data.path {path}: the corpus is empty (no non-blank documents)")
    return docs


# ----------------------------------------------------------------------------------------------
# Corpus: train/val documents behind one interface


class Corpus:
    """Train and held-out documents. In-memory sources index documents; hub streams them."""

    streaming = False

    def __init__(self, train: list[str], val: list[str], name: str):
        if not train:
            raise ConfigError(f"{name}: no training documents left after holding out validation")
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


class HubCorpus:
    """A streamed HF dataset; held-out documents come from `val_split` or every Nth document."""

    streaming = True

    def __init__(self, cfg: DataConfig):
        try:
            import datasets
        except ImportError:
            raise ConfigError("data.source=hub needs the datasets package") from None
        self.cfg = cfg
        self.name = f"hub:{cfg.name}" + (f"/{cfg.config}" if cfg.config else "")
        self._datasets = datasets

    def _load(self, split: str):
        try:
            return self._datasets.load_dataset(
                self.cfg.name, self.cfg.config or None, split=split, streaming=True
            )
        except Exception as e:  # network, missing dataset, bad split: all user input problems
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"cannot open dataset {self.cfg.name!r} split {split!r}: {msg}") from None

    def _texts(self, ds, skip: int = 0) -> Iterator[str]:
        field = self.cfg.text_field
        for i, row in enumerate(ds):
            if i < skip:
                continue
            if field not in row:
                raise ConfigError(f"{self.name}: rows have no field {field!r} (set data.text_field)")
            yield row[field]

    def iter_train(self, start: int) -> Iterator[str]:
        every = self.cfg.val_every
        for i, text in enumerate(self._texts(self._load(self.cfg.split)), 0):
            if i < start:
                continue
            if not self.cfg.val_split and i % every == every - 1:
                yield ""  # held out: keeps the document index aligned, skipped by the stream
                continue
            yield text

    def iter_val(self) -> Iterator[str]:
        if self.cfg.val_split:
            yield from self._texts(self._load(self.cfg.val_split))
            return
        every = self.cfg.val_every
        for i, text in enumerate(self._texts(self._load(self.cfg.split))):
            if i % every == every - 1:
                yield text

    def fingerprint(self) -> str:
        return hashlib.sha256(self.name.encode()).hexdigest()[:16]


def load_corpus(cfg: DataConfig) -> Corpus | HubCorpus:
    if cfg.source == "builtin":
        return Corpus(*_split(builtin_documents(), cfg.val_every), "builtin")
    if cfg.source == "files":
        return Corpus(*_split(file_documents(cfg.path, cfg.text_field), cfg.val_every), f"files:{cfg.path}")
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


def load_tokenizer(cfg: DataConfig, corpus: Corpus | HubCorpus) -> Tokenizer:
    """`builtin-bpe` (trained on the training documents, cached by corpus hash) or any HF name/path."""
    if cfg.tokenizer == "builtin-bpe":
        if isinstance(corpus, HubCorpus):
            raise ConfigError(
                "data.tokenizer=builtin-bpe needs an in-memory corpus; use a HF tokenizer for hub data"
            )
        from tokenizers import Tokenizer as HFTokenizer

        path = cache_dir() / "tokenizers" / f"bpe-{corpus.fingerprint()}-{cfg.vocab_size}.json"
        if not path.is_file():
            log.info(
                "training a %d-token byte-level BPE on %s (cached at %s)", cfg.vocab_size, corpus.name, path
            )
            train_bpe(corpus.train, cfg.vocab_size, path)
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
    Documents come in a seeded permutation per epoch (in-memory corpora), in stream order for hub
    data; the rows cut from them in that order are the *source rows*.

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
    lengths): 2,113,536 bytes at the defaults (P = 4096, seq_len = 128).

    `track_docs` (tests, debugging) records each row's document: `last_docs` holds, after every
    `next_rows`, the document of each row (in pack mode the one that supplies most of its
    tokens); the index in the corpus for in-memory sources, the stream index for hub data. It
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
        self._hub_iter: Iterator[tuple[int, str]] | None = None

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
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(sd["epoch"]), int(sd["cursor"])
        self.buffer = sd["buffer"].tolist()
        flat = sd["pending"].tolist()
        self.pending, i = [], 0
        for n in sd["pending_lengths"].tolist():
            self.pending.append(flat[i : i + n])
            i += n
        self._order, self._hub_iter = None, None
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
        return snap

    def restore(self, snap: dict[str, Any]) -> None:
        hub_stale = self.corpus.streaming and (snap["epoch"], snap["cursor"]) != (self.epoch, self.cursor)
        for k in _STREAM_FIELDS:
            setattr(self, k, snap[k])
        if hub_stale:
            self._hub_iter = None

    # -- documents -----------------------------------------------------------------------------
    def _epoch_order(self) -> list[int]:
        if self._order is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._order = torch.randperm(len(self.corpus.train), generator=g).tolist()
        return self._order

    def _next_docs(self) -> list[tuple[int, str]]:
        """The next chunk of (document index, text), advancing the cursor (wrapping epochs)."""
        if self.corpus.streaming:
            if self._hub_iter is None:
                self._hub_iter = enumerate(self.corpus.iter_train(self.cursor), self.cursor)
            docs = []
            for _ in range(self.chunk):
                try:
                    docs.append(next(self._hub_iter))
                except StopIteration:
                    self.epoch, self.cursor, self._hub_iter = self.epoch + 1, 0, None
                    break
                self.cursor += 1
            return [(i, d) for i, d in docs if d]
        order = self._epoch_order()
        if self.cursor >= len(order):
            self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
            order = self._epoch_order()
        idx = order[self.cursor : self.cursor + self.chunk]
        self.cursor += len(idx)
        return [(i, self.corpus.train[i]) for i in idx]

    def _refill(self) -> None:
        for _attempt in range(10_000):
            docs = self._next_docs()
            if docs:
                encoded = self.tok.encode_batch([text for _, text in docs])
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
    """Global optimizer-step batches from a TokenStream, sliced for one rank.

    The step's global rows are drawn in one call (through the shuffle buffer, if any) whatever
    the number of processes, then sliced: the rows of a step do not depend on the world size."""

    def __init__(
        self,
        stream: TokenStream,
        batch_size: int,
        grad_accum: int,
        rank: int = 0,
        world: int = 1,
        vocab_size: int | None = None,
    ):
        self.stream, self.B, self.K, self.rank, self.world = stream, batch_size, grad_accum, rank, world
        self.vocab_size = vocab_size

    def next_step(self) -> tuple[list[dict[str, torch.Tensor]], int]:
        """This rank's micro-batches for one optimizer step, and the step's global target count."""
        B, W = self.B, self.world
        rows = self.stream.next_rows(self.K * W * B)
        if self.vocab_size is not None and int(rows["input_ids"].max()) >= self.vocab_size:
            raise ConfigError(
                f"token id {int(rows['input_ids'].max())} is beyond the model's vocabulary ({self.vocab_size})"
            )
        total = count_targets(rows["labels"])
        micro = []
        for k in range(self.K):
            lo = (k * W + self.rank) * B
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

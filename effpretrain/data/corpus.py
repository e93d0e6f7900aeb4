"""The one corpus interface (train and held-out documents) and its sources: built-in (in memory), local files and hub datasets (streamed), prepared token shards."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from typing import Any

from effpretrain.config import DataConfig
from effpretrain.data.builtin import builtin_documents
from effpretrain.data.files import held_out, list_shards, shard_records
from effpretrain.data.readers import DocReader, _HubDocs, _LocalShardDocs
from effpretrain.data.tokens import TokenCorpus
from effpretrain.errors import ConfigError

log = logging.getLogger("effpretrain")


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
        return TokenCorpus(cfg)
    return HubCorpus(cfg)

"""`effpretrain prepare`: tokenise a text source once into the shards that `data.source=tokens` reads
(the format is `effpretrain.data.tokens`'s)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from effpretrain.config import DataConfig
from effpretrain.data.builtin import builtin_documents
from effpretrain.data.corpus import load_corpus
from effpretrain.data.files import held_out, list_shards, shard_records
from effpretrain.data.tokenizer import Tokenizer, cache_dir, is_builtin, load_tokenizer
from effpretrain.data.tokens import (
    DEFAULT_SHARD_TOKENS,
    FORMAT,
    MANIFEST,
    TOKENIZER_FILE,
    VERSION,
    token_dtype,
    tokenizer_fingerprint,
)
from effpretrain.errors import ConfigError

_ENCODE_CHUNK = 256


def iter_documents(source: str, text_field: str = "text") -> Iterator[str]:
    """The non-blank documents of SOURCE (`builtin`, or a shard file, folder or glob read by
    `data.list_shards` / `data.shard_records`, the rules of ``data.source=files``) in order, one
    at a time. Bad data raises `ConfigError` naming the file and line."""
    if source == "builtin":
        yield from builtin_documents()
        return
    for f in list_shards(source, "source"):
        for _, text in shard_records(f, text_field):
            if text.strip():
                yield text


# ----------------------------------------------------------------------------------------------
# Writing shards


@dataclass
class _ShardWriter:
    """Appends documents to `<split>-NNNNN.bin/.idx` files, closing a shard at `shard_tokens`."""

    out: Path
    split: str
    dtype: np.dtype
    eos_id: int
    shard_tokens: int
    shards: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    documents: int = 0
    _fh: Any = None
    _offsets: list[int] = field(default_factory=list)

    def add(self, ids: list[int]) -> None:
        if self._fh is None:
            name = f"{self.split}-{len(self.shards):05d}"
            self._fh = (self.out / f"{name}.bin").open("wb")
            self._offsets = [0]
            self.shards.append({"name": name})
        arr = np.asarray(ids + [self.eos_id], dtype=np.int64)
        self._fh.write(arr.astype(self.dtype).tobytes())
        self._offsets.append(self._offsets[-1] + arr.size)
        self.tokens += arr.size
        self.documents += 1
        if self._offsets[-1] >= self.shard_tokens:
            self.close()

    def close(self) -> None:
        if self._fh is None:
            return
        self._fh.close()
        self._fh = None
        name = self.shards[-1]["name"]
        np.asarray(self._offsets, dtype=np.int64).tofile(self.out / f"{name}.idx")
        self.shards[-1].update(tokens=self._offsets[-1], documents=len(self._offsets) - 1)

    def summary(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "documents": self.documents, "shards": self.shards}


def _check_out(out: Path, force: bool) -> None:
    """`out` must be new or empty; with `force`, a non-empty one is reused (see `_clear_out`)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"--out {out} is not empty (pass --force to overwrite a previous prepare)")


def _clear_out(out: Path) -> None:
    """Removes a previous `prepare`'s files (only those: other files in `out` are left alone)."""
    if out.is_dir():
        ours = [out / MANIFEST, out / TOKENIZER_FILE, *out.glob("train-*.*"), *out.glob("val-*.*")]
        for p in ours:
            p.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def _run_tokenizer(source: str, cfg: DataConfig) -> tuple[Tokenizer, dict[str, Any], Path | None]:
    """The run's tokenizer for `cfg` (`data.load_tokenizer`), its manifest entry and, for the
    built-in BPE, its file: trained on the text source's training documents exactly as a run on
    ``data.source=builtin`` / ``files`` with this `data.path` would train it (and cached alike)."""
    corpus = None
    if is_builtin(cfg.tokenizer):
        src = {"source": "builtin"} if source == "builtin" else {"source": "files", "path": source}
        corpus = load_corpus(DataConfig(**{**cfg.__dict__, **src}))
    tok = load_tokenizer(cfg, corpus)
    entry = {
        "spec": cfg.tokenizer,
        "name": tok.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "fingerprint": tokenizer_fingerprint(tok),
    }
    bpe_file = None
    if corpus is not None:
        fp = corpus.fingerprint()
        entry.update(requested_vocab_size=cfg.vocab_size, bpe_corpus=fp, file=TOKENIZER_FILE)
        bpe_file = cache_dir() / "tokenizers" / f"bpe-{fp}-{cfg.vocab_size}.json"
    return tok, entry, bpe_file


def held_out_rule(source: str, every: int) -> tuple[str, Any]:
    """(description, predicate(index, text)) of the held-out documents, the text source's rule:
    `builtin` every `every`-th document, files by text hash."""
    if source == "builtin":
        return (
            f"document i of the source (in order) is held out when i % {every} == {every - 1}",
            lambda i, text: i % every == every - 1,
        )
    return (
        f"a document is held out when blake2b-64(text, little-endian) % {every} == 0",
        lambda i, text: held_out(text, every),
    )


def _progress(docs: int, tokens: int, t0: float, final: bool = False) -> None:
    dt = max(time.perf_counter() - t0, 1e-9)
    end = "\n" if final else "\r"
    print(
        f"prepare: {docs:,} documents, {tokens:,} tokens, {tokens / dt:,.0f} tokens/s",
        end=end,
        file=sys.stderr,
    )


def _write_documents(
    source: str, text_field: str, tok: Tokenizer, writers: dict[str, Any], is_val: Any, progress: bool
) -> int:
    """Tokenises every document, in chunks, into its split's shards (closed at the end); returns
    how many documents were read."""
    t0, last, index = time.perf_counter(), 0.0, 0
    chunk: list[str] = []

    def flush() -> None:
        nonlocal index
        if not chunk:
            return  # HF tokenizers fail on an empty batch
        for text, ids in zip(chunk, tok.encode_batch(chunk)):
            writers["val" if is_val(index, text) else "train"].add(list(ids))
            index += 1
        chunk.clear()

    for doc in iter_documents(source, text_field):
        chunk.append(doc)
        if len(chunk) == _ENCODE_CHUNK:
            flush()
            if progress and time.perf_counter() - last > 2.0:
                last = time.perf_counter()
                _progress(index, writers["train"].tokens + writers["val"].tokens, t0)
    flush()
    for w in writers.values():
        w.close()
    return index


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def prepare(
    source: str,
    out: str | Path,
    tokenizer: str = "builtin-bpe",
    vocab_size: int = 8192,
    text_field: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_every: int = 50,
    force: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenises SOURCE into shards under `out` (module docstring) and returns the manifest.

    Raises:
        ConfigError: a missing or unreadable source, bad data (file and line named), an empty
            corpus, a non-empty `out` without `force`, or a size < 1.
    """
    _check_sizes(shard_tokens=shard_tokens, val_every=val_every, vocab_size=vocab_size)
    if source != "builtin":
        list_shards(source, "source")  # a missing source is refused before any tokenizer work
    out = Path(out).expanduser()
    _check_out(out, force)
    cfg = DataConfig(text_field=text_field, tokenizer=tokenizer, vocab_size=vocab_size, val_every=val_every)
    tok, tok_entry, bpe_file = _run_tokenizer(source, cfg)
    _clear_out(out)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: _ShardWriter(out, s, dtype, tok.eos_id, shard_tokens) for s in ("train", "val")}
    rule, is_val = held_out_rule(source, val_every)
    t0 = time.perf_counter()
    index = _write_documents(source, text_field, tok, writers, is_val, progress)
    if not writers["train"].documents:
        raise ConfigError(f"{source}: the corpus is empty (no non-blank documents)")
    if not writers["val"].documents:
        raise ConfigError(
            f"{source}: too few documents ({index}) to hold out one in {val_every} (set --val-every)"
        )
    if bpe_file is not None:
        tmp = out / f"{TOKENIZER_FILE}.tmp"
        tmp.write_bytes(bpe_file.read_bytes())
        os.replace(tmp, out / TOKENIZER_FILE)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "source": source,
        "tokenizer": tok_entry,
        "dtype": dtype.name,
        "eos_between_documents": True,
        "held_out": {
            "rule": rule,
            "val_every": val_every,
        },
        "shard_tokens": shard_tokens,
        "splits": {s: w.summary() for s, w in writers.items()},
    }
    tmp = out / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)  # last: a folder without a manifest is an unfinished prepare
    if progress:
        _progress(index, writers["train"].tokens + writers["val"].tokens, t0, final=True)
    return manifest


# ----------------------------------------------------------------------------------------------
# Reading shards

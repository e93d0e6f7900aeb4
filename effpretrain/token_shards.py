"""Pre-tokenised shards: `effpretrain prepare` writes them, `data.source=tokens` reads them.

Users who train several methods on the same data tokenise it once (as nanoGPT and litgpt do):

    effpretrain prepare SOURCE --out DIR [--tokenizer NAME] [--text-field F]
                       [--shard-tokens N] [--val-every N]

SOURCE is ``builtin`` (the built-in corpus), a ``.txt`` / ``.jsonl`` / ``.jsonl.gz`` /
``.parquet`` file, a folder of them, or a glob. Documents are read one at a time (never the whole
corpus in memory) by the same rules as ``data.source=files`` (a ``.txt`` file is cut into
paragraph documents; blank documents are dropped), and document i of the source (in sorted file
order) is held out when ``i % val_every == val_every - 1``, the rule of the text sources: the
held-out set is fixed when the shards are written, so it is the same for any number of processes.

Layout of DIR:

- ``train-NNNNN.bin`` / ``val-NNNNN.bin``: flat token ids, ``uint16`` when every id fits
  (vocabulary <= 65536), else ``uint32``; each document's ids are followed by the EOS id. A
  document never straddles two shards; a shard is closed once it holds ``--shard-tokens`` tokens.
- ``train-NNNNN.idx`` / ``val-NNNNN.idx``: ``int64`` document offsets o_0 = 0 < o_1 < ... < o_n:
  document d of the shard is ``bin[o_d : o_{d+1} - 1]`` (its EOS at ``o_{d+1} - 1``), so the
  truncate mode and per-document order work without scanning for EOS.
- ``tokenizer.json``: the built-in BPE, when the shards were made with it.
- ``manifest.json`` (written last: a folder without it is an unfinished `prepare`): format and
  version, the tokenizer (its `data.tokenizer` spec, name, vocabulary size, EOS/pad ids and a
  fingerprint), the dtype, the held-out rule, and per split its shards with their token and
  document counts.

Reading (`TokenCorpus`): the shards are memory-mapped (``numpy.memmap``); documents come out as
lists of ids without their EOS (the stream adds it back, as for text), so a run on the shards
draws exactly the rows that the same documents in the same order give through the text path.
Training order, epoch e, seed s = ``data.shuffle_seed``: the train shards in a permutation
drawn from (s, e), and inside each shard its documents in a permutation drawn from (s, e, shard).
The position is one integer, the number of documents read across epochs, c = e N + j (N train
documents): seeking to it costs one pass over the shard sizes and one permutation of one shard,
whatever c is.
"""

from __future__ import annotations

import glob as globlib
import gzip
import hashlib
import json
import os
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from effpretrain import data
from effpretrain.config import DataConfig
from effpretrain.errors import ConfigError

FORMAT = "effpretrain-tokens"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
DEFAULT_SHARD_TOKENS = 100_000_000
_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
_ENCODE_CHUNK = 256
# Text that exercises words, code, digits, whitespace runs and non-ASCII: two tokenizers that
# encode it alike and share vocabulary size and special ids are taken to be the same.
_PROBE = (
    "The quick brown fox jumps over the lazy dog. 0123456789 3.14159\n"
    "def f(x):\n\treturn x ** 2  # square\n\n"
    "Größe, naïve café, Ελληνικά, 日本語のテキスト, emoji 🙂 — “quotes” and   spaces.\n"
)


def tokenizer_fingerprint(tok: data.Tokenizer) -> str:
    """sha256 (16 hex digits) of the vocabulary size, EOS and pad ids and the probe text's ids."""
    ids = tok.encode_batch([_PROBE])[0]
    text = json.dumps([tok.vocab_size, tok.eos_id, tok.pad_id, list(map(int, ids))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (< vocab_size) fits in 16 bits, else uint32."""
    return np.dtype(np.uint16 if vocab_size - 1 <= np.iinfo(np.uint16).max else np.uint32)


# ----------------------------------------------------------------------------------------------
# Reading documents, one at a time


def source_files(source: str) -> list[Path]:
    """The files of a SOURCE path: the file itself, a folder's files (recursive), or a glob's,
    in sorted order; only the suffixes `data.source=files` reads."""
    if any(c in source for c in "*?["):
        files = sorted(Path(p) for p in globlib.glob(os.path.expanduser(source), recursive=True))
        files = [f for f in files if f.is_file() and f.name.endswith(_SUFFIXES)]
        if not files:
            raise ConfigError(f"{source}: the glob matches no {', '.join(_SUFFIXES)} files")
        return files
    p = Path(source).expanduser()
    if not p.exists():
        raise ConfigError(f"source not found: {source}")
    if p.is_dir():
        files = sorted(q for q in p.rglob("*") if q.is_file() and q.name.endswith(_SUFFIXES))
        if not files:
            raise ConfigError(f"{source}: no {', '.join(_SUFFIXES)} files in this folder")
        return files
    if not p.name.endswith(_SUFFIXES):
        raise ConfigError(f"{source}: unsupported file type (use {', '.join(_SUFFIXES)})")
    return [p]


def _txt_documents(path: Path, max_chars: int = 4000) -> Iterator[str]:
    """`data._txt_documents`' paragraph documents, read in 1 MiB pieces instead of whole."""
    cur, tail = "", ""
    with path.open(encoding="utf-8", errors="replace") as fh:
        while True:
            piece = fh.read(1 << 20)
            paras = (tail + piece).split("\n\n")
            tail = paras.pop() if piece else ""
            for para in paras:
                if not para.strip():
                    continue
                if cur and len(cur) + len(para) > max_chars:
                    yield cur
                    cur = ""
                cur = f"{cur}\n\n{para}" if cur else para
            if not piece:
                break
    if cur.strip():
        yield cur


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    """One document per JSON line (gzip when the name ends in .gz); errors name file and line."""
    opener = gzip.open if path.name.endswith(".gz") else open
    lineno = 0
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    raise ConfigError(f"{path}:{lineno}: not valid JSON") from None
                if not isinstance(obj, dict) or text_field not in obj:
                    raise ConfigError(f"{path}:{lineno}: no text field {text_field!r} (use --text-field)")
                if not isinstance(obj[text_field], str):
                    raise ConfigError(f"{path}:{lineno}: field {text_field!r} is not a string")
                if obj[text_field].strip():
                    yield obj[text_field]
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}:{lineno + 1}: unreadable ({type(e).__name__}: {e})") from None


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("reading .parquet needs pyarrow: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise ConfigError(f"{path}: not a readable parquet file ({type(e).__name__})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise ConfigError(f"{path}: no column {text_field!r} (columns: {', '.join(names)})")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for t in batch.column(0).to_pylist():
            if isinstance(t, str) and t.strip():
                yield t


def iter_documents(source: str, text_field: str = "text") -> Iterator[str]:
    """The documents of SOURCE (`builtin` or a path/folder/glob) in order, one at a time."""
    if source == "builtin":
        yield from data.builtin_documents()
        return
    for f in source_files(source):
        if f.name.endswith(".txt"):
            yield from _txt_documents(f)
        elif f.name.endswith(".parquet"):
            yield from _parquet_documents(f, text_field)
        else:
            yield from _jsonl_documents(f, text_field)


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


def _run_tokenizer(source: str, cfg: DataConfig) -> tuple[data.Tokenizer, dict[str, Any], Path | None]:
    """The run's tokenizer for `cfg` (`data.load_tokenizer`), its manifest entry and, for the
    built-in BPE, its file. The BPE is trained on the source's training documents and cached by
    their hash, as a run on the text source does; that training holds the documents in memory
    (the built-in BPE is meant for small corpora: use a HF tokenizer for large ones)."""
    corpus = None
    if cfg.tokenizer == "builtin-bpe":
        docs = list(iter_documents(source, cfg.text_field))
        if not docs:
            raise ConfigError(f"{source}: the corpus is empty (no non-blank documents)")
        corpus = data.Corpus(*data._split(docs, cfg.val_every), source)
        del docs
    tok = data.load_tokenizer(cfg, corpus)
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
        bpe_file = data.cache_dir() / "tokenizers" / f"bpe-{fp}-{cfg.vocab_size}.json"
    return tok, entry, bpe_file


def _progress(docs: int, tokens: int, t0: float, final: bool = False) -> None:
    dt = max(time.perf_counter() - t0, 1e-9)
    end = "\n" if final else "\r"
    print(
        f"prepare: {docs:,} documents, {tokens:,} tokens, {tokens / dt:,.0f} tokens/s",
        end=end,
        file=sys.stderr,
    )


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
    for flag, value in (
        ("--shard-tokens", shard_tokens),
        ("--val-every", val_every),
        ("--vocab-size", vocab_size),
    ):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if source != "builtin":
        source_files(source)  # a missing source is refused before any tokenizer work
    out = Path(out).expanduser()
    _check_out(out, force)
    cfg = DataConfig(text_field=text_field, tokenizer=tokenizer, vocab_size=vocab_size, val_every=val_every)
    tok, tok_entry, bpe_file = _run_tokenizer(source, cfg)
    _clear_out(out)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: _ShardWriter(out, s, dtype, tok.eos_id, shard_tokens) for s in ("train", "val")}
    t0, last, index = time.perf_counter(), 0.0, 0
    chunk: list[str] = []

    def flush() -> None:
        nonlocal index
        for ids in tok.encode_batch(chunk):
            split = "val" if index % val_every == val_every - 1 else "train"
            writers[split].add(list(ids))
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
    if not writers["train"].documents:
        raise ConfigError(f"{source}: the corpus is empty (no non-blank documents)")
    if not writers["val"].documents:
        raise ConfigError(
            f"{source}: too few documents ({index}) to hold out every {val_every}th (set --val-every)"
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
            "rule": "document i of the source (in order) is held out when i % val_every == val_every - 1",
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


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a prepared folder, checked against the files beside it."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(
            f"data.path {path}: not a folder (data.source=tokens reads an `effpretrain prepare` --out)"
        )
    mf = root / MANIFEST
    if not mf.is_file():
        raise ConfigError(
            f"data.path {path}: no {MANIFEST} (not a prepared folder, or prepare did not finish)"
        )
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{mf}: not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"{mf}: not an {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise ConfigError(
            f"{mf}: format version {manifest.get('version')!r}, this effpretrain reads {VERSION}"
        )
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in ("train", "val"):
        for shard in manifest["splits"][split]["shards"]:
            b, i = root / f"{shard['name']}.bin", root / f"{shard['name']}.idx"
            if not b.is_file() or not i.is_file():
                raise ConfigError(f"{root}: shard {shard['name']} is missing (.bin or .idx)")
            if (
                b.stat().st_size != shard["tokens"] * itemsize
                or i.stat().st_size != (shard["documents"] + 1) * 8
            ):
                raise ConfigError(
                    f"{root}: shard {shard['name']} does not have the manifest's size (truncated?)"
                )
    return manifest


def _seed(*parts: int) -> int:
    """A 63-bit generator seed for one permutation, unrelated to the stream's other seeds."""
    digest = hashlib.blake2b(("tokens:" + ":".join(map(str, parts))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _permutation(n: int, *parts: int) -> np.ndarray:
    return np.random.Generator(np.random.PCG64(_seed(*parts))).permutation(n)


class TokenCorpus:
    """Documents (lists of token ids) from `effpretrain prepare` shards (`data.source=tokens`).

    A streaming corpus (``streaming = True``): `iter_train(start)` is the endless training stream
    from position `start` (documents read across epochs; module docstring), `iter_val()` the
    held-out documents in source order. The run's tokenizer must be the one the shards were made
    with: `data.tokenizer` (and `data.vocab_size` for the built-in BPE) must name it, and the
    loaded tokenizer must encode the probe text alike (`tokenizer_fingerprint`).
    """

    streaming = True

    def __init__(self, cfg: DataConfig):
        if not cfg.path:
            raise ConfigError(
                "data.path is required when data.source=tokens (the folder `effpretrain prepare` wrote)"
            )
        self.root = Path(cfg.path).expanduser()
        self.manifest = read_manifest(self.root)
        self.name = f"tokens:{cfg.path}"
        self.seed = cfg.shuffle_seed
        self.dtype = np.dtype(self.manifest["dtype"])
        self.train_shards = self.manifest["splits"]["train"]["shards"]
        self.val_shards = self.manifest["splits"]["val"]["shards"]
        self.n_train = sum(s["documents"] for s in self.train_shards)
        self._check_tokenizer(cfg)

    def _check_tokenizer(self, cfg: DataConfig) -> None:
        want = self.manifest["tokenizer"]
        bpe = want["spec"] == "builtin-bpe"
        made = f"builtin-bpe with vocab_size {want.get('requested_vocab_size')}" if bpe else want["spec"]
        if (cfg.tokenizer == "builtin-bpe") != bpe or (
            bpe and cfg.vocab_size != want["requested_vocab_size"]
        ):
            fix = (
                f"data.tokenizer=builtin-bpe data.vocab_size={want['requested_vocab_size']}"
                if bpe
                else (f"data.tokenizer={want['spec']}")
            )
            raise ConfigError(f"{self.name}: the shards were made with the tokenizer {made}; set {fix}")
        if bpe:
            self._install_bpe(cfg)
        tok = data.load_tokenizer(cfg, self)
        got = tokenizer_fingerprint(tok)
        if got != want["fingerprint"]:
            raise ConfigError(
                f"{self.name}: the tokenizer {cfg.tokenizer} (fingerprint {got}) is not the {made} the shards "
                f"were made with (fingerprint {want['fingerprint']})"
            )

    def _install_bpe(self, cfg: DataConfig) -> None:
        """Puts the shards' BPE where data.load_tokenizer looks for it (keyed by `fingerprint()`)."""
        src = self.root / TOKENIZER_FILE
        dst = data.cache_dir() / "tokenizers" / f"bpe-{self.fingerprint()}-{cfg.vocab_size}.json"
        if dst.is_file():
            return
        if not src.is_file():
            raise ConfigError(
                f"{self.name}: {TOKENIZER_FILE} is missing (the built-in BPE the shards were made with)"
            )
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(src.read_bytes())
        os.replace(tmp, dst)

    def fingerprint(self) -> str:
        """The text corpus the built-in BPE was trained on (its tokenizer cache key), else the
        manifest's hash."""
        tok = self.manifest["tokenizer"]
        if "bpe_corpus" in tok:
            return tok["bpe_corpus"]
        return hashlib.sha256(json.dumps(self.manifest, sort_keys=True).encode()).hexdigest()[:16]

    def _open(self, shard: dict[str, Any]) -> tuple[np.memmap, np.memmap]:
        name = shard["name"]
        ids = np.memmap(self.root / f"{name}.bin", dtype=self.dtype, mode="r")
        offsets = np.memmap(self.root / f"{name}.idx", dtype=np.int64, mode="r")
        return ids, offsets

    def _shard_docs(self, shard: dict[str, Any], order: np.ndarray | None, start: int) -> Iterator[list[int]]:
        """The shard's documents (without EOS) from position `start` of `order` (None: in order)."""
        ids, offsets = self._open(shard)
        n = shard["documents"]
        for j in range(start, n):
            d = j if order is None else int(order[j])
            yield ids[int(offsets[d]) : int(offsets[d + 1]) - 1].tolist()

    def iter_train(self, start: int = 0) -> Iterator[list[int]]:
        """Training documents from position `start` (documents read across epochs), endless."""
        epoch, j = divmod(int(start), self.n_train)
        while True:
            shard_order = _permutation(len(self.train_shards), self.seed, epoch)
            for k in shard_order.tolist():
                shard = self.train_shards[k]
                if j >= shard["documents"]:
                    j -= shard["documents"]
                    continue
                doc_order = _permutation(shard["documents"], self.seed, epoch, k)
                yield from self._shard_docs(shard, doc_order, j)
                j = 0
            epoch += 1

    def iter_val(self) -> Iterator[list[int]]:
        """The held-out documents in source order."""
        for shard in self.val_shards:
            yield from self._shard_docs(shard, None, 0)

"""Local shards (``data.source=files``): .txt, .jsonl, .jsonl.gz / .json.gz and .parquet files, read record by record, never a whole corpus in memory; the held-out rule."""

from __future__ import annotations

import glob as globmod
import gzip
import hashlib
import json
import logging
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

from effpretrain.errors import ConfigError

log = logging.getLogger("effpretrain")


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

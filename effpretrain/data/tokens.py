"""Pre-tokenised shards: `effpretrain prepare` writes them, `data.source=tokens` reads them.

Users who train several methods on the same data tokenise it once (as nanoGPT and litgpt do):

    effpretrain prepare SOURCE --out DIR [--tokenizer NAME] [--text-field F]
                       [--shard-tokens N] [--val-every N]

SOURCE is ``builtin`` (the built-in corpus), a ``.txt`` / ``.jsonl`` / ``.jsonl.gz`` (``.json.gz``)
/ ``.parquet`` file, a folder of them, or a glob. Documents are read one at a time (never the
whole corpus in memory) by ``data.source=files``' own readers (`data.list_shards`,
`data.shard_records`: a ``.txt`` file is cut into paragraph documents, blank documents are
dropped, bad data names its file and line), in sorted file order, and held out by the text
source's rule (`held_out_rule`): every ``val_every``-th document of ``builtin``, and for files
`data.held_out` (the documents whose text hash is 0 mod ``val_every``). The held-out set is fixed when the shards are
written: the same for any seed and any number of processes. The tokenizer is the run's
(`data.load_tokenizer`): the built-in BPE is trained as a run on the text source would train it.

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

Reading (`TokenCorpus`): the shards are memory-mapped (``numpy.memmap``, one shard open at a
time); documents come out as lists of ids without their EOS (the stream adds it back, as for
text), so a run on the shards draws exactly the rows that the same documents in the same order
give through the text path. Training order, epoch e, seed s = ``data.shuffle_seed``: the train
shards in a permutation drawn from (s, e), and inside each shard its documents in a permutation
drawn from (s, e, shard); position p = e N + j (N train documents) is place j of epoch e. A
process reads positions 0, 1, 2, ...; rank r of W reads r, r + W, r + 2W, ... (its own documents,
all of them once per epoch between the ranks). The position is one count, and seeking to it
costs one permutation of the shard list and one of a shard, whatever the step.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from effpretrain.config import DataConfig
from effpretrain.data.readers import DocPosition
from effpretrain.data.tokenizer import Tokenizer, cache_dir, is_builtin, load_tokenizer
from effpretrain.errors import ConfigError

FORMAT = "effpretrain-tokens"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
DEFAULT_SHARD_TOKENS = 100_000_000
_ENCODE_CHUNK = 256
# Text that exercises words, code, digits, whitespace runs and non-ASCII: two tokenizers that
# encode it alike and share vocabulary size and special ids are taken to be the same.
_PROBE = (
    "The quick brown fox jumps over the lazy dog. 0123456789 3.14159\n"
    "def f(x):\n\treturn x ** 2  # square\n\n"
    "Größe, naïve café, Ελληνικά, 日本語のテキスト, emoji 🙂 — “quotes” and   spaces.\n"
)


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    """sha256 (16 hex digits) of the vocabulary size, EOS and pad ids and the probe text's ids."""
    ids = tok.encode_batch([_PROBE])[0]
    text = json.dumps([tok.vocab_size, tok.eos_id, tok.pad_id, list(map(int, ids))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (< vocab_size) fits in 16 bits, else uint32."""
    return np.dtype(np.uint16 if vocab_size - 1 <= np.iinfo(np.uint16).max else np.uint32)


# ----------------------------------------------------------------------------------------------
# Reading documents, one at a time


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

    A streaming corpus (``streaming = True``). Training documents sit at positions p = 0, 1, ...
    across epochs: epoch e = p // N, place j = p % N in that epoch's order (module docstring).
    `iter_train(start)` yields positions start, start + 1, ... (one endless stream: every epoch
    reshuffled); `reader(rank, world, ...)` gives rank r of W positions r, r + W, r + 2W, ...:
    each rank reads its own documents, together every document once per epoch, and its state is
    one count. `iter_val()` yields the held-out documents in source order.

    The run's tokenizer must be the one the shards were made with: `data.tokenizer` (and
    `data.vocab_size` for the built-in BPE) must name it, and the loaded tokenizer must encode
    the probe text alike (`tokenizer_fingerprint`).
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
        if is_builtin(cfg.tokenizer) != bpe or (bpe and cfg.vocab_size != want["requested_vocab_size"]):
            fix = (
                f"data.tokenizer=builtin-bpe data.vocab_size={want['requested_vocab_size']}"
                if bpe
                else (f"data.tokenizer={want['spec']}")
            )
            raise ConfigError(f"{self.name}: the shards were made with the tokenizer {made}; set {fix}")
        if bpe:
            self._install_bpe(cfg)
        tok = load_tokenizer(cfg, self)
        got = tokenizer_fingerprint(tok)
        if got != want["fingerprint"]:
            raise ConfigError(
                f"{self.name}: the tokenizer {cfg.tokenizer} (fingerprint {got}) is not the {made} the shards "
                f"were made with (fingerprint {want['fingerprint']})"
            )

    def _install_bpe(self, cfg: DataConfig) -> None:
        """Puts the shards' BPE where load_tokenizer looks for it (keyed by `fingerprint()`)."""
        src = self.root / TOKENIZER_FILE
        dst = cache_dir() / "tokenizers" / f"bpe-{self.fingerprint()}-{cfg.vocab_size}.json"
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

    def tokenizer_sample(self) -> list[str]:
        """The text a built-in BPE would train on: none here. `_install_bpe` has put the shards'
        BPE in the cache before `data.load_tokenizer` looks, so this is reached only if the cache
        lost it in between."""
        raise ConfigError(f"{self.name}: the shards' built-in BPE vanished from the tokenizer cache; retry")

    def fingerprint(self) -> str:
        """The built-in BPE's cache key (the hash of the text it was trained on), else the
        manifest's hash."""
        tok = self.manifest["tokenizer"]
        if "bpe_corpus" in tok:
            return tok["bpe_corpus"]
        return hashlib.sha256(json.dumps(self.manifest, sort_keys=True).encode()).hexdigest()[:16]

    def _open(self, split: str, k: int) -> tuple[np.memmap, np.memmap]:
        name = self.manifest["splits"][split]["shards"][k]["name"]
        ids = np.memmap(self.root / f"{name}.bin", dtype=self.dtype, mode="r")
        offsets = np.memmap(self.root / f"{name}.idx", dtype=np.int64, mode="r")
        return ids, offsets

    def positions(
        self, start: int, step: int = 1, seed: int | None = None
    ) -> Iterator[tuple[int, list[int]]]:
        """(document id, ids without EOS) at training positions start, start + step, ... (endless).

        The document id is ``shard << 32 | index in the shard``. Seeking to `start` costs one
        permutation of the shard sizes and one of the shard holding it, whatever `start` is."""
        seed = self.seed if seed is None else seed
        sizes = np.array([s["documents"] for s in self.train_shards], dtype=np.int64)
        p, cached = int(start), (None, None)  # (epoch, shard order, cumulative ends), (epoch, shard, ...)
        while True:
            epoch, j = divmod(p, self.n_train)
            if cached[0] is None or cached[0][0] != epoch:
                order = _permutation(len(sizes), seed, epoch)
                cached = ((epoch, order, np.cumsum(sizes[order])), None)
            _, order, ends = cached[0]
            i = int(np.searchsorted(ends, j, side="right"))
            k = int(order[i])
            if cached[1] is None or cached[1][:2] != (epoch, k):
                ids, offsets = self._open("train", k)
                cached = (cached[0], (epoch, k, _permutation(int(sizes[k]), seed, epoch, k), ids, offsets))
            _, _, doc_order, ids, offsets = cached[1]
            d = int(doc_order[j - (int(ends[i - 1]) if i else 0)])
            yield (k << 32) | d, ids[int(offsets[d]) : int(offsets[d + 1]) - 1].tolist()
            p += step

    def iter_train(self, start: int = 0) -> Iterator[list[int]]:
        """Training documents from position `start` (documents read across epochs), endless."""
        for _, doc in self.positions(start):
            yield doc

    def reader(self, rank: int, world: int, seed: int, doc_buffer: int = 0) -> TokenReader:
        """Rank `rank` of `world`'s documents (class docstring). `doc_buffer` is not used: the
        documents are already in a seeded order (a permutation inside each shard)."""
        return TokenReader(self, rank, world, seed)

    def iter_val(self) -> Iterator[list[int]]:
        """The held-out documents in source order."""
        for k, shard in enumerate(self.val_shards):
            ids, offsets = self._open("val", k)
            for d in range(shard["documents"]):
                yield ids[int(offsets[d]) : int(offsets[d + 1]) - 1].tolist()


class TokenReader(DocPosition):
    """One rank's training documents of a `TokenCorpus`: positions r, r + W, r + 2W, ...

    Its state is the count of documents it has read, c (next position c W + r): restoring it
    costs what opening the stream costs. `next_doc()` gives (document id, ids without EOS)."""

    def __init__(self, corpus: TokenCorpus, rank: int, world: int, seed: int):
        self.corpus, self.rank, self.world, self.seed = corpus, rank, world, seed
        self.count = 0
        self._it: Iterator[tuple[int, list[int]]] | None = None

    def next_doc(self) -> tuple[int, list[int]]:
        if self._it is None:
            self._it = self.corpus.positions(self.count * self.world + self.rank, self.world, self.seed)
        self.count += 1
        return next(self._it)

    def state_dict(self, snap: dict[str, int] | None = None) -> dict[str, int]:
        """The position (or that of `snap`, a `snapshot()`, as a prefetching stream saves it)."""
        return {"count": self.count} if snap is None else dict(snap)

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.count, self._it = int(sd["count"]), None

"""Tokenizers: the built-in byte-level BPE (trained on the corpus and cached) and any HF tokenizer, behind the few things the stream needs."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effpretrain.config import DataConfig
from effpretrain.errors import ConfigError

if TYPE_CHECKING:
    from effpretrain.data.corpus import Corpus, HubCorpus, ShardedFiles

log = logging.getLogger("effpretrain")

BUILTIN = "builtin-bpe"


def is_builtin(name: str) -> bool:
    """Whether `data.tokenizer` names the built-in BPE: ``builtin-bpe``, or ``auto`` where no run
    config resolved it (a `DataConfig` used on its own has no `model.init`, whose tokenizer
    ``auto`` would mean; `effpretrain.config.validate` resolves it for a run)."""
    return name in (BUILTIN, "auto")


EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


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
    if is_builtin(cfg.tokenizer):
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

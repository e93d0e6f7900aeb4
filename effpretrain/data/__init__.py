"""Corpus sources, tokenizers, and resumable batching: one module per source behind one corpus
interface (`corpus`), the readers, the token stream and its batches.

Three sources:

- ``builtin`` (`Corpus`, in memory): the Python standard library's own ``.py`` sources plus the
  pydoc topics text, shipped with every interpreter (~12 MB), test folders excluded, sorted
  paths. No download.
- ``files`` (`ShardedFiles`, streamed): local shards, ``.txt`` (split into paragraph documents),
  ``.jsonl`` / ``.jsonl.gz`` / ``.json.gz`` (one document per line, ``data.text_field``) or
  ``.parquet`` (one document per row); a file, a folder or a glob of them.
- ``hub`` (`HubCorpus`, streamed): any HF dataset (name, config, split); ``data.name`` may also be
  a local dataset folder. C4 (``allenai/c4``, ``en``) is the paper's.
- ``tokens`` (`effpretrain.data.tokens.TokenCorpus`): shards that ``effpretrain prepare``
  (`effpretrain.data.prepare_tokens`) tokenised once.

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

from effpretrain.data.batches import Batches, count_targets
from effpretrain.data.builtin import builtin_documents
from effpretrain.data.corpus import Corpus, HubCorpus, ShardedFiles, load_corpus
from effpretrain.data.files import file_documents, held_out, list_shards, shard_kind, shard_records
from effpretrain.data.readers import DocPosition, DocReader, Prefetcher
from effpretrain.data.stream import IGNORE_INDEX, TokenStream
from effpretrain.data.tokenizer import EOS_TOKEN, PAD_TOKEN, Tokenizer, cache_dir, load_tokenizer, train_bpe
from effpretrain.data.validation import ValidationSet, validation_set

__all__ = [
    "EOS_TOKEN",
    "IGNORE_INDEX",
    "PAD_TOKEN",
    "Batches",
    "Corpus",
    "DocPosition",
    "DocReader",
    "HubCorpus",
    "Prefetcher",
    "ShardedFiles",
    "TokenStream",
    "Tokenizer",
    "ValidationSet",
    "builtin_documents",
    "cache_dir",
    "count_targets",
    "file_documents",
    "held_out",
    "list_shards",
    "load_corpus",
    "load_tokenizer",
    "shard_kind",
    "shard_records",
    "train_bpe",
    "validation_set",
]

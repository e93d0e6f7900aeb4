"""Data claims: sources, deterministic held-out split, exact stream position, rank slicing."""

from __future__ import annotations

import json

import pytest
import torch

from effpretrain import data
from effpretrain.config import ConfigError, DataConfig


@pytest.fixture(scope="module")
def builtin():
    cfg = DataConfig(vocab_size=512)
    corpus = data.load_corpus(cfg)
    return cfg, corpus, data.load_tokenizer(cfg, corpus)


def test_builtin_corpus_is_stdlib_without_tests(builtin):
    _, corpus, _ = builtin
    docs = data.builtin_documents()
    assert len(docs) > 500 and sum(map(len, docs)) > 5_000_000
    assert docs == data.builtin_documents()  # deterministic order
    assert not any(d.lstrip().startswith("import unittest\n\nfrom test") for d in docs)
    assert len(corpus.val) == len(docs) // 50 and len(corpus.train) + len(corpus.val) == len(docs)
    assert not set(corpus.val) & set(corpus.train[:100])


def test_builtin_bpe_cached_by_corpus_hash(builtin, tmp_path):
    cfg, corpus, tok = builtin
    assert tok.vocab_size == 512 and tok.eos_id != tok.pad_id
    again = data.load_tokenizer(cfg, corpus)  # second load comes from the cache
    assert again.encode_batch(["def f(x):\n    return x\n"]) == tok.encode_batch(
        ["def f(x):\n    return x\n"]
    )
    cached = list((data.cache_dir() / "tokenizers").glob(f"bpe-{corpus.fingerprint()}-512.json"))
    assert len(cached) == 1


def _take(stream, n_steps, rows):
    return [stream.next_rows(rows)["input_ids"] for _ in range(n_steps)]


@pytest.mark.parametrize("mode", ["pack", "truncate"])
def test_stream_state_resumes_exactly(builtin, mode):
    _, corpus, tok = builtin
    straight = data.TokenStream(corpus, tok, 32, mode, seed=1)
    ref = _take(straight, 12, 8)
    first = data.TokenStream(corpus, tok, 32, mode, seed=1)
    head = _take(first, 5, 8)
    state = first.state_dict()
    resumed = data.TokenStream(corpus, tok, 32, mode, seed=1)
    resumed.load_state_dict(state)
    tail = _take(resumed, 7, 8)
    assert all(torch.equal(a, b) for a, b in zip(ref, head + tail))


def test_truncate_pads_and_ignores_pad_labels(builtin):
    _, corpus, tok = builtin
    rows = data.TokenStream(corpus, tok, 4096, "truncate", seed=0).next_rows(8)
    pad = rows["attention_mask"] == 0
    assert pad.any(), "some stdlib module is shorter than 4096 tokens"
    assert (rows["labels"][pad] == data.IGNORE_INDEX).all()
    assert (rows["labels"][~pad] == rows["input_ids"][~pad]).all()


def test_two_ranks_see_the_rows_of_one_rank_at_double_batch(builtin):
    _, corpus, tok = builtin
    one = data.Batches(data.TokenStream(corpus, tok, 32, "pack", 0), 8, 2)
    r0 = data.Batches(data.TokenStream(corpus, tok, 32, "pack", 0), 4, 2, rank=0, world=2)
    r1 = data.Batches(data.TokenStream(corpus, tok, 32, "pack", 0), 4, 2, rank=1, world=2)
    for _ in range(3):
        (m1, n1), (a, na), (b, nb) = one.next_step(), r0.next_step(), r1.next_step()
        assert n1 == na == nb
        for k in range(2):
            assert torch.equal(m1[k]["input_ids"], torch.cat([a[k]["input_ids"], b[k]["input_ids"]]))


def test_files_source_txt_jsonl_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("\n\n".join(f"paragraph {i} " * 20 for i in range(60)))
    with open(tmp_path / "b.jsonl", "w") as fh:
        for i in range(30):
            fh.write(json.dumps({"text": f"json document {i}", "id": i}) + "\n")
    pq.write_table(pa.table({"text": [f"parquet row {i}" for i in range(20)]}), tmp_path / "c.parquet")
    docs = data.file_documents(str(tmp_path))
    assert any(d.startswith("paragraph 0") for d in docs)
    assert "json document 3" in docs and "parquet row 19" in docs
    assert data.file_documents(str(tmp_path / "b.jsonl")) == [f"json document {i}" for i in range(30)]


@pytest.mark.parametrize(
    "setup, needle",
    [
        (lambda p: (p / "e.txt").write_text("   \n\n  "), "corpus is empty"),
        (lambda p: (p / "e.jsonl").write_text('{"txt": "x"}\n'), "no text field 'text'"),
        (lambda p: (p / "e.jsonl").write_text("{not json\n"), "not valid JSON"),
        (lambda p: (p / "e.parquet").write_bytes(b"PAR1garbage"), "not a readable parquet"),
        (lambda p: (p / "e.csv").write_text("a,b\n"), "unsupported file type"),
    ],
)
def test_bad_files_are_config_errors(tmp_path, setup, needle):
    setup(tmp_path)
    target = next(tmp_path.iterdir())
    with pytest.raises(ConfigError, match=needle):
        data.file_documents(str(target))


def test_hub_source_streams_a_local_dataset_offline(tmp_path, builtin):
    """The hub path is the real `datasets.load_dataset(..., streaming=True)`; a local folder
    stands in for a hub name here since this machine has no hub access."""
    _, _, tok = builtin
    folder = tmp_path / "ds"
    folder.mkdir()
    with open(folder / "train.jsonl", "w") as fh:
        for i in range(200):
            fh.write(json.dumps({"text": f"hub document number {i} " * 5}) + "\n")
    cfg = DataConfig(source="hub", name=str(folder), split="train", tokenizer="builtin-bpe", val_every=10)
    corpus = data.load_corpus(cfg)
    assert corpus.streaming
    val = list(corpus.iter_val())
    assert len(val) == 20 and val[0].startswith("hub document number 9 ")
    straight = data.TokenStream(corpus, tok, 16, "pack", 0, chunk=4)
    ref = _take(straight, 6, 4)
    first = data.TokenStream(corpus, tok, 16, "pack", 0, chunk=4)
    head = _take(first, 2, 4)
    resumed = data.TokenStream(corpus, tok, 16, "pack", 0, chunk=4)
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(ref, head + _take(resumed, 4, 4)))
    with pytest.raises(ConfigError, match="builtin-bpe needs an in-memory corpus"):
        data.load_tokenizer(cfg, corpus)

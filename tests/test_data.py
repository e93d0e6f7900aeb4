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
    docs = [f"hub document number {i} " * 5 for i in range(200)]
    with open(folder / "train.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    cfg = DataConfig(source="hub", name=str(folder), split="train", tokenizer="builtin-bpe", val_every=10)
    corpus = data.load_corpus(cfg)
    assert corpus.streaming
    val = list(corpus.iter_val())  # the held-out documents (one in 10 by text hash), in file order
    assert val == [d for d in docs if data.held_out(d, 10)] and 10 <= len(val) <= 30
    for buffer in (0, 8):  # in stream order, and through a shuffle buffer
        straight = data.TokenStream(corpus, tok, 16, "pack", 0, chunk=4, shuffle_buffer=buffer)
        ref = _take(straight, 6, 4)
        first = data.TokenStream(corpus, tok, 16, "pack", 0, chunk=4, shuffle_buffer=buffer)
        head = _take(first, 2, 4)
        resumed = data.TokenStream(corpus, tok, 16, "pack", 0, chunk=4, shuffle_buffer=buffer)
        resumed.load_state_dict(first.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(ref, head + _take(resumed, 4, 4)))
    with pytest.raises(ConfigError, match="builtin-bpe needs an in-memory corpus"):
        data.load_tokenizer(cfg, corpus)


@pytest.mark.parametrize("mode", ["pack", "truncate"])
def test_shuffle_buffer_resumes_exactly_and_undoes_a_draw(builtin, mode):
    """The buffer's rows and draw counter are the position: a saved and reloaded stream (through
    torch.save, as in a checkpoint) continues with the same rows, and a restored snapshot redraws
    the rows it undid."""
    import io

    _, corpus, tok = builtin

    def stream():
        return data.TokenStream(corpus, tok, 32, mode, seed=1, shuffle_buffer=64)

    ref = _take(stream(), 12, 8)
    first = stream()
    head = _take(first, 5, 8)
    blob = io.BytesIO()
    torch.save(first.state_dict(), blob)
    blob.seek(0)
    resumed = stream()
    resumed.load_state_dict(torch.load(blob, weights_only=True))
    snap = resumed.snapshot()
    undone = _take(resumed, 1, 8)
    resumed.restore(snap)
    tail = _take(resumed, 7, 8)
    assert torch.equal(undone[0], tail[0])
    assert all(torch.equal(a, b) for a, b in zip(ref, head + tail))
    in_order = _take(data.TokenStream(corpus, tok, 32, mode, seed=1), 12, 8)
    assert not all(torch.equal(a, b) for a, b in zip(ref, in_order)), "the buffer changes the order"


def test_shuffle_buffer_state_is_its_rows_and_a_counter(builtin):
    """The saved buffer is P x (seq_len + 1) int32 values (ids and lengths), 4 bytes each."""
    _, corpus, tok = builtin
    s = data.TokenStream(corpus, tok, 32, "pack", 0, shuffle_buffer=64)
    s.next_rows(8)
    sd = s.state_dict()
    assert sd["drawn"] == 8
    assert sd["pool_ids"].nbytes + sd["pool_lengths"].nbytes == 64 * (32 + 1) * 4
    assert data.TokenStream(corpus, tok, 32, "pack", 0).state_dict()["pool_ids"].numel() == 0


def test_shuffle_buffer_loses_and_repeats_no_row(builtin):
    """A buffer smaller than a draw (slots drawn twice in one call) still emits every source row
    once: the rows drawn plus the rows left in the buffer are the source rows, reordered."""
    _, corpus, tok = builtin
    shuffled = data.TokenStream(corpus, tok, 16, "pack", 0, shuffle_buffer=5)
    drawn = torch.cat(_take(shuffled, 30, 8) + [shuffled.pool_ids.long()])
    source = torch.cat(_take(data.TokenStream(corpus, tok, 16, "pack", 0), 1, 30 * 8 + 5))

    def key(rows):
        return sorted(map(tuple, rows.tolist()))

    assert key(drawn) == key(source) and not torch.equal(drawn[:240], source[:240])


def test_shuffle_buffer_is_seeded(builtin):
    _, corpus, tok = builtin

    def rows(seed):
        return _take(data.TokenStream(corpus, tok, 32, "pack", seed, shuffle_buffer=64), 3, 8)

    a, b, c = rows(0), rows(0), rows(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_two_ranks_draw_one_global_batch_from_the_buffer(builtin):
    """With a shuffle buffer, 2 processes at batch B still see the rows 1 process sees at 2B."""
    _, corpus, tok = builtin

    def batches(b, rank=0, world=1):
        stream = data.TokenStream(corpus, tok, 32, "truncate", 0, shuffle_buffer=32)
        return data.Batches(stream, b, 2, rank=rank, world=world)

    one, r0, r1 = batches(8), batches(4, 0, 2), batches(4, 1, 2)
    for _ in range(3):
        (m1, n1), (a, na), (b, nb) = one.next_step(), r0.next_step(), r1.next_step()
        assert n1 == na == nb
        for k in range(2):
            for key in ("input_ids", "attention_mask", "labels"):
                assert torch.equal(m1[k][key], torch.cat([a[k][key], b[k][key]]))


@pytest.mark.run
def test_default_run_batches_mix_documents():
    """Acceptance (issue 19, point 6): the default recipe's (`make train`) 300 batches of 16 rows
    come from a median of at least 12 distinct documents (a pack row's document: the one that
    supplies most of its tokens); in document order (`data.shuffle_buffer=0`) the median is 1."""
    import statistics
    from pathlib import Path

    from effpretrain.config import load_config

    cfg = load_config(Path(__file__).resolve().parent.parent / "recipes" / "tiny" / "adamw.yaml", [])
    d, t = cfg.data, cfg.train
    corpus = data.load_corpus(d)
    tok = data.load_tokenizer(d, corpus)

    def distinct(buffer):
        stream = data.TokenStream(
            corpus, tok, d.seq_len, d.mode, d.shuffle_seed, shuffle_buffer=buffer, track_docs=True
        )
        batches = data.Batches(stream, t.batch_size, t.grad_accum)
        counts = []
        for _ in range(t.max_steps):
            batches.next_step()
            assert stream.last_docs.numel() == t.batch_size * t.grad_accum
            counts.append(len(set(stream.last_docs.tolist())))
        return statistics.median(counts)

    assert (t.batch_size, t.grad_accum, d.mode) == (16, 1, "pack")
    assert distinct(d.shuffle_buffer) >= 12
    assert distinct(0) <= 3

"""Pre-tokenised shards: `effpretrain prepare` and `data.source=tokens` give the text path's rows,
resume exactly from one integer, refuse another tokenizer, and reject bad input in one line."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from _common import assert_resumed_from

from effpretrain import data
from effpretrain.cli import main
from effpretrain.config import ConfigError, DataConfig, load_config
from effpretrain.data import prepare_tokens as token_shards
from effpretrain.data.prepare_tokens import prepare
from effpretrain.data.tokens import TokenCorpus

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho sigma tau".split()
VAL_EVERY = 5
VOCAB = 400


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = " ".join(
            rng.choice(WORDS) + rng.choice(["", ",", ".", "\n"]) for _ in range(rng.randint(3, 120))
        )
        out.append(f"document {i} of seed {seed}: {body}")
    return out


def _write_jsonl(path: Path, texts: list[str]) -> None:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t, "id": len(t)}) + "\n")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two .jsonl files prepared with a 400-token BPE into shards of about 3,000 tokens."""
    root = tmp_path_factory.mktemp("tokens")
    src = root / "src"
    src.mkdir()
    texts_a, texts_b = _texts(90, 1), _texts(70, 2)
    _write_jsonl(src / "a.jsonl", texts_a)
    _write_jsonl(src / "b.jsonl", texts_b)
    out = root / "shards"
    manifest = prepare(
        str(src), out, vocab_size=VOCAB, shard_tokens=3000, val_every=VAL_EVERY, progress=False
    )
    cfg = DataConfig(source="tokens", path=str(out), vocab_size=VOCAB, val_every=VAL_EVERY)
    corpus = data.load_corpus(cfg)
    tok = data.load_tokenizer(cfg, corpus)
    return {
        "src": src,
        "out": out,
        "texts": texts_a + texts_b,
        "manifest": manifest,
        "cfg": cfg,
        "corpus": corpus,
        "tok": tok,
    }


@pytest.fixture(scope="module")
def hf_tok(prepared, tmp_path_factory):
    """The shards' BPE as a HuggingFace tokenizer folder (a tokenizer given by path)."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("hf_tok")
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(prepared["out"] / "tokenizer.json"),
        eos_token=data.EOS_TOKEN,
        pad_token=data.PAD_TOKEN,
    )
    tok.save_pretrained(folder)
    return str(folder)


class _TextStream:
    """A streaming text corpus that yields given documents in a given order (the reference)."""

    streaming = True
    name = "reference"

    def __init__(self, docs: list[str], val: list[str]):
        self.docs, self.val = docs, val

    def reader(self, rank: int, world: int, seed: int, doc_buffer: int = 0):
        assert (rank, world) == (0, 1)
        return _ListReader(self.docs)

    def iter_val(self):
        yield from self.val


class _ListReader(data.DocPosition):
    """The reference's one reader: its documents in order, the position a count."""

    def __init__(self, docs: list[str]):
        self.docs, self.count = docs, 0

    def next_doc(self) -> tuple[int, str]:
        self.count += 1
        return self.count - 1, self.docs[self.count - 1]

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.count = int(sd["count"])

    def fingerprint(self) -> str:
        return "reference"


def _held(texts: list[str]) -> list[int]:
    """The held-out documents of a files source: text hash 0 mod VAL_EVERY (data.source=files')."""
    return [i for i, t in enumerate(texts) if data.held_out(t, VAL_EVERY)]


def _train_order(p, n_docs: int) -> list[int]:
    """The source indices of the first `n_docs` training documents the shards yield."""
    encoded = p["tok"].encode_batch(p["texts"])
    index = {tuple(ids): i for i, ids in enumerate(encoded)}
    return [index[tuple(d)] for d in itertools.islice(p["corpus"].iter_train(0), n_docs)]


def test_prepare_writes_shards_manifest_and_held_out_rule(prepared):
    m, out, texts, tok = prepared["manifest"], prepared["out"], prepared["texts"], prepared["tok"]
    train, val = m["splits"]["train"], m["splits"]["val"]
    assert val["documents"] == len(_held(texts)) and train["documents"] + val["documents"] == len(texts)
    assert (
        len(train["shards"]) > 2 and m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == tok.vocab_size
    )
    encoded = tok.encode_batch(texts)
    held = _held(texts)
    assert 0 < len(held) < len(texts) // 2
    assert train["tokens"] + val["tokens"] == sum(len(e) + 1 for e in encoded)
    # The flat arrays are the documents' ids, each followed by EOS, offsets at the boundaries.
    flat = np.concatenate([np.fromfile(out / f"{s['name']}.bin", dtype=np.uint16) for s in val["shards"]])
    assert flat.tolist() == [t for i in held for t in encoded[i] + [tok.eos_id]]
    first = train["shards"][0]
    offsets = np.fromfile(out / f"{first['name']}.idx", dtype=np.int64)
    assert offsets[0] == 0 and offsets[-1] == first["tokens"] >= 3000
    assert list(prepared["corpus"].iter_val()) == [encoded[i] for i in held]


def test_every_epoch_reads_every_training_document_once_in_a_seeded_order(prepared):
    n = prepared["corpus"].n_train
    order = _train_order(prepared, 2 * n)
    train_ids = sorted(set(range(len(prepared["texts"]))) - set(_held(prepared["texts"])))
    assert sorted(order[:n]) == train_ids == sorted(order[n:])
    assert order[:n] != order[n:] and order[:n] != train_ids  # reshuffled per epoch, not file order
    again = TokenCorpus(prepared["cfg"])
    assert [tuple(d) for d in itertools.islice(again.iter_train(0), n)] == [
        tuple(d) for d in itertools.islice(prepared["corpus"].iter_train(0), n)
    ]
    other = TokenCorpus(DataConfig(**{**prepared["cfg"].__dict__, "shuffle_seed": 7}))
    assert [tuple(d) for d in itertools.islice(other.iter_train(0), n)] != [
        tuple(d) for d in itertools.islice(prepared["corpus"].iter_train(0), n)
    ]


def test_iter_train_seeks_to_any_position(prepared):
    corpus = prepared["corpus"]
    n = corpus.n_train
    straight = list(itertools.islice(corpus.iter_train(0), 2 * n + 9))
    for start in (1, n - 1, n, n + 17, 2 * n + 3):
        assert list(itertools.islice(corpus.iter_train(start), 6)) == straight[start : start + 6]


@pytest.mark.parametrize("mode", ["pack", "truncate"])
@pytest.mark.parametrize("buffer", [0, 48])
def test_rows_equal_the_text_paths_for_the_same_documents(prepared, mode, buffer):
    corpus, tok, texts = prepared["corpus"], prepared["tok"], prepared["texts"]
    order = _train_order(prepared, 3 * corpus.n_train)
    held = [texts[i] for i in _held(texts)]
    ref = _TextStream([texts[i] for i in order], held)
    a = data.TokenStream(corpus, tok, 24, mode, seed=corpus.seed, shuffle_buffer=buffer)
    b = data.TokenStream(ref, tok, 24, mode, seed=corpus.seed, shuffle_buffer=buffer)
    for _ in range(15):
        ra, rb = a.next_rows(8), b.next_rows(8)
        assert all(torch.equal(ra[k], rb[k]) for k in ("input_ids", "attention_mask", "labels"))
    va = data.validation_set(corpus, tok, 24, mode, 500)
    vb = data.validation_set(ref, tok, 24, mode, 500)
    assert torch.equal(va.input_ids, vb.input_ids) and torch.equal(va.lengths, vb.lengths)


def test_ranks_read_disjoint_documents_and_resume_from_a_count(prepared):
    corpus = prepared["corpus"]
    n = corpus.n_train
    one = [d for d, _ in itertools.islice(corpus.positions(0), 2 * n)]
    readers = [corpus.reader(r, 2, seed=0) for r in range(2)]
    per_rank = [[r.next_doc()[0] for _ in range(n)] for r in readers]  # n each: two epochs together
    assert per_rank[0] == one[0::2] and per_rank[1] == one[1::2]
    first0, first1 = set(per_rank[0][: (n + 1) // 2]), set(per_rank[1][: n // 2])
    assert not first0 & first1 and len(first0 | first1) == n  # epoch 0: disjoint, every document
    resumed = corpus.reader(1, 2, seed=0)
    resumed.load_state_dict({"count": 7})
    assert [resumed.next_doc()[0] for _ in range(5)] == per_rank[1][7:12]
    assert resumed.state_dict() == {"count": 12}
    other = [d for d, _ in itertools.islice(corpus.positions(0, 1, seed=5), n)]
    assert sorted(other) == sorted(one[:n]) and other != one[:n]  # another seed, another order


@pytest.mark.parametrize("mode", ["pack", "truncate"])
def test_tokens_stream_resumes_exactly(prepared, mode):
    corpus, tok = prepared["corpus"], prepared["tok"]

    def take(stream, steps):
        return [stream.next_rows(8)["input_ids"] for _ in range(steps)]

    ref = take(data.TokenStream(corpus, tok, 24, mode, seed=1, shuffle_buffer=32), 40)
    first = data.TokenStream(corpus, tok, 24, mode, seed=1, shuffle_buffer=32)
    head = take(first, 17)  # past an epoch boundary in pack mode (~5,000 train tokens)
    state = first.state_dict()
    resumed = data.TokenStream(TokenCorpus(prepared["cfg"]), tok, 24, mode, seed=1, shuffle_buffer=32)
    resumed.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(ref, head + take(resumed, 23)))


def test_another_tokenizer_is_refused(prepared, tmp_path):
    cfg = prepared["cfg"]
    with pytest.raises(ConfigError, match="made with the tokenizer builtin-bpe with vocab_size 400"):
        data.load_corpus(DataConfig(**{**cfg.__dict__, "vocab_size": 512}))
    with pytest.raises(ConfigError, match="set data.tokenizer=builtin-bpe data.vocab_size=400"):
        data.load_corpus(DataConfig(**{**cfg.__dict__, "tokenizer": "gpt2"}))
    # Same name, different tokenizer: the fingerprint tells them apart.
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in prepared["out"].iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    m = json.loads((copy / "manifest.json").read_text())
    m["tokenizer"]["fingerprint"] = "0" * 16
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ConfigError, match="is not the builtin-bpe"):
        data.load_corpus(DataConfig(**{**cfg.__dict__, "path": str(copy)}))


def _run(capsys, *args: str) -> tuple[int, str]:
    rc = main(list(args))
    err = capsys.readouterr().err.strip()
    return rc, err


def _bad_sources(tmp: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "blank.jsonl").write_text('{"text": "  "}\n\n')
    (tmp / "nofield.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    (tmp / "corrupt.jsonl.gz").write_bytes(gzip.compress(b'{"text": "fine"}\n' * 50)[:40])
    (tmp / "full").mkdir()
    (tmp / "full" / "keep.txt").write_text("x")
    (tmp / "a.csv").write_text("x")
    return {
        "missing": ([str(tmp / "nope.jsonl")], "source not found"),
        "empty": ([str(tmp / "blank.jsonl")], "the corpus is empty"),
        "field": ([str(tmp / "nofield.jsonl")], "nofield.jsonl:2: no text field 'text'"),
        "gzip": (
            [str(tmp / "corrupt.jsonl.gz")],
            "corrupt.jsonl.gz:51: corrupt or truncated gzip (EOFError",
        ),  # 50 lines read
        "glob": ([str(tmp / "*.none")], "files match this pattern"),
        "type": ([str(tmp / "a.csv")], "unsupported file type"),
        "out": ([str(tmp / "nofield.jsonl"), "--out", str(tmp / "full")], "is not empty"),
        "size": (["builtin", "--shard-tokens", "0"], "--shard-tokens must be >= 1"),
    }


@pytest.mark.parametrize("case", ["missing", "empty", "field", "gzip", "glob", "type", "out", "size"])
def test_prepare_bad_input_exits_2_one_line(tmp_path, capsys, hf_tok, case):
    args, needle = _bad_sources(tmp_path)[case]
    if "--out" not in args:
        args = [*args, "--out", str(tmp_path / "shards")]
    args += ["--tokenizer", hf_tok]
    rc, err = _run(capsys, "prepare", *args)
    assert rc == 2 and needle in err and "\n" not in err, err
    assert not (tmp_path / "shards" / "manifest.json").exists()


def test_tokens_source_bad_folder_exits_2(prepared, tmp_path, capsys):
    half = tmp_path / "half"
    half.mkdir()
    for f in prepared["out"].iterdir():
        (half / f.name).write_bytes(f.read_bytes())
    shard = sorted(half.glob("train-*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match="does not have the manifest's size"):
        TokenCorpus(DataConfig(**{**prepared["cfg"].__dict__, "path": str(half)}))
    (half / "manifest.json").unlink()
    with pytest.raises(ConfigError, match="no manifest.json"):
        TokenCorpus(DataConfig(**{**prepared["cfg"].__dict__, "path": str(half)}))


def test_prepare_force_rewrites_and_cli_reports(prepared, tmp_path, capsys, hf_tok):
    gz = tmp_path / "src"
    gz.mkdir()
    _write_jsonl(gz / "part-0.jsonl.gz", prepared["texts"][:80])
    _write_jsonl(gz / "part-1.jsonl.gz", prepared["texts"][80:])
    out = tmp_path / "out"
    args = ["prepare", str(gz / "*.jsonl.gz"), "--out", str(out), "--tokenizer", hf_tok]
    args += ["--val-every", str(VAL_EVERY), "--shard-tokens", "3000"]
    assert main(args) == 0
    assert "prepared" in capsys.readouterr().out
    assert main([*args, "--force"]) == 0
    again = json.loads((out / "manifest.json").read_text())
    # .jsonl.gz through a glob, the BPE given as a HF folder: the shards of the .jsonl folder.
    assert again["splits"] == prepared["manifest"]["splits"] and "file" not in again["tokenizer"]
    assert again["tokenizer"]["fingerprint"] == prepared["manifest"]["tokenizer"]["fingerprint"]
    cfg = DataConfig(source="tokens", path=str(out), tokenizer=hf_tok)
    assert list(TokenCorpus(cfg).iter_val()) == list(prepared["corpus"].iter_val())
    with pytest.raises(ConfigError, match=f"set data.tokenizer={hf_tok}"):
        TokenCorpus(DataConfig(source="tokens", path=str(out)))


def test_txt_reader_streams_the_same_documents(tmp_path):
    """prepare reads a .txt source through data.shard_records, 1 MiB at a time: the documents of
    the paragraph rule applied to the whole text."""
    rng = random.Random(0)
    paras = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 400))) for _ in range(3000)]
    path = tmp_path / "big.txt"
    path.write_text("\n\n".join(paras) + "\n\n\n\n")  # > 1 MiB: paragraphs cross read pieces
    assert path.stat().st_size > 1 << 20
    # The rule on the whole text at once: paragraphs joined up to ~4,000 characters.
    whole, cur = [], ""
    for para in path.read_text().split("\n\n"):
        if para.strip():
            if cur and len(cur) + len(para) > 4000:
                whole, cur = [*whole, cur], ""
            cur = f"{cur}\n\n{para}" if cur else para
    assert list(token_shards.iter_documents(str(path))) == [*whole, cur] and len(whole) > 100


def test_train_on_tokens_resumes_exactly(prepared, tmp_path, tiny_overrides):
    """A run on data.source=tokens: 6 steps straight vs 3 + resume to 6, bitwise-equal weights.
    Bitwise: the resumed run executes the same kernels in the same order as the straight one."""
    from safetensors.torch import load_file

    from effpretrain.trainer import train

    over = tiny_overrides + [
        "data.source=tokens",
        f"data.path={prepared['out']}",
        f"data.vocab_size={VOCAB}",
        "data.shuffle_buffer=16",
        "train.max_steps=6",
        "train.save_every=3",
        "train.eval_every=0",
        "model.preset=tiny",
        "train.log_every=1",
    ]
    straight = train(load_config(None, over), tmp_path / "straight")
    resumed = train(
        load_config(None, over),
        tmp_path / "resumed",
        resume=str(tmp_path / "straight" / "checkpoints" / "step-3"),
    )
    assert straight["steps"] == resumed["steps"] == 6 and straight["tokens"] == 6 * 4 * 32
    assert math.isfinite(straight["final_val_loss"]) and straight["val_tokens"] >= 256
    a, b = (
        load_file(str(tmp_path / r / "checkpoints" / "step-6" / "model.safetensors"))
        for r in ("straight", "resumed")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same operations, in order
    assert_resumed_from(tmp_path / "straight", tmp_path / "resumed", 3)
    assert resumed["final_val_loss"] == straight["final_val_loss"]
    # The trainer read per rank, as for data.source=files: the step-3 position is this rank's
    # TokenReader count (documents consumed), not a global stream cursor.
    saved = torch.load(tmp_path / "straight" / "checkpoints" / "step-3" / "trainer.pt", weights_only=True)
    assert len(saved["data"]["ranks"]) == 1 and saved["data"]["ranks"][0]["reader"]["count"] > 0


def test_uint32_shards_above_65536_tokens(prepared, tmp_path, monkeypatch, hf_tok):
    assert token_shards.token_dtype(65536) == np.uint16 and token_shards.token_dtype(65537) == np.uint32
    monkeypatch.setattr(token_shards, "token_dtype", lambda vocab_size: np.dtype(np.uint32))
    m = prepare(str(prepared["src"]), tmp_path / "u32", tokenizer=hf_tok, val_every=VAL_EVERY, progress=False)
    assert m["dtype"] == "uint32"
    corpus = TokenCorpus(DataConfig(source="tokens", path=str(tmp_path / "u32"), tokenizer=hf_tok))
    assert list(corpus.iter_val()) == list(prepared["corpus"].iter_val())
    n = corpus.n_train
    assert sorted(map(tuple, itertools.islice(corpus.iter_train(0), n))) == sorted(
        map(tuple, itertools.islice(prepared["corpus"].iter_train(0), n))
    )

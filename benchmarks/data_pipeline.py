"""Data pipeline alone: tokens/s of TokenStream + Batches (no model), resume latency, peak RSS.

Two sources of the same generated documents (pieces of the built-in corpus's text, 500-4,000
characters each, like C4's web pages in length):

- ``files``: local ``.jsonl.gz`` shards through ``data.source=files`` (tokenised in the stream);
- ``tokens``: the same shards after ``effpretrain prepare``, through ``data.source=tokens``.

For each: the steady tokens/s of `Batches.next_step` after the shuffle buffer has filled (the
fill is timed apart), and the resume latency at step 5 and at step 5,000: ``state_dict()`` -> a
new `TokenStream` on the open corpus -> ``load_state_dict`` -> the first batch (checked bitwise
against the uninterrupted stream's; the median over 10 consecutive steps of the median of 3
resumes each). The consumption rate it is compared with: a few fp32
training steps of ``llama_20m`` (`Trainer._train_step`, same batch shape) in the same process.
Acceptance (issue 19): the pipeline delivers >= 20x what llama_20m consumes; resume at 5,000
within 50% of resume at 5.

The tokenizer is the built-in BPE (trained once on the built-in corpus, cached), saved as a
HuggingFace tokenizer folder so that any source can load it by path; ``--tokenizer`` names
another. Writes ``benchmarks/results/data_pipeline.json`` (commit, machine, torch, date, figures)
and prints a table.

``--rss``: peak resident memory of ``python -m effpretrain train`` (default recipe, a few steps)
on a generated ~2 GB local corpus and on a ~20 MB one (``data.source=files``; sizes are
uncompressed text), read per child with ``os.wait4``; prints the difference (acceptance: within
300 MB). Its figures go into the same file's ``rss`` entry, with their own provenance.

    python benchmarks/data_pipeline.py [--files 16] [--docs 500] [--steps 200] [--plain]
    python benchmarks/data_pipeline.py --rss [--big-mb 2048] [--small-mb 20] [--rss-steps 5]
"""

from __future__ import annotations

import argparse
import copy
import gzip
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _bench import log, provenance, write_result

from effpretrain import data
from effpretrain.config import DataConfig, load_config

ROOT = Path(__file__).resolve().parent.parent


def hf_tokenizer(folder: Path, vocab_size: int) -> str:
    """The built-in BPE (trained on the built-in corpus) saved as a HF tokenizer folder."""
    from transformers import PreTrainedTokenizerFast

    cfg = DataConfig(vocab_size=vocab_size)
    corpus = data.load_corpus(cfg)
    data.load_tokenizer(cfg, corpus)  # trains and caches it on first use
    path = data.cache_dir() / "tokenizers" / f"bpe-{corpus.fingerprint()}-{vocab_size}.json"
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(path), eos_token=data.EOS_TOKEN, pad_token=data.PAD_TOKEN
    )
    tok.save_pretrained(folder)
    return str(folder)


def write_corpus(folder: Path, files: int, text_bytes: int, gz: bool = True, seed: int = 0) -> int:
    """`files` jsonl(.gz) shards holding about `text_bytes` characters of documents in all:
    pieces of 500-4,000 characters cut at random from the built-in corpus's text. Returns the
    number of documents written."""
    folder.mkdir(parents=True, exist_ok=True)
    text = "\n".join(data.builtin_documents())
    rng = random.Random(seed)
    per_file, n = text_bytes // files, 0
    for f in range(files):
        name = folder / (f"part-{f:05d}.jsonl" + (".gz" if gz else ""))
        fh = (
            gzip.open(name, "wt", encoding="utf-8", compresslevel=1)
            if gz
            else name.open("w", encoding="utf-8")
        )
        with fh:
            written = 0
            while written < per_file:
                size = rng.randint(500, 4000)
                start = rng.randrange(len(text) - size)
                doc = f"document {n}: {text[start : start + size]}"
                fh.write(json.dumps({"text": doc}) + "\n")
                written += len(doc)
                n += 1
    return n


def pipeline(cfg: DataConfig, batch: int):
    """The training pipeline of a run on `cfg`: corpus, tokenizer, stream, batches."""
    corpus = data.load_corpus(cfg)
    tok = data.load_tokenizer(cfg, corpus)
    stream = data.TokenStream.from_config(corpus, tok, cfg)
    return corpus, tok, stream, data.Batches(stream, batch, 1, vocab_size=tok.vocab_size)


def rate(cfg: DataConfig, batch: int, steps: int) -> dict:
    """Seconds to open the corpus and fill the buffer (first step), then steady tokens/s."""
    t0 = time.perf_counter()
    _, _, _, batches = pipeline(cfg, batch)
    batches.next_step()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        batches.next_step()
    dt_ = time.perf_counter() - t0
    _close(batches.stream)
    return {"first_step_s": first, "tokens_per_s": steps * batch * cfg.seq_len / dt_, "steps": steps}


def resume_latency(cfg: DataConfig, batch: int, at: int, points: int = 10, repeats: int = 3) -> dict:
    """state_dict -> new stream -> load_state_dict -> first batch, from the states at steps `at`,
    `at` + 1, ..., `at` + `points` - 1: per step the median seconds of `repeats` resumes (each
    batch checked against the uninterrupted stream's), and over the steps their median. A single
    step's figure depends on where its state falls inside a chunk of documents (whether the first
    batch must read and tokenise the next chunk, how many pending tokens the state holds), not on
    the step; the median over consecutive steps compares steps, not chunk positions."""
    corpus, tok, stream, batches = pipeline(cfg, batch)
    for _ in range(at):
        batches.next_step()
    per_step, sizes = [], []
    for _ in range(points):
        state = stream.state_dict()
        sizes.append(_state_bytes(state))
        expected = batches.next_step()[0][0]["input_ids"]
        times = []
        for _ in range(repeats):
            saved = copy.deepcopy(state)  # load_state_dict may adopt (and the stream then mutate) its tensors
            t0 = time.perf_counter()
            new = data.TokenStream.from_config(corpus, tok, cfg)
            new.load_state_dict(saved)
            got = data.Batches(new, batch, 1, vocab_size=tok.vocab_size).next_step()[0][0]["input_ids"]
            times.append(time.perf_counter() - t0)
            _close(new)
            if not torch.equal(got, expected):
                raise AssertionError(
                    f"{cfg.source}: the batch after resuming at step {at} differs from the straight run's"
                )
        per_step.append(statistics.median(times))
    _close(stream)
    return {
        "step": at,
        "seconds": statistics.median(per_step),
        "per_step_seconds": per_step,
        "points": points,
        "repeats": repeats,
        "state_bytes": max(sizes),
    }


def _close(stream) -> None:
    """Stops a stream's background tokenisation thread, if it has one."""
    if getattr(stream, "prefetcher", None) is not None:
        stream.prefetcher.stop()


def _state_bytes(state: dict) -> int:
    """Bytes of the position as a checkpoint stores it (torch.save)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.tell()


def model_rate(tokens_dir: str, tokenizer: str, preset: str, batch: int, seq_len: int, steps: int) -> float:
    """tokens/s of `steps` fp32 training steps of `preset` (after one warm-up step)."""
    from effpretrain.trainer import Trainer

    over = [f"model.preset={preset}", "data.source=tokens", f"data.path={tokens_dir}"]
    over += [f"data.tokenizer={tokenizer}", f"data.seq_len={seq_len}", f"train.batch_size={batch}"]
    over += [
        f"train.max_steps={steps + 10}",
        "train.eval_every=0",
        "train.plot=false",
        "train.precision=fp32",
    ]
    over += ["optim.name=adamw"]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(load_config(None, over), Path(tmp) / "run")
        trainer.model.train()
        trainer._train_step()
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer._train_step()
        return steps * batch * seq_len / (time.perf_counter() - t0)


def run_pipeline(args) -> dict:
    from effpretrain.data.prepare_tokens import prepare

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="data_pipeline-"))
    tokenizer = args.tokenizer or hf_tokenizer(work / "tokenizer", args.vocab_size)
    src = work / "jsonl"
    n_docs = write_corpus(src, args.files, args.files * args.docs * 2250, gz=not args.plain)
    shards = work / "tokens"
    prepare(str(src), shards, tokenizer=tokenizer, shard_tokens=args.shard_tokens, force=True)
    common = {"tokenizer": tokenizer, "seq_len": args.seq_len}
    cfgs = {
        "files": DataConfig(source="files", path=str(src), **common),
        "tokens": DataConfig(source="tokens", path=str(shards), **common),
    }
    rows = []
    for name, cfg in cfgs.items():
        r = rate(cfg, args.batch_size, args.steps)
        resumes = [resume_latency(cfg, args.batch_size, at) for at in args.resume_at]
        rows.append({"source": name, **r, "resume": resumes})
    consumed = model_rate(
        str(shards), tokenizer, args.preset, args.batch_size, args.seq_len, args.model_steps
    )
    for r in rows:
        r["x_model"] = r["tokens_per_s"] / consumed
        r["resume_ratio"] = r["resume"][-1]["seconds"] / r["resume"][0]["seconds"]
    corpus = {"files": args.files, "documents": n_docs, "format": "jsonl" if args.plain else "jsonl.gz"}
    return {"rows": rows, "model": {"preset": args.preset, "tokens_per_s": consumed}, "corpus": corpus}


def peak_rss(cmd: list[str], log: Path) -> tuple[int, int]:
    """(exit code, peak RSS in bytes) of one child process, from its own rusage (os.wait4)."""
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024  # Linux reports KiB


def run_rss(args) -> dict:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="data_pipeline-rss-"))
    tokenizer = args.tokenizer or hf_tokenizer(work / "tokenizer", args.vocab_size)
    out = {}
    for name, mb, files in (("small", args.small_mb, 4), ("big", args.big_mb, args.big_files)):
        folder = work / f"corpus-{name}"
        if not folder.is_dir():
            t0 = time.perf_counter()
            write_corpus(folder, files, mb << 20, gz=not args.plain)
            log(f"wrote the {mb} MB corpus in {time.perf_counter() - t0:.0f} s")
        cmd = [sys.executable, "-m", "effpretrain", "train", "--out", str(work / f"run-{name}")]
        for kv in (
            "data.source=files",
            f"data.path={folder}",
            f"data.tokenizer={tokenizer}",
            f"train.max_steps={args.rss_steps}",
            "train.eval_every=0",
            "train.save_every=0",
            "train.plot=false",
        ):
            cmd += ["--set", kv]
        if (work / f"run-{name}").exists():
            import shutil

            shutil.rmtree(work / f"run-{name}")
        rc, rss = peak_rss(cmd, work / f"train-{name}.log")
        if rc != 0:
            raise SystemExit(f"the {name} run failed (exit {rc}); see {work / f'train-{name}.log'}")
        out[name] = {"text_mb": mb, "peak_rss_bytes": rss}
    out["difference_bytes"] = out["big"]["peak_rss_bytes"] - out["small"]["peak_rss_bytes"]
    out["within_300mb"] = out["difference_bytes"] <= 300 << 20
    return out


def _print_pipeline(res: dict) -> None:
    print(f"{'source':<8} {'tokens/s':>12} {'x llama':>8} {'first step':>11}  resume (s) at steps")
    for r in res["rows"]:
        resumes = ", ".join(f"{x['step']}: {x['seconds']:.3f}" for x in r["resume"])
        print(
            f"{r['source']:<8} {r['tokens_per_s']:>12,.0f} {r['x_model']:>7.1f}x {r['first_step_s']:>10.2f}s  "
            f"{resumes} (ratio {r['resume_ratio']:.2f})"
        )
    m = res["model"]
    print(
        f"{m['preset']} fp32 training consumes {m['tokens_per_s']:,.0f} tokens/s (acceptance: pipeline >= 20x)"
    )


def _previous(out: Path) -> dict:
    """The result file already at `out` (the other mode's figures are kept), with an older file's
    ``git_commit`` read as ``commit`` (the key `_bench.provenance` writes)."""
    previous = json.loads(out.read_text()) if out.is_file() else {}
    if "commit" not in previous and "git_commit" in previous:
        previous = {"commit": previous.pop("git_commit"), **previous}
    return previous


def _print_rss(res: dict) -> None:
    for k in ("small", "big"):
        print(f"{k:<6} {res[k]['text_mb']:>6} MB text: peak RSS {res[k]['peak_rss_bytes'] / 2**20:,.0f} MiB")
    print(
        f"difference {res['difference_bytes'] / 2**20:,.0f} MiB "
        f"(acceptance: within 300 MB: {'met' if res['within_300mb'] else 'NOT met'})"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=16, help="jsonl.gz shards")
    ap.add_argument("--docs", type=int, default=500, help="about this many documents per shard")
    ap.add_argument("--steps", type=int, default=200, help="timed pipeline steps")
    ap.add_argument("--resume-at", type=int, nargs="+", default=[5, 5000])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--preset", default="llama_20m")
    ap.add_argument("--model-steps", type=int, default=5)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--tokenizer", help="HF tokenizer name/path (default: the built-in BPE as a HF folder)")
    ap.add_argument("--shard-tokens", type=int, default=1_000_000)
    ap.add_argument("--plain", action="store_true", help="write .jsonl instead of .jsonl.gz")
    ap.add_argument("--work-dir", help="keep the generated corpora here (default: a temporary folder)")
    ap.add_argument("--rss", action="store_true", help="peak RSS: ~2 GB corpus vs ~20 MB corpus")
    ap.add_argument("--big-mb", type=int, default=2048)
    ap.add_argument("--big-files", type=int, default=64)
    ap.add_argument("--small-mb", type=int, default=20)
    ap.add_argument("--rss-steps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_pipeline.json"))
    args = ap.parse_args(argv)
    command = ["python benchmarks/data_pipeline.py", *(sys.argv[1:] if argv is None else argv)]
    meta = {"benchmark": "benchmarks/data_pipeline.py", "command": " ".join(command)}
    out = Path(args.out)
    previous = _previous(out)
    if args.rss:
        res = run_rss(args)
        _print_rss(res)
        # The rss entry carries its own provenance; the pipeline figures beside it keep theirs.
        record = {**previous, "rss": {**meta, **provenance(), **res}}
    else:
        res = run_pipeline(args)
        _print_pipeline(res)
        record = {**meta, **res, **({"rss": previous["rss"]} if "rss" in previous else {})}
    write_result(out, record)  # provenance (commit, machine, torch, date) unless kept from `previous`
    print(f"-> {out}")


if __name__ == "__main__":
    main()

"""Chunked vs standard cross-entropy: training speed side by side, and the loss's own memory.

1. Speed: three `Trainer`s of the same llama_20m fp32 run (same seed, so the same initial weights
   and the same data stream), with ``train.loss`` = ``standard``, ``chunked`` and
   ``chunked_recompute``, step in blocks in one process, in an order rotated every round so that
   machine noise hits all alike; tokens/s of each and their ratios to standard (target: chunked >=
   0.95 x standard; the default is chunked only at >= 0.99 x). The runs' losses are recorded side by
   side too (they agree to ~1e-5: same steps, same data). The load average before and after is
   recorded: other processes on a shared machine slow all kinds alike but add noise.
2. Chunk size: the loss alone (forward + backward of `linear_cross_entropy` at the training
   step's token count, the preset's hidden size and the vocabulary) for several chunk sizes, best of
   three, the evidence for `train.loss_chunk_tokens`' default.
3. Memory: at 8,192 tokens, vocabulary 32,000, hidden 256 (fp32; bf16 autocast on request), the
   loss's own bytes measured by `effpretrain.memory.measure_loss_bytes` (saved for backward,
   transient, peak) beside `effpretrain.loss.loss_bytes`' prediction, for the three kinds.

Writes ``benchmarks/results/chunked_loss.json`` (commit, machine, torch version, date) and prints
the tables. About ten minutes on a shared 2-core CPU with the defaults.

    python benchmarks/chunked_loss.py [--rounds 3] [--steps 2] [--batch-size 4] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _bench import log, write_result

from effpretrain.config import load_config
from effpretrain.loss import DEFAULT_CHUNK_TOKENS, linear_cross_entropy, loss_bytes
from effpretrain.memory import measure_loss_bytes
from effpretrain.models.llama import PRESETS

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("standard", "chunked", "chunked_recompute")


def training_speed(args: argparse.Namespace) -> dict:
    """tokens/s of the standard- and chunked-loss runs, alternating blocks of `args.steps` steps."""
    from effpretrain.trainer import Trainer

    steps = 2 + args.rounds * args.steps
    over = [
        f"model.preset={args.preset}",
        f"data.seq_len={args.seq_len}",
        f"data.vocab_size={args.vocab}",
        f"train.batch_size={args.batch_size}",
        f"train.max_steps={steps}",
        "train.eval_every=0",
        "train.plot=false",
        "train.precision=fp32",
        f"train.loss_chunk_tokens={args.chunk_tokens}",
        "optim.name=adamw",
    ]
    times = dict.fromkeys(KINDS, 0.0)
    losses: dict[str, list[float]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {k: Trainer(load_config(None, over + [f"train.loss={k}"]), Path(tmp) / k) for k in KINDS}
        for tr in trainers.values():
            tr.model.train()
        for _ in range(2):  # warm-up, not timed
            for k, tr in trainers.items():
                losses[k].append(tr._train_step()[0])
        for r in range(args.rounds):
            # Each round a rotated order: every kind runs first, middle and last equally often.
            for k in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    losses[k].append(trainers[k]._train_step()[0])
                times[k] += time.perf_counter() - t0
        vocab = trainers["standard"].tok.vocab_size
    tokens = args.rounds * args.steps * args.batch_size * args.seq_len
    tps = {k: tokens / times[k] for k in KINDS}
    return {
        "preset": args.preset,
        "vocab": vocab,
        "batch": [args.batch_size, args.seq_len],
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "chunk_tokens": args.chunk_tokens,
        "threads": torch.get_num_threads(),
        "tokens_per_s": tps,
        "ratio_chunked_over_standard": tps["chunked"] / tps["standard"],
        "ratio_chunked_recompute_over_standard": tps["chunked_recompute"] / tps["standard"],
        "losses": losses,
        "max_rel_loss_diff": max(
            abs(a - b) / abs(b) for k in KINDS[1:] for a, b in zip(losses[k], losses["standard"])
        ),
    }


def chunk_sweep(tokens: int, vocab: int, hidden: int, chunks: list[int]) -> list[dict]:
    """Seconds of one forward + backward of the loss alone (best of three) per chunk size."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    rows = []
    cases = [("standard", 0), *((k, c) for k in KINDS[1:] for c in chunks)]
    for kind, chunk in cases:
        best = float("inf")
        for _ in range(3):
            h.grad = w.grad = None
            t0 = time.perf_counter()
            linear_cross_entropy(h, w, labels, kind, max(chunk, 1)).backward()
            best = min(best, time.perf_counter() - t0)
        rows.append({"kind": kind, "chunk_tokens": chunk or None, "seconds": best})
    return rows


def memory_table(tokens: int, vocab: int, hidden: int, chunk: int, dtypes: list[str]) -> list[dict]:
    """Measured and predicted bytes of the loss itself, standard vs chunked, per dtype."""
    rows = []
    for dtype in (getattr(torch, d) for d in dtypes):
        for kind in KINDS:
            got = measure_loss_bytes(kind, tokens, vocab, hidden, dtype, chunk)
            want = loss_bytes(kind, tokens, vocab, hidden, dtype, chunk)
            rows.append(
                {
                    "kind": kind,
                    "dtype": str(dtype).removeprefix("torch."),
                    "tokens": tokens,
                    "vocab": vocab,
                    "hidden": hidden,
                    "chunk_tokens": chunk if kind != "standard" else None,
                    "measured": got,
                    "predicted": want,
                }
            )
        std = rows[-len(KINDS)]["measured"]["peak"]
        for row in rows[-len(KINDS) + 1 :]:
            row["peak_drop_vs_standard"] = 1 - row["measured"]["peak"] / std
    return rows


def print_tables(result: dict) -> None:
    s = result["speed"]
    print(
        f"{s['preset']} fp32, batch {s['batch'][0]} x {s['batch'][1]}, vocab {s['vocab']}, "
        f"{s['rounds']} alternating rounds of {s['steps_per_block']} steps, threads {s['threads']}"
    )
    for k in KINDS:
        print(f"  {k:<17}: {s['tokens_per_s'][k]:>10,.0f} tokens/s")
    for k in KINDS[1:]:
        r = s[f"ratio_{k}_over_standard"]
        print(f"  ratio {k}/standard = {r:.3f} (target >= 0.95: {'met' if r >= 0.95 else 'NOT met'})")
    print(
        f"  load average (1, 5, 15 min) before {s['load_average_1_5_15_min']['before']}, after "
        f"{s['load_average_1_5_15_min']['after']}"
    )
    print(f"  largest relative loss difference over the steps: {s['max_rel_loss_diff']:.2e}")
    print("loss alone, forward + backward (best of 3):")
    for row in result["chunk_sweep"]:
        print(f"  {row['kind']:<17} chunk {str(row['chunk_tokens']):>6}: {row['seconds']:.3f} s")
    print("the loss's own memory (MB = 1e6 bytes): measured (predicted)")
    print(f"  {'kind':<17} {'dtype':<9} {'saved':>20} {'transient':>20} {'peak':>20}")
    for row in result["memory"]:
        m, p = row["measured"], row["predicted"]
        cells = " ".join(f"{m[k] / 1e6:>9.1f} ({p[k] / 1e6:>8.1f})" for k in ("saved", "transient", "peak"))
        drop = f"  peak -{row['peak_drop_vs_standard']:.1%}" if "peak_drop_vs_standard" in row else ""
        print(f"  {row['kind']:<17} {row['dtype']:<9} {cells}{drop}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama_20m")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000, help="data.vocab_size (the paper's 32,000)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per block")
    ap.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--memory-tokens", type=int, default=8192)
    ap.add_argument(
        "--memory-dtypes",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16"],
        help="bfloat16 (autocast) is slow on CPUs without bf16 matrix units",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "chunked_loss.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    speed = training_speed(args)
    speed["load_average_1_5_15_min"] = {"before": load_before, "after": os.getloadavg()}
    log(f"speed done: chunked/standard {speed['ratio_chunked_over_standard']:.3f}")
    hidden = PRESETS[args.preset].hidden
    sweep = chunk_sweep(args.batch_size * args.seq_len, speed["vocab"], hidden, args.chunks)
    log("chunk sweep done")
    result = {
        "benchmark": "benchmarks/chunked_loss.py",
        "command": " ".join(["python benchmarks/chunked_loss.py", *(sys.argv[1:] if argv is None else argv)]),
        "speed": speed,
        "chunk_sweep": sweep,
        "memory": memory_table(args.memory_tokens, 32000, 256, args.chunk_tokens, args.memory_dtypes),
    }
    write_result(args.out, result)  # with provenance: commit, machine, torch, date
    print_tables(result)
    return result


if __name__ == "__main__":
    main()

"""Trainer overhead: effpretrain's training step vs a bare PyTorch loop, in one process, alternating.

Both loops train the same preset, with the same batch shape and the same optimizer (torch AdamW,
foreach) and clipping. effpretrain's side is the real `Trainer._train_step` (token stream,
Accelerate wrappers, token-weighted loss, clipping, scheduler); the bare side is a plain
forward/backward/clip/step on pre-built batches. Blocks of steps alternate so that machine noise
hits both equally. Prints tokens/s of each and the ratio (target: effpretrain >= 0.95 x bare);
``--out PATH`` also writes them as JSON with their provenance (commit, machine, torch, date).

    python benchmarks/trainer_overhead.py [--preset tiny] [--rounds 6] [--steps 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _bench import write_result


def _alternate(steps: dict[str, Any], rounds: int, per_block: int) -> dict[str, float]:
    """Seconds each loop spends on `rounds` blocks of `per_block` steps, in alternating order
    (after two warm-up steps of each)."""
    for i in range(2):
        for fn in steps.values():
            fn(i)
    times = dict.fromkeys(steps, 0.0)
    for r in range(rounds):
        order = list(steps.items())
        if r % 2:
            order.reverse()
        for name, fn in order:
            t0 = time.perf_counter()
            for i in range(per_block):
                fn(i)
            times[name] += time.perf_counter() - t0
    return times


def _bare_loop(args: argparse.Namespace, cfg: Any, vocab: int) -> Any:
    """The plain PyTorch step the trainer is compared with: the same model, AdamW (foreach),
    gradient clipping, on eight fixed random batches."""
    from effpretrain.models import build_model

    bare = build_model(args.preset, vocab, args.seq_len, seed=1)
    bare.train()
    opt = torch.optim.AdamW(bare.parameters(), lr=cfg.optim.lr, foreach=True)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=gen) for _ in range(8)]

    def bare_step(i: int) -> None:
        ids = batches[i % len(batches)]
        loss = bare(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bare.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return bare_step


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """tokens/s of the trainer's step and of the bare loop, and their ratio."""
    from effpretrain.config import load_config
    from effpretrain.trainer import Trainer

    total_steps = 2 + args.rounds * args.steps + 5
    cfg = load_config(
        None,
        [
            f"model.preset={args.preset}",
            f"data.seq_len={args.seq_len}",
            f"train.batch_size={args.batch_size}",
            f"train.max_steps={total_steps}",
            "train.eval_every=0",
            "train.plot=false",
            "optim.name=adamw",
        ],
    )
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, Path(tmp) / "run")
        trainer.model.train()

        bare_step = _bare_loop(args, cfg, trainer.tok.vocab_size)

        def ours_step(i: int) -> None:
            trainer._train_step()

        times = _alternate({"effpretrain": ours_step, "bare": bare_step}, args.rounds, args.steps)
    tokens = args.rounds * args.steps * args.batch_size * args.seq_len
    tps = {k: tokens / v for k, v in times.items()}
    return {
        "preset": args.preset,
        "batch": [args.batch_size, args.seq_len],
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "threads": torch.get_num_threads(),
        "seconds": times,
        "tokens_per_s": tps,
        "ratio_effpretrain_over_bare": tps["effpretrain"] / tps["bare"],
    }


def print_report(result: dict[str, Any]) -> None:
    tps, ratio = result["tokens_per_s"], result["ratio_effpretrain_over_bare"]
    print(
        f"preset {result['preset']}, batch {result['batch'][0]} x {result['batch'][1]}, {result['rounds']} "
        f"alternating rounds of {result['steps_per_block']} steps, threads {result['threads']}"
    )
    print(f"  bare PyTorch loop : {tps['bare']:>10,.0f} tokens/s")
    print(f"  effpretrain loop  : {tps['effpretrain']:>10,.0f} tokens/s")
    print(
        f"  ratio effpretrain/bare = {ratio:.3f}  (target >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per block")
    ap.add_argument(
        "--out", type=Path, default=None, help="also write the figures (JSON, with provenance) here"
    )
    args = ap.parse_args(argv)
    result = {
        "benchmark": "benchmarks/trainer_overhead.py",
        "command": " ".join(
            ["python benchmarks/trainer_overhead.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        **measure(args),
    }
    print_report(result)
    if args.out is not None:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()

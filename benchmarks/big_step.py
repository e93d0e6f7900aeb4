"""A measured big step: build a model (layer by layer, INT8 weights as each layer is built), run a
few training steps on one random batch, and write what the project's tensor accounting measured
beside what the estimator states, by category, with the peak resident set size and the time.

    python benchmarks/big_step.py --model llama_7b --method apollo_mini --weight-quant int8 \\
        --update-in-backward --batch-size 1 --seq-len 256 --steps 2 --out DIR

writes ``DIR/big_step.json``: ``params``, ``measured_peak_bytes`` (the largest measured step's
peak), ``estimated_peak_bytes``, ``peak_rss_bytes`` (the process, the Python and torch runtime
included), ``measured`` (each step's bytes by category) and ``estimated`` (the estimate's),
``losses``, ``wall_s`` and each phase's seconds, the config, and the commit and machine. The
activation checkpointing is the estimator's plan for ``--memory-budget-gb`` (every layer without
a budget), the loss the chunked one (the trainer's default). Progress goes to stderr, a line per
built layer and per phase. Runs on the CPU in fp32 (bf16 matrix products are ~100x slower on a
CPU) unless ``--set train.precision=...`` says otherwise.
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench import log, provenance, write_result  # noqa: E402

from effpretrain.config import load_config, to_dict  # noqa: E402
from effpretrain.config.checks import stochastic_rounding  # noqa: E402
from effpretrain.in_backward import InBackward  # noqa: E402
from effpretrain.memory import estimate_from_config, plan_checkpointing  # noqa: E402
from effpretrain.memory.measure import measure_step  # noqa: E402
from effpretrain.models.llama import model_shape  # noqa: E402
from effpretrain.optim_setup import build_optimizer_and_schedule  # noqa: E402
from effpretrain.run_model import build_run_model, make_train_step, place_model, synthetic_batch  # noqa: E402
from optimizers.writer import Rounding, attach  # noqa: E402

CATEGORIES = ("weights", "gradients", "optimizer_state", "activations")


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run_config(args: argparse.Namespace) -> Any:
    """The run's config: the default recipe with the command's settings and ``--set`` overrides."""
    vocab = model_shape(load_config(None, [f"model.preset={args.model}"]).model).vocab
    over = [
        f"model.preset={args.model}",
        f"optim.name={args.method}",
        f"data.vocab_size={vocab}",
        f"data.seq_len={args.seq_len}",
        f"train.batch_size={args.batch_size}",
        f"train.weight_quant={args.weight_quant}",
        f"train.update_in_backward={'true' if args.update_in_backward else 'false'}",
        "train.grad_clip=0",
        "train.precision=fp32",
        "data.shuffle_buffer=0",  # no data pipeline here: one random batch
    ]
    if args.rank:
        over.append(f"optim.rank={args.rank}")
    if args.weight_quant_embeddings:
        over.append("train.weight_quant_embeddings=true")
    return load_config(None, over + list(args.set or []))


def checkpointed(cfg: Any, vocab: int, budget: float | None) -> list[int]:
    """The estimator's checkpointing plan: the fewest layers within `budget` GB, or every layer."""
    if budget is None:
        return list(range(model_shape(cfg.model).layers))
    cfg.train.memory_budget_gb = budget
    return plan_checkpointing(cfg, vocab)[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a preset: llama_7b, llama_13b, ...")
    p.add_argument("--method", required=True, help="an optimizer of the registry")
    p.add_argument("--weight-quant", default="none", choices=["none", "int8"])
    p.add_argument(
        "--weight-quant-embeddings", action="store_true", help="the embedding and head in INT8 too"
    )
    p.add_argument("--update-in-backward", action="store_true")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rank", type=int, default=None, help="projection rank (the method's default: none)")
    p.add_argument(
        "--memory-budget-gb", type=float, default=None, help="checkpoint the fewest layers within it"
    )
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="any other config override")
    p.add_argument("--out", required=True, help="folder for big_step.json")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("effpretrain.materialize").setLevel(logging.INFO)

    t_all = time.time()
    cfg = run_config(args)
    vocab = cfg.data.vocab_size
    layers = checkpointed(cfg, vocab, args.memory_budget_gb)
    est = estimate_from_config(cfg, vocab, checkpointed=layers)
    log(
        f"big_step: {args.model} / {args.method} / weights {args.weight_quant}, "
        f"{len(layers)} checkpointed layers; estimated peak {est.peak / 1e9:.3f} GB"
    )
    phases: dict[str, float] = {}
    t = time.time()
    model, _ = build_run_model(cfg, vocab)
    model = place_model(model, cfg, "cpu", layers)
    phases["build_s"] = time.time() - t
    params = sum(q.numel() for q in model.parameters())
    log(
        f"built {params:,} parameters in {phases['build_s']:.0f} s (peak RSS {peak_rss_bytes() / 1e9:.2f} GB)"
    )
    rounding = Rounding(stochastic_rounding(cfg), seed=cfg.train.seed)
    attach(list(enumerate(model.parameters())), rounding)
    opt, _ = build_optimizer_and_schedule(model, cfg)
    batch = synthetic_batch(cfg, vocab)
    inb = InBackward.for_run(model.parameters(), opt, cfg.train) if cfg.train.update_in_backward else None
    step = make_train_step(model, opt, cfg, lambda k: batch, in_backward=inb, rounding=rounding)
    losses: list[float] = []
    measured: list[dict[str, Any]] = []
    for k in range(args.steps):
        t = time.time()
        out: dict[str, float] = {}
        rec = measure_step(lambda out=out: out.setdefault("loss", step()), model, opt, k, in_backward=inb)
        phases[f"step_{k + 1}_s"] = time.time() - t
        losses.append(out["loss"])
        measured.append(rec)
        log(
            f"step {k + 1}: loss {out['loss']:.4f}, measured peak {rec['peak'] / 1e9:.3f} GB "
            f"({rec['phase_at_peak']}), {phases[f'step_{k + 1}_s']:.0f} s, peak RSS {peak_rss_bytes() / 1e9:.2f} GB"
        )
    if inb is not None:
        inb.remove()
    top = max(measured, key=lambda r: r["peak"])
    result = {
        **provenance(),
        "model": args.model,
        "method": args.method,
        "weight_quant": args.weight_quant,
        "weight_quant_embeddings": args.weight_quant_embeddings,
        "update_in_backward": args.update_in_backward,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "threads": torch.get_num_threads(),
        "checkpointed_layers": len(layers),
        "params": params,
        "measured_peak_bytes": top["peak"],
        "estimated_peak_bytes": est.peak,
        "peak_ratio": top["peak"] / est.peak,
        "peak_rss_bytes": peak_rss_bytes(),
        "measured": [
            {k: r[k] for k in (*CATEGORIES, "temporaries", "peak", "phase_at_peak", "at_peak") if k in r}
            for r in measured
        ],
        "estimated": {
            "weights": est.weights,
            "gradients": est.grads,
            "optimizer_state": est.optimizer_state,
            "activations": est.activations,
            "peak": est.peak,
            "peak_moment": est.detail.get("peak_moment"),
            "peak_terms": est.detail.get("peak_terms"),
        },
        "losses": losses,
        "wall_s": time.time() - t_all,
        **phases,
        "config": to_dict(cfg),
    }
    write_result(Path(args.out) / "big_step.json", result)
    log(
        f"big_step: measured peak {top['peak'] / 1e9:.3f} GB vs estimated {est.peak / 1e9:.3f} GB "
        f"({top['peak'] / est.peak:.4f}), peak RSS {result['peak_rss_bytes'] / 1e9:.2f} GB, "
        f"{result['wall_s']:.0f} s -> {Path(args.out) / 'big_step.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

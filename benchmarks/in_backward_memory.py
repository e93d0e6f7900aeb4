"""Gradient memory of ``train.update_in_backward`` beside the normal path, measured (issue 17,
acceptance 2).

Grid (fp32, CPU, one process): llama_20m and llama_60m at the presets' own vocabulary (32,000, the
paper's T5 tokenizer), methods adamw, galore, fira, apollo and lowrank_restarts (their tiny
recipes, ``recipes/tiny/<method>.yaml``, with the projection or factor rank set to hidden / 4 as
the papers' small models), K = 1 and K = 4 micro-batches of 1 x 64 tokens (the standard loss), each
run once with ``train.update_in_backward: false`` and once with ``true``. Each run is built as the
trainer builds it (`effpretrain.memory.measure.measure_run`) and its first two steps are measured
by tensor accounting (`measure_step`): step 0 builds the optimizer state and is a refresh step for
the projecting methods (GaLore's projected matrices keep full accumulators there), step 1 is a
non-refresh step (refreshes every 50 steps, restarts every 50): the figures below are step 1's, and
step 0's gradient bytes are kept beside the estimator's refresh-step figure.

Per (preset, method, K) it reports, for the normal and the in-backward run: the measured peak
gradient bytes (the most gradient storages alive at once: ``.grad`` in the normal path; the
accumulators and the gradients in flight in backward), the estimator's gradient figure
(`effpretrain.memory.estimate_from_config`: every gradient, or accumulators + in flight) and the
measured and estimated peaks; and the two checks of acceptance 2:

- ``grads_within_estimate``: measured in-backward peak gradient bytes <= the estimator's figure;
- ``peak_falls``: (normal peak - in-backward peak) >= 0.8 x (normal gradient bytes - in-backward
  gradient bytes), both measured; null where the in-backward run holds more gradient bytes (K = 4
  with full accumulators for the embeddings and head: every such gradient plus one in flight),
  where ``peak_not_higher`` says whether its peak at least did not rise. (The normal path's
  incoming micro-batch gradient is alive too while autograd adds it into ``.grad``; not being
  ``.grad`` it counts there as a temporary, so the peaks are the like-for-like comparison.)

Writes ``benchmarks/results/in_backward_memory.json`` (commit, machine, torch, date, settings,
rows) and prints the table; progress goes to stderr. About 3 CPU-minutes on one core (5 wall
minutes on a shared 2-core machine).

    python benchmarks/in_backward_memory.py [--presets llama_20m] [--methods adamw galore] [--ks 1 4]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from _bench import log, provenance

import optimizers
from effpretrain import memory
from effpretrain.config import load_config
from effpretrain.memory.measure import measure_run
from effpretrain.models.llama import PRESETS

ROOT = Path(__file__).resolve().parent.parent
PRESETS_RUN = ("llama_20m", "llama_60m")
METHODS = ("adamw", "galore", "fira", "apollo", "lowrank_restarts")
KS = (1, 4)
VOCAB = 32000
BATCH, SEQ = 1, 64
FALL = 0.8  # the share of the gradient saving the peak must fall by (acceptance 2)


def overrides(preset: str, method: str, k: int, in_backward: bool) -> list[str]:
    """The grid's overrides of a tiny recipe: preset, fp32, the shape, K, the mode and the rank."""
    cfg = load_config(ROOT / "recipes" / "tiny" / f"{method}.yaml")
    rank = PRESETS[preset].hidden // 4
    over = [
        f"model.preset={preset}",
        "train.precision=fp32",
        "data.shuffle_buffer=0",  # the measured steps draw no data
        f"train.batch_size={BATCH}",
        f"data.seq_len={SEQ}",
        f"train.grad_accum={k}",
        f"train.update_in_backward={'true' if in_backward else 'false'}",
        "train.loss=standard",
        # Clipping off, as the paper recipes of GaLore and the benchmark: low-rank accumulators
        # are used only then (with clipping on every accumulator is full; effpretrain/in_backward.py).
        "train.grad_clip=0",
    ]
    if optimizers.method_spec(cfg.optim.name).projects:
        over.append(f"optim.rank={rank}")
    if cfg.factor.kind != "none":
        over.append(f"factor.rank={rank}")
    return over


def run_one(preset: str, method: str, k: int, in_backward: bool) -> dict[str, Any]:
    """One run's two measured steps beside its estimate."""
    cfg = load_config(ROOT / "recipes" / "tiny" / f"{method}.yaml", overrides(preset, method, k, in_backward))
    est = memory.estimate_from_config(cfg, VOCAB)
    t0 = time.perf_counter()
    first, steady = measure_run(cfg, VOCAB, steps=2)
    d = est.detail
    return {
        "measured_grad_bytes": int(steady["gradients"]),
        "measured_grad_bytes_step0": int(first["gradients"]),
        "measured_peak": int(steady["peak"]),
        "measured_phase_at_peak": steady["phase_at_peak"],
        "estimated_grad_bytes": est.grads,
        "estimated_grad_bytes_at_refresh": d.get("grads_at_refresh", est.grads),
        "estimated_peak": d.get("peak_between_refreshes", est.peak),
        "estimated_peak_moment": d["peak_moment"],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def compare(normal: dict[str, Any], inb: dict[str, Any]) -> dict[str, Any]:
    """Acceptance 2's checks for one (preset, method, K)."""
    grad_saving = normal["measured_grad_bytes"] - inb["measured_grad_bytes"]
    peak_fall = normal["measured_peak"] - inb["measured_peak"]
    return {
        "grad_saving": grad_saving,
        "peak_fall": peak_fall,
        "peak_fall_share": round(peak_fall / grad_saving, 3) if grad_saving > 0 else None,
        "grads_within_estimate": inb["measured_grad_bytes"] <= inb["estimated_grad_bytes"],
        "refresh_grads_within_estimate": inb["measured_grad_bytes_step0"]
        <= inb["estimated_grad_bytes_at_refresh"],
        # None where in backward holds more gradient bytes: there is no saving to fall by.
        "peak_falls": peak_fall >= FALL * grad_saving if grad_saving > 0 else None,
        "peak_not_higher": peak_fall >= 0,
    }


def table(rows: list[dict[str, Any]]) -> str:
    mb = lambda b: f"{b / 2**20:8.2f}"  # noqa: E731
    head = (
        f"{'preset':<10}{'method':<17}{'K':>2} | {'grad MiB: normal':>16}{'in-bwd':>9}{'est':>9}"
        f" | {'peak MiB: normal':>16}{'in-bwd':>9}{'est':>9} | {'fall/saving':>11}  checks"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        n, i, c = r["normal"], r["in_backward"], r["check"]
        share = "-" if c["peak_fall_share"] is None else f"{c['peak_fall_share']:.2f}"
        grads = "grads<=est" if c["grads_within_estimate"] else "grads>est FAIL"
        fall = {True: "fall ok", False: "fall FAIL", None: "no saving"}[c["peak_falls"]]
        if c["peak_falls"] is None:
            fall += ", peak " + ("not higher" if c["peak_not_higher"] else "HIGHER")
        ok = f"{grads}; {fall}"
        lines.append(
            f"{r['preset']:<10}{r['method']:<17}{r['k']:>2} | {mb(n['measured_grad_bytes']):>16}"
            f"{mb(i['measured_grad_bytes']):>9}{mb(i['estimated_grad_bytes']):>9}"
            f" | {mb(n['measured_peak']):>16}{mb(i['measured_peak']):>9}{mb(i['estimated_peak']):>9}"
            f" | {share:>11}  {ok}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS_RUN))
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--ks", nargs="+", type=int, default=list(KS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "in_backward_memory.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for preset in args.presets:
        for method in args.methods:
            for k in args.ks:
                pair = {}
                for mode in (False, True):
                    pair[mode] = run_one(preset, method, k, mode)
                    log(f"{preset} {method} K={k} in_backward={mode}: {pair[mode]}")
                row = {"preset": preset, "method": method, "k": k, "normal": pair[False]}
                row.update(in_backward=pair[True], check=compare(pair[False], pair[True]))
                rows.append(row)
    settings = {"vocab": VOCAB, "batch_size": BATCH, "seq_len": SEQ, "precision": "fp32", "fall": FALL}
    out = {**provenance(), "settings": settings, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(table(rows))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()

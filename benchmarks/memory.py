"""Estimated vs measured memory, per category, for a grid of methods; standard vs chunked loss.

Grid (fp32, CPU): every tiny recipe (``recipes/tiny/*.yaml``) at its own batch, and llama_20m
(``model.preset=llama_20m``) with adamw, galore, lowrank_restarts and sltrain. Each run is built as
the trainer builds it (`effpretrain.memory.measure.measure_run`: the run's model, its planned
activation checkpointing and its optimizer) and its first two steps are measured by tensor
accounting (`measure_step`): step 0 builds the optimizer state (and a projecting method's first
basis, a refresh step), step 1 is the steady state. The measured figure of a category is its largest
over the two steps (as ``summary.json``'s ``memory_measured.max``), compared with the estimator's
(`effpretrain.memory.estimate_from_config`):

- weights, gradients, optimizer_state: must be equal (flagged otherwise);
- activations (saved for backward) and peak (largest live tensor bytes of a step): flagged when
  measured / estimated is more than 10% from 1.

Loss section: the loss's own memory (logits and what it saves for backward, measured by
`effpretrain.memory.measure_loss_bytes`, or `effpretrain.loss`'s at older commits, where the
commit has one) at 8,192 tokens x vocabulary 32,000 x hidden 256, standard vs chunked, with the estimator's terms (`effpretrain.memory.loss_bytes`, and
`effpretrain.loss.loss_bytes` where it exists); and
llama_20m's estimated peak with either loss, at its recipe shape and at 8,192 tokens x vocabulary
32,000.

Writes ``benchmarks/results/memory.json`` (commit, machine, torch, date, rows) and prints the table;
progress goes to stderr. About 3 CPU-minutes (32 runs, the loss section included).

    python benchmarks/memory.py [--only grid|loss] [--recipes adamw galore ...] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _bench import log, provenance

from effpretrain import loss as loss_mod
from effpretrain import memory
from effpretrain.config import load_config
from effpretrain.memory.measure import measure_run

ROOT = Path(__file__).resolve().parent.parent
TINY = sorted((ROOT / "recipes" / "tiny").glob("*.yaml"))
LLAMA_20M_METHODS = ("adamw", "galore", "lowrank_restarts", "sltrain")
EXACT = ("weights", "gradients", "optimizer_state")
APPROX = ("activations", "peak")
CATEGORIES = EXACT + APPROX
TOLERANCE = 0.10
# Overrides of every grid run: fp32 on CPU, and no shuffle pool (the measured steps draw no data).
BASE_OVERRIDES = ("train.precision=fp32", "data.shuffle_buffer=0")


def grid(recipes: list[str] | None = None) -> list[tuple[str, str]]:
    """(recipe stem, preset) pairs: every tiny recipe at tiny, the four methods at llama_20m."""
    cases = [(p.stem, "tiny") for p in TINY] + [(m, "llama_20m") for m in LLAMA_20M_METHODS]
    return [c for c in cases if recipes is None or c[0] in recipes]


def compare(est: memory.Estimate, steps: list[dict]) -> dict[str, Any]:
    """Estimated vs measured per category (measured: the largest over `steps`), their ratios
    and the flags: an exact category that differs, an approximate one beyond `TOLERANCE`."""
    estimated = {
        "weights": est.weights,
        "gradients": est.grads,
        "optimizer_state": est.optimizer_state,
        "activations": est.activations,
        "peak": est.peak,
    }
    measured = {c: max(int(s[c]) for s in steps) for c in CATEGORIES}
    ratio = {c: (measured[c] / estimated[c] if estimated[c] else None) for c in CATEGORIES}
    flags = [c for c in EXACT if measured[c] != estimated[c]]
    flags += [c for c in APPROX if ratio[c] is None or abs(ratio[c] - 1) > TOLERANCE]
    return {"estimated": estimated, "measured": measured, "ratio": ratio, "flags": flags}


def run_case(recipe: str, preset: str, overrides: tuple[str, ...] = (), steps: int = 2) -> dict[str, Any]:
    """One grid row: the recipe at `preset`, estimated and measured (`steps` steps)."""
    over = [*BASE_OVERRIDES, f"model.preset={preset}", *overrides]
    cfg = load_config(ROOT / "recipes" / "tiny" / f"{recipe}.yaml", over)
    vocab = cfg.data.vocab_size
    est = memory.estimate_from_config(cfg, vocab)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    measured = measure_run(cfg, vocab, steps)
    return {
        "recipe": recipe,
        "preset": preset,
        "method": cfg.optim.name,
        "factor": cfg.factor.kind,
        "batch_size": cfg.train.batch_size,
        "seq_len": cfg.data.seq_len,
        "vocab_size": vocab,
        "estimated_peak_phase": est.detail.get("peak_phase"),
        "measured_phase_at_peak": [s["phase_at_peak"] for s in measured],
        "steps": [{k: s[k] for k in (*CATEGORIES, "temporaries", "step", "phase_at_peak")} for s in measured],
        "seconds": round(time.perf_counter() - t0, 2),
        **compare(est, measured),
    }


def _as_dict(x: Any) -> dict[str, int]:
    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else dict(x)


def loss_section(tokens: int = 8192, vocab: int = 32000, hidden: int = 256) -> dict[str, Any]:
    """The loss's own bytes, standard vs chunked: measured where the commit has
    ``measure_loss_bytes`` (None with the reason otherwise), and the estimator's terms."""
    out: dict[str, Any] = {"tokens": tokens, "vocab": vocab, "hidden": hidden, "dtype": "float32"}
    out["estimated"] = {
        k: _as_dict(memory.loss_bytes(k, tokens, vocab, hidden, torch.float32))
        for k in ("standard", "chunked")
    }
    own = getattr(loss_mod, "loss_bytes", None)  # the loss module's own formula, where it has one
    if own is not None:
        out["estimated_by_loss_module"] = {
            k: {n: int(v) for n, v in own(k, tokens, vocab, hidden).items()} for k in ("standard", "chunked")
        }
    # effpretrain.memory's since the one instrument (accounting.py), effpretrain.loss's before
    measure = getattr(memory, "measure_loss_bytes", None) or getattr(loss_mod, "measure_loss_bytes", None)
    if measure is None:
        out["measured"] = None
        out["reason"] = "no measure_loss_bytes at this commit (chunked loss not merged)"
        return out
    out["measured"] = {}
    for kind in ("standard", "chunked"):
        log(f"loss: measuring {kind} at {tokens} x {vocab} x {hidden}")
        out["measured"][kind] = {k: int(v) for k, v in measure(kind, tokens, vocab, hidden).items()}
    std, chk = out["measured"]["standard"]["peak"], out["measured"]["chunked"]["peak"]
    out["chunked_peak_reduction"] = 1 - chk / std
    return out


def llama_20m_loss_peaks(tokens: int = 8192, vocab: int = 32000) -> list[dict[str, Any]]:
    """llama_20m (adamw, fp32) estimated peak with the standard and the chunked loss: at the tiny
    recipe's shape and at `tokens` x `vocab` (batch tokens / 128 x 128)."""
    cfg = load_config(ROOT / "recipes" / "tiny" / "adamw.yaml", [*BASE_OVERRIDES, "model.preset=llama_20m"])
    shapes = [
        (cfg.train.batch_size, cfg.data.seq_len, cfg.data.vocab_size),
        (tokens // 128, 128, vocab),
    ]
    rows = []
    for batch, seq, v in shapes:
        row: dict[str, Any] = {"batch_size": batch, "seq_len": seq, "vocab_size": v}
        for kind in ("standard", "chunked"):
            est = memory.estimate(
                "llama_20m", "adamw", dtype="fp32", vocab_size=v, batch_size=batch, seq_len=seq, loss=kind
            )
            row[kind] = {"peak": est.peak, "peak_phase": est.detail.get("peak_phase")}
        row["chunked_over_standard"] = row["chunked"]["peak"] / row["standard"]["peak"]
        rows.append(row)
    return rows


def _mb(b: int) -> str:
    return f"{b / 2**20:9.2f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """Estimated vs measured MiB per category with measured/estimated ratios; '!' marks a flag."""
    head = f"{'run':28s}" + "".join(f" | {c[:12]:>12s} est / meas  ratio" for c in CATEGORIES)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for c in CATEGORIES:
            ratio = r["ratio"][c]
            mark = "!" if c in r["flags"] else " "
            cells.append(
                f" | {_mb(r['estimated'][c])} / {_mb(r['measured'][c])} "
                f"{(f'{ratio:6.3f}' if ratio is not None else '   n/a')}{mark}"
            )
        lines.append(f"{r['recipe'] + '@' + r['preset']:28s}" + "".join(cells))
    return "\n".join(lines)


def worst(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per category, the row whose ratio is furthest from 1."""
    out = {}
    for c in CATEGORIES:
        scored = [r for r in rows if r["ratio"][c] is not None]
        if scored:
            r = max(scored, key=lambda r: abs(r["ratio"][c] - 1))
            out[c] = {"run": f"{r['recipe']}@{r['preset']}", "ratio": r["ratio"][c]}
    return out


def format_loss(section: dict[str, Any], peaks: list[dict[str, Any]]) -> str:
    lines = [
        f"loss at {section['tokens']} tokens x vocab {section['vocab']} x hidden {section['hidden']} (fp32):"
    ]
    for kind, terms in section["estimated"].items():
        lines.append(
            f"  estimated {kind:9s} " + ", ".join(f"{k} {_mb(v).strip()} MiB" for k, v in terms.items())
        )
    for kind, terms in section.get("estimated_by_loss_module", {}).items():
        lines.append(
            f"  loss.py   {kind:9s} " + ", ".join(f"{k} {_mb(v).strip()} MiB" for k, v in terms.items())
        )
    if section["measured"] is None:
        lines.append(f"  measured: not available ({section['reason']})")
    else:
        for kind, m in section["measured"].items():
            lines.append(
                f"  measured  {kind:9s} saved {_mb(m['saved']).strip()} MiB, peak {_mb(m['peak']).strip()} MiB"
            )
        lines.append(f"  chunked peak is {100 * section['chunked_peak_reduction']:.1f}% below standard")
    for p in peaks:
        lines.append(
            f"llama_20m adamw estimated peak, batch {p['batch_size']} x {p['seq_len']}, vocab {p['vocab_size']}: "
            f"standard {_mb(p['standard']['peak']).strip()} MiB, chunked {_mb(p['chunked']['peak']).strip()} MiB "
            f"({p['chunked_over_standard']:.3f}x)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("grid", "loss"), help="run one section only")
    ap.add_argument("--recipes", nargs="+", help="grid rows whose recipe stem is one of these")
    ap.add_argument(
        "--loss-shape", nargs=3, type=int, default=(8192, 32000, 256), metavar=("TOKENS", "VOCAB", "HIDDEN")
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "memory.json")
    args = ap.parse_args(argv)
    # One section re-run keeps the other's results from the same file.
    kept = json.loads(args.out.read_text()) if args.only and args.out.exists() else {}
    result: dict[str, Any] = {
        **kept,
        **provenance(),
        "threads": torch.get_num_threads(),
        "tolerance": TOLERANCE,
    }
    if args.only != "loss":
        rows = []
        for recipe, preset in grid(args.recipes):
            log(f"grid: {recipe}@{preset}")
            rows.append(run_case(recipe, preset))
            log(f"  {rows[-1]['seconds']} s, ratios {rows[-1]['ratio']}, flags {rows[-1]['flags']}")
        result.update(
            rows=rows, worst=worst(rows), flagged=[f"{r['recipe']}@{r['preset']}" for r in rows if r["flags"]]
        )
        print(format_table(rows))
        print("worst ratio per category: " + json.dumps(result["worst"]))
        print(f"flagged: {result['flagged'] or 'none'}")
    if args.only != "grid":
        result["loss"] = loss_section(*args.loss_shape)
        result["llama_20m_loss_peaks"] = llama_20m_loss_peaks()
        print(format_loss(result["loss"], result["llama_20m_loss_peaks"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""4-bit optimizer states (adamw_4bit, galore_4bit) beside fp32 and 8-bit ones: quality and bytes.

Quality: the tiny recipes (``recipes/tiny/<method>.yaml``: fp32, batch 16 x 128 tokens, the
built-in corpus) trained for 100 steps, one process, for AdamW and GaLore with fp32 moments
(``adamw``, ``galore``), 8-bit moments (``adamw_8bit``, ``galore_8bit``) and 4-bit moments in both
schemes (``quant_scheme``: ``rank1``, Li et al.'s rank-1 normalised V, the default; ``blockwise``,
torchao's AdamW4bit scheme): the validation loss at step 100 (16,384 tokens) and its relative
difference to the fp32-moment run of the same family, and the optimizer state measured
(`optimizers.measured_state_bytes`) beside the estimate.

Bytes at scale: the estimator's optimizer state (`effpretrain.memory.estimate`, bf16-pure) of
llama_7b for the same methods and schemes (GaLore at rank 1024), i.e. each class's formula summed
over the model's parameters.

Writes ``benchmarks/results/four_bit_states.json`` (commit, machine, torch, date, settings, rows)
and prints a table; progress on stderr. About 15 CPU-minutes (8 runs of 100 steps).

    python benchmarks/four_bit_states.py [--steps 100] [--methods adamw adamw_4bit:blockwise]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench import log, provenance

from effpretrain.config import OptimConfig, load_config
from effpretrain.memory import estimate
from effpretrain.trainer import train

ROOT = Path(__file__).resolve().parent.parent
#: "method" or "method:quant_scheme"; the first of each family is its fp32-moment baseline.
FAMILIES = {
    "adamw": ["adamw", "adamw_8bit", "adamw_4bit:rank1", "adamw_4bit:blockwise"],
    "galore": ["galore", "galore_8bit", "galore_4bit:rank1", "galore_4bit:blockwise"],
}
SCALE_PRESET, SCALE_RANK = "llama_7b", 1024


def _split(case: str) -> tuple[str, str | None]:
    method, _, scheme = case.partition(":")
    return method, scheme or None


def quality(case: str, steps: int, out: Path) -> dict[str, Any]:
    """One tiny-recipe run of `steps` steps: the final validation loss and the state bytes."""
    method, scheme = _split(case)
    over = [
        f"train.max_steps={steps}",
        f"train.eval_every={steps}",
        "train.plot=false",
        "train.memory_steps=[]",
    ]
    if scheme:
        over.append(f"optim.extra.quant_scheme={scheme}")
    t0 = time.perf_counter()
    summary = train(
        load_config(ROOT / "recipes" / "tiny" / f"{method}.yaml", over), out / case.replace(":", "-")
    )
    return {
        "final_val_loss": summary["final_val_loss"],
        "optimizer_state_bytes": summary["optimizer_state_bytes"],
        "estimated_optimizer_state_bytes": summary["estimated"]["optimizer_state"],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def at_scale(case: str) -> int:
    """The estimator's optimizer state of `SCALE_PRESET` (bf16-pure) for `case`."""
    method, scheme = _split(case)
    cfg = OptimConfig(name=method, rank=SCALE_RANK, extra={"quant_scheme": scheme} if scheme else {})
    return estimate(SCALE_PRESET, method, dtype="bf16-pure", optim_cfg=cfg).optimizer_state


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--methods", nargs="*", help="cases to run (default: every case of every family)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "four_bit_states.json"))
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, cases in FAMILIES.items():
            base = None
            for case in cases:
                if args.methods and case not in args.methods:
                    continue
                log(f"{case}: {args.steps} tiny steps")
                row = {"family": family, "case": case, **quality(case, args.steps, Path(tmp))}
                row[f"{SCALE_PRESET}_optimizer_state_bytes"] = at_scale(case)
                if case == cases[0]:
                    base = row
                if base is not None:
                    row["val_loss_vs_fp32"] = row["final_val_loss"] / base["final_val_loss"] - 1
                    row["state_vs_fp32"] = row["optimizer_state_bytes"] / base["optimizer_state_bytes"]
                rows.append(row)
                log(f"  {json.dumps(row)}")
    settings = {
        "recipes": "recipes/tiny",
        "steps": args.steps,
        "scale": f"{SCALE_PRESET} bf16-pure, rank {SCALE_RANK}",
    }
    result = {**provenance(), "settings": settings, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'case':24} {'val loss':>9} {'vs fp32':>8} {'state B':>10} {SCALE_PRESET + ' state B':>16}")
    for r in rows:
        vs = f"{100 * r['val_loss_vs_fp32']:+.2f}%" if "val_loss_vs_fp32" in r else "-"
        scale = r[f"{SCALE_PRESET}_optimizer_state_bytes"]
        print(
            f"{r['case']:24} {r['final_val_loss']:9.4f} {vs:>8} {r['optimizer_state_bytes']:10d} {scale:16d}"
        )


if __name__ == "__main__":
    main()

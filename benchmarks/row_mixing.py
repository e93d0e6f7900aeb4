"""Row mixing (issue 19): the default run with rows in document order vs through the shuffle buffer.

Trains the default recipe twice, the same tokens, budget and seed, logging every step:

- ``order``: ``data.shuffle_buffer=0``, each batch consecutive rows of one to three documents;
- ``mixed``: the default ``data.shuffle_buffer`` (rows drawn at random from a seeded buffer).

For each run it reports the final validation perplexity and, over the last 100 steps, the standard
deviation of the training loss and the first-difference noise ``std(l_t - l_{t-1}) / sqrt(2)``
(which a trend barely moves). It also reports the i.i.d. floor of the step-loss standard deviation:
with the mixed run's final weights, the per-row mean losses of 1,024 rows drawn from the stream have
a standard deviation s, and a step that averages B independent rows cannot vary less than
``s / sqrt(B)``. A step-loss std near that floor is as mixed as a batch of B rows can be.

The ``fixed_model`` section asks how much mixing can lower the step-loss noise at all, free of the
training trend: the mixed run's final model scores ``FIXED_ROWS`` consecutive rows of the
document-order stream, and for B rows per step it compares the spread of the means of consecutive
blocks of B rows (a document-order batch) with the spread of the means of B rows drawn at random
from the same rows (a mixed batch). Their ratio is the most mixing can give at that batch size.

Writes ``benchmarks/results/row_mixing.json``: the figures, each run's own commit (``git_commit``
of its ``summary.json``), and the provenance of this analysis (the commit, machine, torch and date
of the floor and fixed-model figures; `_bench.provenance`). The two runs take about 10 minutes
together on 2 CPU cores (one thread each, in parallel).

    python benchmarks/row_mixing.py [--work DIR] [--runs ORDER_DIR MIXED_DIR] [--out PATH]

``--runs`` reuses two finished run directories (trained with ``train.log_every=1``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from _bench import log, write_result

RUNS = {"order": ["--set", "data.shuffle_buffer=0"], "mixed": []}
WINDOW = 100
FLOOR_ROWS = 1024
FIXED_ROWS = 8192
FIXED_BATCHES = (16, 64, 256)
DRAWS = 8


def train_both(work: Path) -> dict[str, Path]:
    """Both runs in parallel, one thread each; their output directories."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, dirs = [], {}
    for name, extra in RUNS.items():
        dirs[name] = work / name
        cmd = [sys.executable, "-m", "effpretrain", "train", "--out", str(dirs[name])]
        cmd += ["--set", "train.log_every=1", *extra]
        log(f"[row_mixing] training {name}: {' '.join(cmd[1:])}")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a training run failed (exit {p.returncode})")
    return dirs


def loss_noise(run: Path) -> dict[str, float]:
    """The last WINDOW steps' loss std and first-difference noise, and the final val ppl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r["loss"] for r in rows if "loss" in r and "val_loss" not in r and "step" in r}
    losses = [steps[s] for s in sorted(steps)][-WINDOW:]
    if len(losses) < WINDOW:
        raise SystemExit(f"{run}: fewer than {WINDOW} logged steps (train with train.log_every=1)")
    diffs = [b - a for a, b in zip(losses, losses[1:])]
    summary = json.loads((run / "summary.json").read_text())
    return {
        "final_val_ppl": summary["final_val_ppl"],
        "loss_std": statistics.stdev(losses),
        "first_difference_noise": statistics.stdev(diffs) / 2**0.5,
        "git_commit": summary["git_commit"],
    }


def final_trainer(run: Path):
    """The run's trainer, resumed from its last checkpoint (model weights and stream position)."""
    from effpretrain.config import load_config
    from effpretrain.trainer import Trainer

    ckpt = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    cfg = load_config(str(ckpt / "config.yaml"))
    return Trainer(cfg, Path(tempfile.mkdtemp()) / "floor", resume=str(ckpt))


def row_losses(model: torch.nn.Module, rows: torch.Tensor) -> list[float]:
    """Each row's mean next-token loss under `model`."""
    per_row = []
    with torch.no_grad():
        for i in range(0, rows.size(0), 64):
            ids = rows[i : i + 64]
            logits = model(input_ids=ids).logits[:, :-1].float()
            loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
            per_row += loss.view(ids.size(0), -1).mean(1).tolist()
    return per_row


def iid_floor(trainer) -> dict[str, float]:
    """std of per-row mean losses of the final model on fresh rows, and that / sqrt(rows per step)."""
    per_row = row_losses(trainer.model.eval(), trainer.stream.next_rows(FLOOR_ROWS)["input_ids"])
    per_step = trainer.cfg.train.batch_size * trainer.cfg.train.grad_accum
    spread = statistics.stdev(per_row)
    return {"row_loss_std": spread, "rows_per_step": per_step, "iid_step_std_floor": spread / per_step**0.5}


def block_spread(losses: list[float], rows: int) -> float:
    """std of the means of consecutive, non-overlapping blocks of `rows` losses."""
    means = [statistics.fmean(losses[i : i + rows]) for i in range(0, len(losses) - rows + 1, rows)]
    return statistics.stdev(means)


def fixed_model(trainer) -> dict:
    """Step-loss spread of document-order vs mixed batches under one fixed model (no trend)."""
    from effpretrain.data import TokenStream

    cfg = trainer.cfg.data
    order = TokenStream.from_config(trainer.corpus, trainer.tok, dataclasses.replace(cfg, shuffle_buffer=0))
    log(f"[row_mixing] scoring {FIXED_ROWS} document-order rows with the final model")
    losses = row_losses(trainer.model.eval(), order.next_rows(FIXED_ROWS)["input_ids"])
    gen = torch.Generator().manual_seed(0)
    out = {"rows": FIXED_ROWS, "row_loss_std": statistics.stdev(losses), "batches": {}}
    for b in FIXED_BATCHES:
        mixed = []
        for _ in range(DRAWS):
            perm = torch.randperm(len(losses), generator=gen).tolist()
            mixed.append(block_spread([losses[i] for i in perm], b))
        o, m = block_spread(losses, b), statistics.fmean(mixed)
        out["batches"][str(b)] = {"order_std": o, "mixed_std": m, "ratio": m / o}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None, help="where the two runs are written")
    ap.add_argument("--runs", type=Path, nargs=2, metavar=("ORDER_DIR", "MIXED_DIR"), default=None)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/row_mixing.json"))
    args = ap.parse_args(argv)
    if args.runs:
        dirs = dict(zip(RUNS, args.runs))
    else:
        dirs = train_both(args.work or Path(tempfile.mkdtemp(prefix="row_mixing-")))
    result = {name: loss_noise(path) for name, path in dirs.items()}
    trainer = final_trainer(dirs["mixed"])
    result["floor"] = iid_floor(trainer)
    result["fixed_model"] = fixed_model(trainer)
    o, m = result["order"], result["mixed"]
    result["loss_std_ratio"] = m["loss_std"] / o["loss_std"]
    for name in RUNS:
        r = result[name]
        print(
            f"{name:6s} val_ppl {r['final_val_ppl']:8.2f}  loss std (last {WINDOW}) {r['loss_std']:.3f}"
            f"  first-difference noise {r['first_difference_noise']:.3f}"
        )
    f = result["floor"]
    print(
        f"i.i.d. floor of the step-loss std: {f['row_loss_std']:.3f} / sqrt({f['rows_per_step']})"
        f" = {f['iid_step_std_floor']:.3f}; mixed / order loss std = {result['loss_std_ratio']:.3f}"
    )
    fm = result["fixed_model"]
    print(f"fixed final model, {fm['rows']} document-order rows (row loss std {fm['row_loss_std']:.3f}):")
    for b, r in fm["batches"].items():
        print(
            f"  {b:>4} rows/step: order {r['order_std']:.3f}  mixed {r['mixed_std']:.3f}  ratio {r['ratio']:.3f}"
        )
    # provenance (commit, machine, torch, date) is this analysis's: the floor and fixed-model figures
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()

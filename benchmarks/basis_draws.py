"""The cost of drawing the random bases on the CPU (docs/gpu.md, G7), at a recipe's real shapes.

Every Gaussian that defines a method's state (APOLLO's projections, GoLore's random bases, the
randomized SVD's sketches) is drawn on the CPU from a CPU generator and copied to the device
(`optimizers.projection.gaussian`), and ReLoRA's re-initialised factors from torch's global CPU
generator (`effpretrain.models.factorized.layers.init_on_cpu_`), so that they are the same on any
hardware. This measures what that costs: for each projected matrix of the preset's model, the CPU
draw's time (the median of `--repeats` draws, one thread per process as the trainer's data-parallel
ranks have) and its bytes, i.e. the bytes each copy to the device moves (no GPU here: the copy's
time is not measured).

Per method, at the recipe's rank, gap and targets (recipes/<preset>/<method>.yaml):

- apollo, apollo_mini: one N(0, 1/r) basis per matrix, regenerated at every step; on a GPU the
  CPU result (in the parameter's dtype) is held, pinned, from one refresh to the next
  (`projection.held_on_host`), so the CPU draws once per refresh and each step copies;
- golore (after its switch): one Gaussian per matrix, as APOLLO's, then a QR on the device;
- galore (randomized SVD): one sketch per refresh, r + p columns at a cold start, p warm;
- relora: a new A (r x n, Kaiming-uniform) per matrix at each merge.

    python benchmarks/basis_draws.py [--preset llama_1b] [--repeats 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _bench import log, write_result
from torch import nn

from effpretrain.config import load_config
from effpretrain.memory import model_param_shapes
from optimizers import projection as proj

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("apollo", "apollo_mini", "golore", "galore", "relora")


def _median_seconds(fn: Callable[[int], object], repeats: int) -> tuple[float, float]:
    """The median wall time and the median CPU time of this process (the draw's own work, which
    other load on a shared machine inflates less) of ``fn(seed)`` over `repeats` seeds, after one
    untimed call (it warms the allocator up)."""
    wall, cpu = [], []
    for seed in range(repeats + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        fn(seed)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall[1:]), statistics.median(cpu[1:])


def draws(method: str, preset: str) -> tuple[Counter, int, torch.dtype, str]:
    """The CPU draws one matrix set of `method` makes ((kind, shape): count), the steps between
    two sets, the dtype the result is held and copied in, and when a set is drawn."""
    cfg = load_config(ROOT / "recipes" / preset / f"{method}.yaml", [])
    param_dtype = torch.bfloat16 if cfg.train.precision == "bf16-pure" else torch.float32
    shapes = [s for s in model_param_shapes(preset) if s.linear is not None]
    if method == "relora":
        targets, r = cfg.factor.targets, cfg.factor.rank
        drawn = Counter(("kaiming", (r, s.shape[1])) for s in shapes if s.linear in targets)
        return drawn, cfg.restarts.every, param_dtype, "merge"
    o = cfg.optim
    out: Counter = Counter()
    for s in shapes:
        if s.linear not in o.targets:
            continue
        m, n = s.shape
        side = proj.choose_side((m, n), o.proj_type)
        if method in ("apollo", "apollo_mini"):  # the whole gaussian_basis: draw, 1/sqrt(r), cast
            out[("basis", (m, n, o.rank, side))] += 1
        elif method == "golore":  # the Gaussian Z that the device's QR orthonormalises
            out[("normal", (n if side == "right" else m, min(o.rank, m, n)))] += 1
        else:  # randomized SVD's warm-started sketch: p = oversample new columns of G's other side
            cols = m if side == "right" else n
            out[("normal", (cols, int(o.extra.get("oversample", proj.DEFAULT_OVERSAMPLE))))] += 1
    held = param_dtype if method in ("apollo", "apollo_mini") else torch.float32
    when = "refresh" if method in ("galore", "golore") else "refresh (held between; every step without)"
    return out, o.update_proj_gap, held, when


def _draw(kind: str, shape: tuple, dtype: torch.dtype) -> tuple[Callable[[int], object], tuple[int, ...]]:
    """The CPU work of one draw, as a function of a seed, and the shape of what it returns."""
    if kind == "basis":
        m, n, rank, side = shape
        out = proj.basis_shape((m, n), rank, side, "random")
        return lambda seed: proj.gaussian_basis((m, n), rank, side, seed, dtype=dtype), out
    if kind == "kaiming":
        return lambda seed: nn.init.kaiming_uniform_(torch.empty(shape, dtype=dtype), a=math.sqrt(5)), shape
    return lambda seed: proj.gaussian(shape, proj.cpu_generator(seed)), shape


def measure(method: str, preset: str, repeats: int) -> dict[str, Any]:
    counts, gap, dtype, when = draws(method, preset)
    rows = []
    for (kind, shape), count in sorted(counts.items()):
        fn, out_shape = _draw(kind, shape, dtype)
        wall, cpu = _median_seconds(fn, repeats)
        rows.append(
            {
                "shape": list(out_shape),
                "count": count,
                "bytes": dtype.itemsize * math.prod(out_shape),
                "draw_s": wall,
                "draw_cpu_s": cpu,
            }
        )
    total_s = sum(r["draw_s"] * r["count"] for r in rows)
    total_cpu_s = sum(r["draw_cpu_s"] * r["count"] for r in rows)
    total_bytes = sum(r["bytes"] * r["count"] for r in rows)
    largest = max(rows, key=lambda r: r["bytes"])
    out = {
        "method": method,
        "drawn_at": when,
        "gap_steps": gap,
        "dtype": str(dtype).removeprefix("torch."),
        "bases": rows,
        "largest_basis": {k: largest[k] for k in ("shape", "bytes", "draw_s", "draw_cpu_s")},
        "per_set_draw_s": total_s,
        "per_set_draw_cpu_s": total_cpu_s,
        "per_set_bytes": total_bytes,
        "draw_s_per_step_amortised": total_s / gap,
    }
    if method in ("apollo", "apollo_mini"):
        out["held_host_bytes"] = total_bytes  # pinned on a GPU run, for the whole run
        out["copy_bytes_per_step"] = total_bytes  # each step copies every held basis
        out["draw_s_per_step_if_redrawn"] = total_s  # what a CPU redraw at every step would cost
        out["draw_cpu_s_per_step_if_redrawn"] = total_cpu_s
    if method == "golore":
        out["held_host_bytes"] = total_bytes  # after the switch, when the bases are redrawn every step
        out["copy_bytes_per_step"] = total_bytes
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama_1b", help="the recipes folder and model preset")
    p.add_argument("--repeats", type=int, default=5, help="timed draws per shape (median)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    torch.set_num_threads(1)
    results = []
    for method in METHODS:
        log(f"{method}...")
        results.append(measure(method, args.preset, args.repeats))
    for r in results:
        big = r["largest_basis"]
        print(
            f"{r['method']:12s} largest {tuple(big['shape'])} {big['bytes'] / 1e6:6.2f} MB "
            f"{big['draw_s'] * 1e3:7.2f} ms ({big['draw_cpu_s'] * 1e3:.2f} CPU); "
            f"all {r['per_set_bytes'] / 1e6:8.1f} MB "
            f"{r['per_set_draw_s']:6.3f} s ({r['per_set_draw_cpu_s']:.3f} CPU) "
            f"per {r['drawn_at'].split(' ')[0]}, "
            f"{r['draw_s_per_step_amortised'] * 1e3:6.2f} ms/step amortised over {r['gap_steps']}"
        )
    if args.out:
        # The machine's load beside the figures: on a shared machine the draws' times scale with it.
        load = {"load_average_1m": os.getloadavg()[0], "cpus": os.cpu_count()}
        write_result(
            args.out,
            {"preset": args.preset, "threads": 1, "repeats": args.repeats, **load, "methods": results},
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Optimizer-step benchmark: our GaLoreAdamW against galore-torch's on LLaMA linear-layer shapes.

For each weight shape (llama_60m: 512x512, 1376x512, 512x1376 at rank 128; llama_1b: 2048x2048,
5461x2048, 2048x5461 at rank 512) it runs both optimizers in one process, alternating them, and
prints one row per shape:

* amortized step: mean wall time per step over one refresh period of T = `--gap` steps,
  (t_refresh_step + (T - 1) t_step) / T, from medians of measured refresh steps and plain steps
  (the two optimizers alternate step by step, and which goes first alternates too); "plain
  ratio" is ours / galore-torch's t_step;
* refresh: wall time to compute the basis alone, best of the repetitions (ours: `compute_basis`
  with the randomized_svd defaults, cold start; galore-torch: its projector's thin SVD); the
  target is checked on this cold-start ratio. "warm ratio" is ours warm-started from the previous
  basis (what every refresh after a run's first computes, `warm_start=True`) over the same SVD;
* state bytes: tensors each optimizer holds for the weight (galore-torch's basis lives inside its
  projector object; it is counted too);
* energy: the share of gradient energy ||proj(G)||^2 / ||G||^2 our randomized basis captures
  (cold start), the exact top-r SVD basis's, their ratio, and the ratio for a warm-started
  basis (what every refresh after the first computes), on gradients with a power-law spectrum.

Each measurement follows an untimed warm-up of both sides (first-call costs are not steady state).
Targets are printed beside the measured ratios and not asserted: state bytes <= galore-torch's,
refresh <= 0.2 x, amortized step <= 0.9 x, captured energy within 1% of exact.

Usage: ``python benchmarks/optimizer_step.py --quick`` (CPU, a few minutes on 2 cores) or
``--sizes 60m,1b --device cuda``. ``--out PATH`` also writes the settings and one row per shape as
JSON with their provenance (commit, machine, torch, date); by default only the table is printed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import sys
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import write_result  # noqa: E402

from optimizers import projection as proj  # noqa: E402
from optimizers.galore import GaLoreAdamW  # noqa: E402

SIZES: dict[str, dict] = {
    "60m": {"rank": 128, "shapes": [(512, 512), (1376, 512), (512, 1376)]},
    "1b": {"rank": 512, "shapes": [(2048, 2048), (5461, 2048), (2048, 5461)]},
}
# --quick keeps every 60m shape and the largest 1b one: the 1b exact SVDs dominate a CPU run.
QUICK_SHAPES: dict[str, list[tuple[int, int]]] = {"60m": SIZES["60m"]["shapes"], "1b": [(2048, 5461)]}


def reference_galore() -> type[torch.optim.Optimizer]:
    """galore_torch's GaLoreAdamW, imported without its package __init__ (which loads bitsandbytes)."""
    if "galore_torch" in sys.modules:
        return importlib.import_module("galore_torch.adamw").AdamW
    spec = importlib.util.find_spec("galore_torch")
    if spec is None:
        raise SystemExit("galore-torch is not installed: pip install galore-torch")
    shell = types.ModuleType("galore_torch")
    shell.__path__ = list(spec.submodule_search_locations or [])
    sys.modules["galore_torch"] = shell
    try:
        return importlib.import_module("galore_torch.adamw").AdamW
    finally:
        del sys.modules["galore_torch"]


def decaying_gradient(m: int, n: int, decay: float, seed: int, device: torch.device) -> torch.Tensor:
    """G = A diag(s) B^T with Gaussian A, B (near-orthogonal columns) and s_i = (i + 1)^-decay.

    Gradients of LLM linear layers have such power-law spectra; the near-orthogonality of random
    high-dimensional vectors gives the spectrum without an expensive QR.
    """
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    a = torch.randn(m, k, generator=gen) / m**0.5
    b = torch.randn(n, k, generator=gen) / n**0.5
    s = (1.0 + torch.arange(k, dtype=torch.float32)) ** (-decay)
    return ((a * s) @ b.t()).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def tensor_bytes(obj: object) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    return 0


def state_bytes_of(opt: torch.optim.Optimizer) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            total += tensor_bytes(v)
            total += tensor_bytes(getattr(v, "ortho_matrix", None))  # galore-torch's projector
    return total


def time_steps(
    make: Callable[[str], tuple[torch.nn.Parameter, torch.optim.Optimizer]],
    numel: int,
    args: argparse.Namespace,
    device: torch.device,
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, int]]:
    """Times both optimizers' refresh steps and plain steps, alternately; returns the samples of
    each (by kind, "ours" / "ref") and the state bytes each holds after them."""
    # Both optimizers live side by side and are timed alternately, step by step, so that load
    # from other processes on a shared machine hits both alike; medians are reported.
    refresh_step: dict[str, list[float]] = {"ours": [], "ref": []}
    plain_step: dict[str, list[float]] = {"ours": [], "ref": []}
    state: dict[str, int] = {}
    # Untimed warm-up of both (first-call costs: allocator, BLAS/LAPACK workspaces, lazy imports).
    warm = {kind: make(kind) for kind in ("ours", "ref")}
    for _ in range(2):
        for _, opt in warm.values():
            opt.step()
    del warm
    # A 60M-size step takes milliseconds: many samples there make the medians steady on a shared
    # machine; a 1B-size step takes a second or more on a CPU.
    steps = args.steps if args.steps is not None else (50 if numel <= 1 << 20 else 5)
    # Which one runs first alternates from round to round: the second of a pair finds caches
    # warmed by the first (the same G), which would otherwise favour one side throughout.
    orders = (("ours", "ref"), ("ref", "ours"))
    for rep in range(args.reps):
        pair = {kind: make(kind) for kind in orders[rep % 2]}
        for kind in orders[rep % 2]:
            refresh_step[kind].append(timed(pair[kind][1].step, device))
        for i in range(steps):
            for kind in orders[(rep + i) % 2]:
                plain_step[kind].append(timed(pair[kind][1].step, device))
        state = {kind: state_bytes_of(opt) for kind, (_, opt) in pair.items()}
        del pair
    return refresh_step, plain_step, state


def time_refreshes(
    grad: torch.Tensor, rank: int, side: str, ours_kw: dict, args: argparse.Namespace, device: torch.device
) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """Times the basis computation alone, ours (randomized_svd, cold start) against galore-torch's
    projector (the exact top-r basis), alternately; returns the samples and the last bases."""
    m, n = grad.shape
    refresh: dict[str, list[float]] = {"ours": [], "ref": []}
    bases = {}
    ref_projector = importlib.import_module("galore_torch.galore_projector").GaLoreProjector(
        rank, proj_type="std"
    )
    # A basis computation of a 60M-size matrix takes milliseconds: time it more often there.
    refresh_reps = args.reps if m * n > 1 << 20 else max(args.reps, 15)
    compute = {
        "ours": lambda rep: proj.compute_basis(
            grad, rank, side, "randomized_svd", seed=rep, refresh=1, **ours_kw
        ),
        "ref": lambda rep: ref_projector.get_orthogonal_matrix(grad, rank, side),  # the exact top-r basis
    }
    orders = (("ours", "ref"), ("ref", "ours"))
    for rep in range(-1, refresh_reps):  # rep -1 is an untimed warm-up
        for kind in orders[rep % 2]:
            t0 = time.perf_counter()
            bases[kind] = compute[kind](rep)
            sync(device)
            refresh[kind].append(time.perf_counter() - t0)
        if rep < 0:
            refresh = {"ours": [], "ref": []}
    return refresh, bases


def warm_start(
    grad: torch.Tensor, rank: int, side: str, ours_kw: dict, args: argparse.Namespace, device: torch.device
) -> tuple[float, list[float]]:
    """The energy share a warm-started randomized_svd basis captures and its timing samples."""
    m, n = grad.shape
    g2 = float(grad.norm() ** 2)
    # A later refresh starts from the previous basis: model the gradient one period earlier as
    # this one plus an independent part of half its size, and warm-start from its basis.
    earlier = grad + 0.5 * decaying_gradient(m, n, args.decay, seed=m * 7 + n + 1, device=device)
    prev = proj.compute_basis(earlier, rank, side, "randomized_svd", seed=0, refresh=1, **ours_kw)
    warm = proj.compute_basis(grad, rank, side, "randomized_svd", prev, seed=0, refresh=2, **ours_kw)
    e_warm = float(proj.project(grad, warm, side).norm() ** 2) / g2
    # Its cost: the sketch reuses the previous basis, so only p columns need a product with G.
    refresh_reps = args.reps if m * n > 1 << 20 else max(args.reps, 15)
    warm_times = []
    for rep in range(refresh_reps):
        t0 = time.perf_counter()
        proj.compute_basis(grad, rank, side, "randomized_svd", prev, seed=rep, refresh=2, **ours_kw)
        sync(device)
        warm_times.append(time.perf_counter() - t0)
    return e_warm, warm_times


def bench_shape(
    shape: tuple[int, int], rank: int, args: argparse.Namespace, ref_cls: type, device: torch.device
) -> dict[str, float]:
    m, n = shape
    grad = decaying_gradient(m, n, args.decay, seed=m * 7 + n, device=device)
    w0 = (0.02 * torch.randn(m, n, generator=torch.Generator().manual_seed(1))).to(device)
    group = {"rank": rank, "update_proj_gap": args.gap, "scale": 0.25, "proj_type": "std"}
    ours_kw = {"oversample": args.oversample, "power_iters": args.power_iters}

    def make(kind: str) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
        w = torch.nn.Parameter(w0.clone())
        w.grad = grad.clone()
        if kind == "ours":
            return w, GaLoreAdamW([{"params": [w], **group, **ours_kw}], lr=1e-3)
        return w, ref_cls([{"params": [w], **group}], lr=1e-3, no_deprecation_warning=True)

    refresh_step, plain_step, state = time_steps(make, m * n, args, device)
    side = proj.choose_side(shape, "std")
    refresh, bases = time_refreshes(grad, rank, side, ours_kw, args, device)
    approx, exact = bases["ours"], bases["ref"]
    g2 = float(grad.norm() ** 2)
    e_exact = float(proj.project(grad, exact, side).norm() ** 2) / g2
    e_ours = float(proj.project(grad, approx, side).norm() ** 2) / g2
    e_warm, warm_times = warm_start(grad, rank, side, ours_kw, args, device)

    med = statistics.median
    amort = {
        k: (med(refresh_step[k]) + (args.gap - 1) * med(plain_step[k])) / args.gap for k in ("ours", "ref")
    }
    return {
        "plain_ratio": med(plain_step["ours"]) / med(plain_step["ref"]),
        "amort_ours": amort["ours"],
        "amort_ref": amort["ref"],
        # Best of the repetitions: a basis computation is short and load from other processes
        # only ever adds time.
        "refresh_ours": min(refresh["ours"]),
        "refresh_ref": min(refresh["ref"]),
        "refresh_warm": min(warm_times),
        "state_ours": state["ours"],
        "state_ref": state["ref"],
        "energy_ours": e_ours,
        "energy_exact": e_exact,
        "energy_warm": e_warm,
    }


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="60m,1b", help="comma list of: " + ", ".join(SIZES))
    ap.add_argument("--quick", action="store_true", help="fewer matrices and repetitions (CPU smoke run)")
    ap.add_argument("--gap", type=int, default=200, help="update_proj_gap T the step time is amortized over")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="plain steps timed per repetition (default 50; 5 above 1M entries)",
    )
    ap.add_argument("--reps", type=int, default=None, help="repetitions (medians are reported)")
    ap.add_argument("--oversample", type=int, default=proj.DEFAULT_OVERSAMPLE, help="randomized_svd p")
    ap.add_argument("--power-iters", type=int, default=proj.DEFAULT_POWER_ITERS, help="randomized_svd q")
    ap.add_argument("--decay", type=float, default=1.0, help="spectrum s_i = (i + 1)^-decay of the gradients")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows (JSON, with provenance) here")
    return ap.parse_args(argv)


def _format_row(size: str, shape: tuple[int, int], rank: int, row: dict) -> str:
    """One table line: amortized and refresh times, state and captured energy, ours beside galore-torch's."""
    mib = 1 / 2**20
    return (
        f"{size:>4} {f'{shape[0]}x{shape[1]}':>11} {rank:>4} | "
        f"{row['amort_ours']:>10.4f} {row['amort_ref']:>11.4f} {row['amort_ours'] / row['amort_ref']:>6.2f} "
        f"{row['plain_ratio']:>6.2f} | "
        f"{row['refresh_ours']:>8.3f} {row['refresh_ref']:>8.3f} "
        f"{row['refresh_ours'] / row['refresh_ref']:>6.3f} "
        f"{row['refresh_warm'] / row['refresh_ref']:>6.3f} | "
        f"{row['state_ours'] * mib:>7.2f} {row['state_ref'] * mib:>7.2f} "
        f"{row['state_ours'] / row['state_ref']:>6.3f} | "
        f"{row['energy_ours']:>6.4f} {row['energy_exact']:>6.4f} "
        f"{row['energy_ours'] / row['energy_exact']:>7.4f} {row['energy_warm'] / row['energy_exact']:>7.4f}"
    )


def _settings(args: argparse.Namespace, device: torch.device) -> dict:
    """The run's settings, as the result file records them."""
    return {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "sizes": args.sizes.split(","),
        "quick": args.quick,
        "gap": args.gap,
        "oversample": args.oversample,
        "power_iters": args.power_iters,
        "decay": args.decay,
        "reps": args.reps,
        "steps": args.steps,
    }


def _print_header(args: argparse.Namespace, device: torch.device) -> None:
    print(
        f"device={device} threads={torch.get_num_threads()} torch={torch.__version__} gap={args.gap} "
        f"randomized_svd(p={args.oversample}, q={args.power_iters}) spectrum=(i+1)^-{args.decay} "
        f"reps={args.reps} steps={args.steps or 'auto'}"
    )
    header = (
        f"{'size':>4} {'shape':>11} {'r':>4} | {'amortized step s':>22} {'ratio':>6} {'plain':>6} | "
        f"{'refresh s':>17} {'ratio':>6} {'warm':>6} | {'state MiB':>15} {'ratio':>6} | {'energy':>13} {'rel':>7} {'warm':>7}"
    )
    sub = (
        f"{'':>4} {'':>11} {'':>4} | {'ours':>10} {'galore':>11} {'<=0.9':>6} {'ratio':>6} | "
        f"{'ours':>8} {'galore':>8} {'<=0.2':>6} {'ratio':>6} | {'ours':>7} {'galore':>7} {'<=1':>6} | "
        f"{'rsvd':>6} {'exact':>6} {'>=0.99':>7} {'rel':>7}"
    )
    print(header)
    print(sub)
    print("-" * len(header))


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    args.reps = args.reps if args.reps is not None else 3
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore", category=FutureWarning)
    ref_cls = reference_galore()

    _print_header(args, device)
    rows = []
    for size in args.sizes.split(","):
        spec = SIZES[size]
        shapes = QUICK_SHAPES[size] if args.quick else spec["shapes"]
        for shape in shapes:
            row = bench_shape(shape, spec["rank"], args, ref_cls, device)
            print(_format_row(size, shape, spec["rank"], row), flush=True)
            rows.append({"size": size, "shape": list(shape), "rank": spec["rank"], **row})
    result = {
        "benchmark": "benchmarks/optimizer_step.py",
        "command": " ".join(
            ["python benchmarks/optimizer_step.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "settings": _settings(args, device),
        "rows": rows,
    }
    if args.out is not None:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()

"""Times the QR-core refactorization against a full SVD of the dense product B A.

Both compute the balanced split B' = U S^1/2, A' = S^1/2 V^T of W = B A (the benchmark, Glentis et al. 2025):

- qr-core (optimizers.refactorization.balanced_factors): thin QR of B (m x r) and A^T (n x r), SVD of
  the r x r core R_B R_A^T; O((m + n) r^2 + r^3), never forms the m x n product;
- full SVD: form W = B A (m x n), torch.linalg.svd(W, full_matrices=False), keep the top r;
  O(m n r) for the product plus O(m n min(m, n)) for the SVD.

Defaults are the llama_1b MLP shapes at the benchmark's rank: B 2048 x 512, A 512 x 5461, r = 512.
The two methods alternate for `--repeats` rounds after a small warm-up. The speedup is the ratio of
the fastest runs (the least disturbed by other load on a shared machine); the ratio of the medians is
printed beside it.
Reconstruction errors are ||B' A' - B A||_F / ||B A||_F, evaluated in fp64. ``--out PATH`` writes
the figures as JSON with their provenance (commit, machine, torch, date); by default none is written.

    python benchmarks/refactorization.py [--m 2048] [--n 5461] [--rank 512] [--repeats 3] [--device cpu]
        [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _bench import write_result
from torch import Tensor

from optimizers.refactorization import balanced_factors


def full_svd_split(B: Tensor, A: Tensor) -> tuple[Tensor, Tensor]:
    """The textbook definition: SVD of the dense m x n product, then split sqrt(S) to each side."""
    r = B.shape[1]
    U, S, Vh = torch.linalg.svd(B.float() @ A.float(), full_matrices=False)
    root = S[:r].sqrt()
    return U[:, :r] * root, root[:, None] * Vh[:r]


def reconstruction_error(B: Tensor, A: Tensor, B_new: Tensor, A_new: Tensor) -> float:
    ref = B.double() @ A.double()
    return ((B_new.double() @ A_new.double() - ref).norm() / ref.norm()).item()


def _timed(
    fn: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], B: Tensor, A: Tensor
) -> tuple[float, tuple]:
    if B.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(B, A)
    if B.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def _print_report(result: dict, times: dict[str, list[float]]) -> None:
    """The human-readable lines: each method's fastest and median run, its error, the speedup."""
    (m, r), n = result["shapes"]["B"], result["shapes"]["A"][1]
    print(f"refactorization of B {m} x {r}, A {r} x {n} on {result['device']} ({result['threads']} threads)")
    for name in ("qr_core", "full_svd"):
        runs = ", ".join(f"{t:.3f}" for t in times[name])
        print(
            f"  {name:9s} min {result[name + '_min_s']:8.3f} s  median {result[name + '_median_s']:8.3f} s  "
            f"runs [{runs}]  rel. error {result[name + '_rel_error']:.2e}"
        )
    verdict = "met" if result["speedup"] >= 20 else "NOT met"
    print(
        f"  speedup {result['speedup']:.1f}x on the fastest runs, {result['speedup_median']:.1f}x on the "
        f"medians (target >= 20x: {verdict})"
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=2048, help="rows of B (out_features)")
    ap.add_argument("--n", type=int, default=5461, help="columns of A (in_features)")
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--out", type=Path, help="also write the result (JSON, with provenance) here")
    args = ap.parse_args(argv)

    g = torch.Generator().manual_seed(args.seed)
    m, n, r = args.m, args.n, args.rank
    # nn.Linear-like scales (U(+-1/sqrt(fan_in)) ~ N(0, 1/(3 fan_in))), with B 10x too large so the
    # split is far from balanced, as it drifts during training.
    B = (10.0 * torch.randn(m, r, generator=g) / (3 * r) ** 0.5).to(args.device)
    A = (torch.randn(r, n, generator=g) / (3 * n) ** 0.5).to(args.device)

    # Warm-up on small shapes: LAPACK/cuSOLVER workspace and thread-pool start-up are not the point.
    small_B, small_A = B[:256, :32].contiguous(), A[:32, :256].contiguous()
    balanced_factors(small_B, small_A)
    full_svd_split(small_B, small_A)

    times: dict[str, list[float]] = {"qr_core": [], "full_svd": []}
    outputs = {}
    for _ in range(args.repeats):
        for name, fn in (("qr_core", balanced_factors), ("full_svd", full_svd_split)):
            dt, outputs[name] = _timed(fn, B, A)
            times[name].append(dt)

    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    result = {
        "shapes": {"B": [m, r], "A": [r, n]},
        "device": str(B.device) if not B.is_cuda else torch.cuda.get_device_name(B.device),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "qr_core_s": times["qr_core"],
        "full_svd_s": times["full_svd"],
        "qr_core_min_s": best["qr_core"],
        "full_svd_min_s": best["full_svd"],
        "qr_core_median_s": med["qr_core"],
        "full_svd_median_s": med["full_svd"],
        "speedup": best["full_svd"] / best["qr_core"],
        "speedup_median": med["full_svd"] / med["qr_core"],
        "qr_core_rel_error": reconstruction_error(B, A, *outputs["qr_core"]),
        "full_svd_rel_error": reconstruction_error(B, A, *outputs["full_svd"]),
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps(result))
    else:
        _print_report(result, times)
    if args.out is not None:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()

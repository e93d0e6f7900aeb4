"""Saved-for-backward bytes of one SLTrain layer forward: the dense-weight graph vs SLTrainLinear.

For every paper size (llama_60m .. llama_1b) the rank, alpha and density come from the size's
``recipes/llama_*/sltrain.yaml`` and the shapes from the preset: attention (q/k/v/o, h -> h, four
per block), MLP gate/up (h -> i, two per block) and MLP down (i -> h, one per block). Each shape is
run once per dtype with `--tokens` input rows through

- dense: autograd through y = x (s B A + S)^T + b, the layer's forward before issue 14 (the graph
  keeps the m x n weight W for F.linear's backward, and the values too: index_add_'s backward
  saves its source);
- layer: `SLTrainLinear` (saves x, B, A, the values and the index; recomputes W in the backward).

Bytes are those of the distinct storages the forward's graph saves (torch.autograd.graph.
saved_tensors_hooks), with x, B, A and the values all requiring grad. The layer's figure is checked
against its docstring formula bytes(x) + r (m + n) e + nnz e + 8 nnz. What a layer saves beyond its
input does not depend on the number of tokens, so "minus_x" columns are the per-layer constants; the
per-model line multiplies the dense - layer difference by the targets per block and the blocks.

Writes a JSON file (default ``benchmarks/results/sltrain_saved.json``) with the commit, machine,
torch version and date, and prints a table. Each row also records the largest output difference
between the two forwards (0 on CPU). About 5 CPU-minutes with one thread, most of it the bf16
products at llama_1b shapes.

    python benchmarks/sltrain_saved.py [--tokens 256] [--dtypes bfloat16 float32] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _bench import write_result
from torch import Tensor

from effpretrain.config import load_config
from effpretrain.memory import saved_tensor_bytes
from effpretrain.models.factorized import SLTrainLinear
from effpretrain.models.llama import PRESETS

ROOT = Path(__file__).resolve().parent.parent
SIZES = ("60m", "130m", "350m", "1b")


def dense_forward(layer: SLTrainLinear, x: Tensor) -> Tensor:
    """y = x (s B A + S)^T + b through autograd on the dense weight (the pre-issue-14 forward)."""
    w = torch.mm(layer.B, layer.A).mul_(layer.scale)
    w.view(-1).index_add_(0, layer.sparse_index, layer.sparse_values)
    return F.linear(x, w, layer.bias)


def shapes(size: str) -> list[tuple[str, int, int, int]]:
    """(name, in n, out m, targets per block) of the factorized projections of llama_`size`."""
    p = PRESETS[f"llama_{size}"]
    return [
        ("attn", p.hidden, p.hidden, 4),
        ("mlp_up", p.hidden, p.intermediate, 2),
        ("mlp_down", p.intermediate, p.hidden, 1),
    ]


def measure(n: int, m: int, rank: int, alpha: float, density: float, dtype: torch.dtype, tokens: int) -> dict:
    """Saved bytes of one forward of an n -> m layer, dense graph vs SLTrainLinear."""
    torch.manual_seed(0)
    layer = SLTrainLinear(n, m, rank, alpha, density=density, dtype=dtype)
    with torch.no_grad():
        layer.B.normal_()  # B starts at zero; the bytes do not depend on it, the check below does
    x = torch.randn(tokens, n, dtype=dtype, requires_grad=True)
    new, _ = saved_tensor_bytes(lambda: layer(x))
    old, _ = saved_tensor_bytes(lambda: dense_forward(layer, x))
    e, nnz = layer.B.element_size(), layer.sparse_index.numel()
    x_bytes = x.numel() * e
    formula = x_bytes + rank * (m + n) * e + nnz * e + 8 * nnz
    if new != formula:
        raise AssertionError(f"{n} -> {m}: the layer saved {new} bytes, its docstring formula says {formula}")
    with torch.no_grad():
        diff = (layer(x) - dense_forward(layer, x)).abs().max().item()
    return {
        "nnz": nnz,
        "x_bytes": x_bytes,
        "dense_bytes": old,
        "layer_bytes": new,
        "dense_minus_x": old - x_bytes,
        "layer_minus_x": new - x_bytes,
        "dense_weight_bytes": m * n * e,
        "max_abs_output_diff": diff,
    }


def run(tokens: int, dtypes: list[str]) -> tuple[list[dict], list[dict]]:
    """One row per (size, shape, dtype) and one per-model total per (size, dtype)."""
    rows, models = [], []
    for size in SIZES:
        cfg = load_config(ROOT / "recipes" / f"llama_{size}" / "sltrain.yaml")
        f, layers = cfg.factor, PRESETS[f"llama_{size}"].layers
        for dtype_name in dtypes:
            total = 0
            for name, n, m, per_block in shapes(size):
                r = measure(n, m, f.rank, f.alpha, f.density, getattr(torch, dtype_name), tokens)
                rows.append(
                    {
                        "size": size,
                        "shape": name,
                        "in": n,
                        "out": m,
                        "rank": f.rank,
                        "alpha": f.alpha,
                        "density": f.density,
                        "dtype": dtype_name,
                        "tokens": tokens,
                        **r,
                    }
                )
                total += per_block * (r["dense_bytes"] - r["layer_bytes"])
            models.append(
                {"size": size, "dtype": dtype_name, "blocks": layers, "saved_less_bytes": total * layers}
            )
    return rows, models


def _mb(b: int) -> str:
    return f"{b / 1e6:9.2f}"


def print_table(rows: list[dict], models: list[dict]) -> None:
    print(
        f"{'size':>5} {'shape':>9} {'in':>5} {'out':>5} {'r':>4} {'dtype':>9} | "
        f"MB: {'dense':>9} {'layer':>9} {'x':>9} | minus x: {'dense':>9} {'layer':>9}"
    )
    for r in rows:
        print(
            f"{r['size']:>5} {r['shape']:>9} {r['in']:>5} {r['out']:>5} {r['rank']:>4} {r['dtype']:>9} | "
            f"    {_mb(r['dense_bytes'])} {_mb(r['layer_bytes'])} {_mb(r['x_bytes'])} |          "
            f"{_mb(r['dense_minus_x'])} {_mb(r['layer_minus_x'])}"
        )
    for mo in models:
        print(
            f"llama_{mo['size']} {mo['dtype']}: the layer saves {mo['saved_less_bytes'] / 1e9:.3f} GB "
            f"less per forward than the dense graph ({mo['blocks']} blocks)"
        )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="input rows per forward (one 256-token sequence)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sltrain_saved.json")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows, models = run(args.tokens, args.dtypes)
    result = {
        "benchmark": "benchmarks/sltrain_saved.py",
        "command": " ".join(
            ["python benchmarks/sltrain_saved.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "rows": rows,
        "per_model": models,
    }
    write_result(args.out, result)  # with provenance: commit, machine, torch, date
    print_table(rows, models)
    return result


if __name__ == "__main__":
    main()

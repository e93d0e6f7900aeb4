"""benchmarks/basis_draws.py (the cost of G7's CPU draws): it runs at the tiny recipes' shapes and
counts every projected matrix, and docs/gpu.md's table is the committed JSON's figures."""

from __future__ import annotations

import json
import re

import pytest
from bench_scripts import ROOT, load

bd = load("basis_draws")
RESULT = ROOT / "benchmarks" / "results" / "basis_draws.json"
#: docs/gpu.md's G7 table: the row's first words, and the method whose figures it shows.
ROWS = {
    "APOLLO basis": "apollo",
    "APOLLO-Mini basis": "apollo_mini",
    "GoLore's Gaussian": "golore",
    "randomized SVD sketch": "galore",
    "ReLoRA's new A": "relora",
}


def test_tiny_run_counts_every_projected_matrix_and_writes_its_provenance(tmp_path):
    out = tmp_path / "draws.json"
    assert bd.main(["--preset", "tiny", "--repeats", "1", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["commit"] and saved["machine"] and saved["load_average_1m"] >= 0
    by_method = {m["method"]: m for m in saved["methods"]}
    assert set(by_method) == set(bd.METHODS)
    apollo = by_method["apollo"]
    # One basis per projected matrix: the tiny preset's layers x the recipe's 7 targets.
    from effpretrain.memory import model_param_shapes

    linears = [
        s
        for s in model_param_shapes("tiny")
        if s.linear in bd.load_config(ROOT / "recipes" / "tiny" / "apollo.yaml", []).optim.targets
    ]
    assert sum(r["count"] for r in apollo["bases"]) == len(linears) > 0
    assert apollo["per_set_bytes"] == sum(r["bytes"] * r["count"] for r in apollo["bases"])
    assert apollo["copy_bytes_per_step"] == apollo["per_set_bytes"]


UNITS = {"ms": 1e-3, "s": 1.0, "kB": 1e3, "MB": 1e6}


def _quantities(cell: str) -> list[float]:
    """The "<number> <unit>" quantities of a table cell, in seconds or bytes."""
    found = re.findall(r"([\d.,]+) (ms|s|kB|MB)\b", cell)
    return [float(n.replace(",", "")) * UNITS[u] for n, u in found]


def test_docs_table_is_the_committed_figures():
    saved = {m["method"]: m for m in json.loads(RESULT.read_text())["methods"]}
    lines = (ROOT / "docs" / "gpu.md").read_text().splitlines()
    seen = set()
    for label, method in ROWS.items():
        (row,) = [ln for ln in lines if ln.startswith(f"| {label}")]
        cells = [c.strip() for c in row.strip("|").split("|")]
        m = saved[method]
        big = m["largest_basis"]
        assert cells[1] == " x ".join(map(str, big["shape"])), row
        # The table rounds to two or three digits: 6% or half a unit of its last digit.
        (nbytes,) = _quantities(cells[2])
        assert nbytes == pytest.approx(big["bytes"], rel=0.05), row
        (cpu,) = _quantities(cells[3])
        assert cpu == pytest.approx(big["draw_cpu_s"], rel=0.06, abs=0.5e-5), row
        set_bytes, set_s = _quantities(cells[4])
        assert set_bytes == pytest.approx(m["per_set_bytes"], rel=0.02), row
        assert set_s == pytest.approx(m["per_set_draw_cpu_s"], rel=0.06, abs=0.5e-3), row
        (amortised,) = _quantities(cells[6])
        assert amortised == pytest.approx(m["per_set_draw_cpu_s"] / m["gap_steps"], rel=0.06, abs=0.5e-5), row
        seen.add(method)
    assert seen == set(bd.METHODS)

"""benchmarks/memory.py: a grid row compares estimate and measurement, flags, table and loss section."""

from __future__ import annotations

import json

import pytest
from _common import ROOT
from bench_scripts import load

bench = load("memory")
SMALL = ("train.batch_size=2", "data.seq_len=16")


def test_grid_covers_every_tiny_recipe_and_the_llama_20m_methods():
    cases = bench.grid()
    assert {r for r, p in cases if p == "tiny"} == {
        p.stem for p in (ROOT / "recipes" / "tiny").glob("*.yaml")
    }
    assert [r for r, p in cases if p == "llama_20m"] == ["adamw", "galore", "lowrank_restarts", "sltrain"]
    assert bench.grid(["galore"]) == [("galore", "tiny"), ("galore", "llama_20m")]


@pytest.mark.parametrize("recipe", ["adamw_8bit", "galore"])
def test_a_tiny_row_matches_the_estimate(recipe):
    row = bench.run_case(recipe, "tiny", SMALL)
    assert row["flags"] == [], row
    for c in bench.EXACT:
        assert row["measured"][c] == row["estimated"][c] > 0
    assert len(row["steps"]) == 2 and row["batch_size"] == 2
    table = bench.format_table([row])
    assert f"{recipe}@tiny" in table and "!" not in table


def test_flags_exact_inequality_and_ratio_beyond_tolerance():
    class Est:
        weights, grads, optimizer_state, activations, peak = 100, 100, 100, 100, 100

    step = {"weights": 100, "gradients": 101, "optimizer_state": 100, "activations": 111, "peak": 109}
    got = bench.compare(Est(), [step, {**step, "gradients": 100, "peak": 50}])
    assert got["measured"]["peak"] == 109  # the largest over the steps
    assert got["flags"] == ["gradients", "activations"]
    assert got["ratio"]["activations"] == pytest.approx(1.11)
    assert "!" in bench.format_table([{"recipe": "x", "preset": "tiny", **got}])


def test_loss_section_standard_vs_chunked():
    section = bench.loss_section(tokens=256, vocab=512, hidden=16)
    est = section["estimated"]
    assert est["chunked"]["saved"] < est["standard"]["saved"]
    if section["measured"] is None:  # this commit has no chunked loss to measure: said so
        assert "measure_loss_bytes" in section["reason"]
    else:
        assert section["measured"]["chunked"]["peak"] < section["measured"]["standard"]["peak"]
    # Estimates only (nothing allocated): at 8,192 tokens x 32,000 the logits dominate llama_20m's peak.
    recipe_shape, large = bench.llama_20m_loss_peaks()
    assert large["vocab_size"] == 32000 and large["batch_size"] * large["seq_len"] == 8192
    assert large["chunked"]["peak"] < 0.6 * large["standard"]["peak"]
    assert recipe_shape["chunked"]["peak"] <= recipe_shape["standard"]["peak"]


def test_only_one_section_keeps_the_other(tmp_path):
    out = tmp_path / "memory.json"
    out.write_text(json.dumps({"rows": [{"kept": True}]}))
    assert bench.main(["--only", "loss", "--loss-shape", "256", "512", "16", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["rows"] == [{"kept": True}] and got["loss"]["tokens"] == 256 and got["commit"]


def test_the_committed_results_cover_the_grid_as_the_docs_say():
    """``benchmarks/results/memory.json`` holds a row for every grid case (a new tiny recipe needs
    a new run), with the commit and machine it came from, nothing flagged, and the peak ratio
    range docs/development.md quotes."""
    got = json.loads((ROOT / "benchmarks" / "results" / "memory.json").read_text())
    assert [(r["recipe"], r["preset"]) for r in got["rows"]] == bench.grid()
    assert got["commit"] and got["machine"] and got["flagged"] == []
    assert all(r["measured"][c] == r["estimated"][c] for r in got["rows"] for c in bench.EXACT)
    ratios = [r["ratio"]["peak"] for r in got["rows"]]
    doc = (ROOT / "docs" / "development.md").read_text()
    assert f"commit {got['commit']}" in doc
    assert f"ratios {min(ratios):.4f}-{max(ratios):.4f}" in doc

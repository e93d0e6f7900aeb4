"""benchmarks/gpu_check.py: its smoke runs every section's code on the CPU in under 90 s and exits
0; a section whose package is missing is reported skipped while the rest runs; the budget stops it
cleanly; the docs' "On a GPU" tables are the committed JSON rendered."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from _common import child_env
from bench_scripts import ROOT, load

gc = load("gpu_check")


@pytest.mark.run
def test_smoke_runs_every_section_on_cpu_within_90_seconds(tmp_path):
    env = child_env()
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    wall = time.monotonic() - t0
    print(f"gpu_check --smoke: {wall:.1f} s wall, exit {proc.returncode}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert wall < 90
    for section in gc.SECTIONS:
        saved = json.loads((tmp_path / f"{section}.json").read_text())
        assert saved["device"].startswith("cpu") and saved["commit"] and saved["torch"]
        rows = saved["rows"]
        assert rows and all(r["status"] == "ok" for r in rows), rows
        assert (tmp_path / f"{section}.md").read_text().startswith(f"### {section}")
    rows = {s: json.loads((tmp_path / f"{s}.json").read_text())["rows"] for s in gc.SECTIONS}
    # Every registry row is checked, and the CPU against itself is exact.
    assert len(rows["numerics"]) == len(gc.numerics_recipes())
    assert all(r["worst_weight_rel_diff"] == 0 for r in rows["numerics"])
    assert {r["case"] for r in rows["memory"]} == {
        *gc.MEMORY_METHODS,
        "galore_8bit+in_backward+checkpointing",
    }
    assert all(r["measured"]["weights"] == r["estimated"]["weights"] for r in rows["memory"])
    (step,) = rows["step_7b"]  # at tiny scale in the smoke: the same code as the 7B step
    assert step["case"] == "galore_8bit tiny r8 in backward"
    assert all(step["measured"][c] == step["estimated"][c] for c in gc.EXACT), step
    # FSDP2 on one process, updates in backward against the same steps without them: bitwise at
    # fp32 (the CPU has one stream, so this holds whatever the stream ordering; the GPU is the
    # real check), the loss in bf16; every (method, precision) pair of the section.
    pairs = rows["in_backward_fsdp2"]
    assert [r["case"] for r in pairs] == [f"{m} {p}" for m, p in gc.IN_BACKWARD_FSDP2]
    assert all(r["within_target"] for r in pairs), pairs
    assert all(r["bitwise_equal"] for r in pairs if r["precision"] == "fp32"), pairs
    timed = [r for r in rows["speed"] if not r["case"].startswith("ratios")]
    assert len(timed) == 2 * len(gc.SPEED_METHODS) and all(r["tokens_per_s"] > 0 for r in timed)
    assert all(r["mfu"] is None for r in timed)  # no peak for a CPU: never a guess
    assert rows["hf"][-1]["case"] == "effpretrain / HF" and rows["hf"][-1]["tokens_per_s_ratio"] > 0
    assert (tmp_path / "summary.md").is_file()


def test_a_missing_package_skips_its_section_and_the_rest_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "galore_torch", None)  # import galore_torch now fails
    monkeypatch.setattr(gc, "section_numerics", lambda scale, budget: [{"case": "stub", "status": "ok"}])
    code = gc.main(["--smoke", "--out", str(tmp_path), "--sections", "numerics,hf"])
    assert code == 0
    (hf,) = json.loads((tmp_path / "hf.json").read_text())["rows"]
    assert hf["status"] == "skipped" and "galore_torch" in hf["note"]
    assert json.loads((tmp_path / "numerics.json").read_text())["rows"][0]["status"] == "ok"


def test_the_budget_lists_the_cases_it_did_not_reach(tmp_path):
    code = gc.main(["--smoke", "--out", str(tmp_path), "--sections", "memory", "--budget-s", "0.001"])
    assert code == 0
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert rows and all(r["status"] == "not reached" for r in rows)


def test_a_failing_case_is_reported_and_exits_1(tmp_path, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(gc, "memory_case", broken)
    code = gc.main(["--smoke", "--out", str(tmp_path), "--sections", "memory"])
    assert code == 1
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert rows[0]["status"] == "failed" and rows[0]["note"] == "RuntimeError: boom"


@pytest.mark.parametrize("argv", [["--sections", "numerics,warp"], ["--budget-s", "0"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        gc.main(argv)
    assert e.value.code == 2


def test_docs_tables_are_the_committed_json_rendered():
    text = (ROOT / "docs" / "gpu.md").read_text()
    start = text.index(gc.README_START)
    body = text[text.index("\n", start) + 1 : text.index(gc.README_END)]
    assert body == gc.render_results()


def test_rendered_results_show_every_committed_section(tmp_path):
    prov = {"commit": "abc1234", "device": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0"}
    gc.write_section(
        tmp_path, "speed", prov, [{"case": "adamw eager", "status": "ok", "tokens_per_s": 1.5e5}]
    )
    out = gc.render_results(tmp_path)
    assert out.startswith("#### speed\n\nNVIDIA H200; commit abc1234; torch 2.11.0, CUDA 13.0")
    assert "| adamw eager | ok | 1.5e+05 |" in out
    assert gc.render_results(tmp_path / "none").startswith("No GPU run is committed yet")

"""CLI claims: bad input exits 2 with one line and no traceback; estimate matches the paper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "effpretrain", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env=env,
        timeout=300,
    )


def assert_bad_input(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "recipe, extra, needle",
    [
        ("optim:\n  nam: adamw\n", [], "unknown key 'optim.nam'"),
        ("optim:\n  lr: fast\n", [], "optim.lr='fast' has the wrong type"),
        ("optim:\n  lr: -1.0e-3\n", [], "optim.lr=-0.001 must be > 0"),
        (
            "data:\n  source: files\n  path: missing/corpus.txt\n",
            [],
            "data.path not found: missing/corpus.txt",
        ),
        ("{}\n", ["--set", "train.max_steps=-3"], "train.max_steps=-3 must be > 0"),
        ("{}\n", ["--set", "nonsense"], "is not of the form section.key=value"),
    ],
)
def test_train_bad_input_exits_2_one_line(tmp_path, recipe, extra, needle):
    p = tmp_path / "recipe.yaml"
    p.write_text(recipe)
    assert_bad_input(run_cli("train", str(p), "--out", str(tmp_path / "run"), *extra), needle)
    assert not (tmp_path / "run").exists()  # nothing written for a rejected run


def test_missing_recipe_and_bad_flag(tmp_path):
    assert_bad_input(run_cli("train", str(tmp_path / "nope.yaml")), "recipe not found")
    assert_bad_input(run_cli("estimate", "--model", "llama_1b", "--method", "sgdx"), "--method 'sgdx'")
    assert_bad_input(run_cli("estimate", "--model", "gpt5"), "--model 'gpt5'")


def test_estimate_llama_1b_adamw_matches_paper():
    proc = run_cli("estimate", "--model", "llama_1b", "--method", "adamw", "--dtype", "bf16", "--json")
    assert proc.returncode == 0, proc.stderr
    est = json.loads(proc.stdout)
    assert abs(est["weights_plus_optimizer"] - 8.03e9) / 8.03e9 <= 0.005
    table = run_cli("estimate", "--model", "llama_60m", "--method", "adamw")
    assert table.returncode == 0 and "weights + optimizer" in table.stdout

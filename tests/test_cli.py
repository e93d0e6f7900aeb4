"""CLI claims: bad input exits 2 with one line and no traceback; estimate matches the paper."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _common import ROOT, child_env

from effpretrain import cli


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = child_env(threads=None)
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
        # Targets that match nothing, per family that has targets: projection and whole-matrix.
        ("optim:\n  name: galore\n  targets: [nope]\n", [], "matched no linear weight to project"),
        ("optim:\n  name: muon\n  targets: [nope]\n", [], "matched no linear weight to step whole"),
        ("model:\n  config: missing/config.json\n", [], "model.config: missing/config.json: no such file"),
    ],
)
@pytest.mark.run
def test_train_bad_input_exits_2_one_line(tmp_path, recipe, extra, needle):
    p = tmp_path / "recipe.yaml"
    p.write_text(recipe)
    assert_bad_input(run_cli("train", str(p), "--out", str(tmp_path / "run"), *extra), needle)
    assert not (tmp_path / "run").exists()  # nothing written for a rejected run


@pytest.mark.run
def test_python_dash_m_effpretrain_runs_the_cli(monkeypatch, capsys):
    """`python -m effpretrain` is the same command line (its __main__ runs `cli.main`)."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["effpretrain", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("effpretrain", run_name="__main__")
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_missing_recipe_and_bad_flag(tmp_path):
    assert_bad_input(run_cli("train", str(tmp_path / "nope.yaml")), "recipe not found")
    assert_bad_input(run_cli("estimate", "--model", "llama_1b", "--method", "sgdx"), "--method 'sgdx'")
    assert_bad_input(run_cli("estimate", "--model", "gpt5"), "--model 'gpt5'")


@pytest.mark.run
def test_estimate_llama_1b_adamw_matches_paper():
    proc = run_cli("estimate", "--model", "llama_1b", "--method", "adamw", "--dtype", "bf16", "--json")
    assert proc.returncode == 0, proc.stderr
    est = json.loads(proc.stdout)
    assert abs(est["weights_plus_optimizer"] - 8.03e9) / 8.03e9 <= 0.005
    table = run_cli("estimate", "--model", "llama_60m", "--method", "adamw")
    assert table.returncode == 0 and "weights + optimizer" in table.stdout


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """The CLI in this process (a subprocess costs ~11 s of imports)."""
    rc = cli.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_estimate_dtype_takes_the_config_precision_names(capsys):
    def est(*dtype: str) -> dict:
        rc, out, err = run_main(capsys, "estimate", "--model", "llama_60m", *dtype, "--json")
        assert rc == 0, err
        return json.loads(out)

    pure, short, mixed, fp32 = (
        est("--dtype", "bf16-pure"),
        est("--dtype", "bf16"),
        est("--dtype", "bf16-mixed"),
        est("--dtype", "fp32"),
    )
    assert est() == pure == short  # bf16-pure is the default; bf16 is the CLI's shorthand for it
    assert pure["dtype"] == "bf16-pure"
    assert pure["weights"] * 2 == mixed["weights"] == fp32["weights"]
    # bf16-mixed keeps an fp32 residual stream and autocast copies (tests/test_memory.py measures them)
    assert pure["activations"] < mixed["activations"] and pure["activations"] < fp32["activations"]
    assert pure["peak"] < fp32["peak"] and pure["peak"] == sum(pure["peak_terms"].values())


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
        (["--batch-size", "-1"], "--batch-size must be > 0, got -1"),
        (["--seq-len", "0"], "--seq-len must be > 0, got 0"),
        (["--vocab-size", "-5"], "--vocab-size must be > 0, got -5"),
        (["--activation-checkpointing", "-1"], "--activation-checkpointing must be >= 0, got -1"),
    ],
)
def test_estimate_bad_sizes_exit_2_one_line(capsys, flags, needle):
    try:
        rc = cli.main(["estimate", "--model", "llama_60m", *flags])
    except SystemExit as e:  # argparse's own errors leave through sys.exit
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"optim:\n  lr: 0.01\n  name: caf\xe9\n", "not UTF-8 text"),
        (b"", "recipe is empty"),
        (b"\x00\x01\x02", "not valid YAML"),
        (None, "is a directory, not a file"),
    ],
    ids=["latin-1", "empty", "binary", "directory"],
)
def test_train_bad_recipe_file_exits_2_in_process(tmp_path, capsys, content, needle):
    recipe = tmp_path / "recipe.yaml"
    if content is None:
        recipe.mkdir()
    else:
        recipe.write_bytes(content)
    rc, _, err = run_main(capsys, "train", str(recipe), "--out", str(tmp_path / "run"))
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err
    assert not (tmp_path / "run").exists()


def test_estimate_methods_take_their_structure_from_the_tiny_recipes(capsys):
    """`--method` is a leaderboard name: a tiny recipe's optimizer, factor kind and restarts, so
    ReLoRA and LORO count their restart transient and the Low-Rank variants can be named."""
    import optimizers
    from effpretrain.models import FACTOR_KINDS

    recipes = {p.stem for p in (ROOT / "recipes" / "tiny").glob("*.yaml")}
    registered = set(optimizers.METHODS) | set(FACTOR_KINDS)
    assert registered <= recipes
    for name in sorted(registered):  # the registries alone (no recipes folder) agree with the recipes
        assert cli._registry_structure(name) == cli._method_structure(name), name
    assert cli._method_structure("relora") == ("adamw", "relora", True)
    assert cli._method_structure("loro") == ("loro", "lowrank", True)
    assert cli._method_structure("lowrank") == ("adamw", "lowrank", False)
    assert cli._method_structure("lowrank_reset")[1:] == ("lowrank", True)

    def step_terms(method: str) -> dict:
        # fp32 with few tokens: the peak is the optimizer step, where a restart's transient lands
        flags = ["--seq-len", "8", "--dtype", "fp32", "--loss", "standard", "--json"]
        rc, out, err = run_main(capsys, "estimate", "--model", "llama_60m", "--method", method, *flags)
        assert rc == 0, err
        est = json.loads(out)
        assert est["peak_moment"] == "optimizer_step", est["peak_moment"]
        return est["peak_terms"]

    for method, restarts in [
        ("lowrank", False),
        ("lowrank_restarts", True),
        ("lora", False),
        ("relora", True),
    ]:
        assert ("restart_transient" in step_terms(method)) is restarts, method

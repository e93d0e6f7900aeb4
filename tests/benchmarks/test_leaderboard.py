"""benchmarks/leaderboard.py: equal-token planning, resumable grid, exact rendering, paper memory table."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import signal
import sys
from pathlib import Path

import pytest

from effpretrain import paper

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _load_leaderboard():
    # benchmarks/ is a folder of scripts, not an installed package: load the file itself.
    name = "effpretrain_benchmarks_leaderboard"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "leaderboard.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


lb = _load_leaderboard()


def _spec(name: str, steps: int = 3) -> object:
    return lb.RunSpec(
        name=name,
        recipe="recipes/tiny/adamw.yaml",
        method=name.split("-")[0],
        model="tiny",
        seed=0,
        token_budget=1000,
        steps=steps,
        overrides=(f"train.max_steps={steps}",),
        config_hash="h",
    )


# ----------------------------------------------------------------------------------------------
# Equal tokens


def test_steps_for_tokens_rounds_up_to_cover_the_budget():
    assert lb.steps_for_tokens(100_000, 16, 1, 128) == 49  # 100000 / 2048 = 48.8
    assert lb.steps_for_tokens(2048 * 10, 16, 1, 128) == 10  # exact multiple: no extra step
    assert lb.steps_for_tokens(100_000, 8, 2, 128) == 49  # accumulation counts like batch
    assert lb.steps_for_tokens(100_000, 16, 1, 128, world_size=2) == 25
    assert lb.steps_for_tokens(1, 16, 1, 128) == 1
    with pytest.raises(lb.BadInput):
        lb.steps_for_tokens(0, 16, 1, 128)


def test_eval_every_gives_a_few_points():
    assert lb.eval_every_for(49, 4) == 13  # evals at 13, 26, 39 and the final step 49
    assert lb.eval_every_for(3, 4) == 1
    assert lb.eval_every_for(100, 0) == 100


def test_plan_runs_sets_equal_token_steps_per_recipe_and_seed():
    recipe = ROOT / "recipes" / "tiny" / "adamw.yaml"
    specs = lb.plan_runs([recipe], tokens=100_000, seeds=[0, 1], extra_overrides=["data.seq_len=64"])
    assert [s.name for s in specs] == ["adamw-tiny-seed0", "adamw-tiny-seed1"]
    steps = math.ceil(100_000 / (16 * 1 * 64))  # the recipe's batch 16, overridden seq_len 64
    assert all(s.steps == steps and f"train.max_steps={steps}" in s.overrides for s in specs)
    assert specs[0].recipe == "recipes/tiny/adamw.yaml"  # relative: results carry no machine paths
    assert specs[0].config_hash != specs[1].config_hash  # the seed is part of the config
    with pytest.raises(lb.BadInput, match="no recipe for galore_x"):
        lb.plan_runs([recipe], tokens=1000, methods=["adamw", "galore_x"])


# ----------------------------------------------------------------------------------------------
# Resumable grid


def _fake_runner(calls: list[str]):
    def run(spec, run_dir: Path) -> None:
        calls.append(spec.name)
        if spec.name.startswith("broken"):
            raise RuntimeError("boom: the optimizer is not there yet")
        summary = {"config_hash": spec.config_hash, "final_val_ppl": 10.0, "tokens": 64, "tokens_per_s": 8.0}
        (run_dir / "summary.json").write_text(json.dumps(summary))

    return run


def test_run_grid_skips_runs_whose_summary_exists(tmp_path):
    specs = [_spec("adamw-tiny-seed0"), _spec("galore-tiny-seed0"), _spec("fira-tiny-seed0")]
    pre = tmp_path / "runs" / "galore-tiny-seed0"
    pre.mkdir(parents=True)
    (pre / "summary.json").write_text(json.dumps({"config_hash": "h"}))

    calls: list[str] = []
    lines: list[str] = []
    first = lb.run_grid(specs, tmp_path, runner=_fake_runner(calls), log=lines.append)
    assert calls == ["adamw-tiny-seed0", "fira-tiny-seed0"]
    assert first["skipped"] == ["galore-tiny-seed0"]
    assert any("[2/3] galore-tiny-seed0: skipped" in line for line in lines)
    assert any(line.startswith("[3/3] fira-tiny-seed0:") and "ETA" in line for line in lines)

    calls.clear()
    lines.clear()
    second = lb.run_grid(specs, tmp_path, runner=_fake_runner(calls), log=lines.append)
    assert calls == []
    assert second == {"done": [], "skipped": [s.name for s in specs], "failed": []}
    assert "3 already finished, 0 to run" in lines[0]


def test_run_grid_records_a_crash_and_goes_on(tmp_path):
    specs = [_spec("broken-tiny-seed0"), _spec("adamw-tiny-seed0")]
    (tmp_path / "runs" / "broken-tiny-seed0").mkdir(parents=True)
    (tmp_path / "runs" / "broken-tiny-seed0" / "metrics.jsonl").write_text(
        '{"step": 1}\n'
    )  # a dead run's leftover
    calls: list[str] = []
    result = lb.run_grid(specs, tmp_path, runner=_fake_runner(calls), log=lambda _: None)
    assert result == {"done": ["adamw-tiny-seed0"], "skipped": [], "failed": ["broken-tiny-seed0"]}
    broken = tmp_path / "runs" / "broken-tiny-seed0"
    assert not (broken / "metrics.jsonl").exists()  # a fresh start does not append to the old metrics
    rows = lb.collect(tmp_path, [s.name for s in specs])
    bad = next(r for r in rows if r["run"] == "broken-tiny-seed0")
    assert bad["status"] == "error" and "boom" in bad["error"]
    md = lb.render_markdown(rows)
    assert "| broken-tiny-seed0 | error | boom: the optimizer is not there yet |" in md

    calls.clear()  # the failed run has no summary.json, so the next invocation retries it
    lb.run_grid(specs, tmp_path, runner=_fake_runner(calls), log=lambda _: None)
    assert calls == ["broken-tiny-seed0"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the forked runner is the Linux default")
def test_forked_runner_isolates_errors_and_hard_crashes(tmp_path, monkeypatch):
    def fake_train(spec, run_dir: Path) -> None:  # runs in the forked child
        if spec.name.startswith("raises"):
            raise ValueError("bad optimizer state")
        if spec.name.startswith("dies"):
            os.kill(os.getpid(), signal.SIGKILL)  # what a segfault or the OOM killer looks like
        (run_dir / "summary.json").write_text("{}")

    monkeypatch.setattr(lb, "train_spec", fake_train)
    lb.forked_runner(_spec("ok-tiny-seed0"), tmp_path)
    assert (tmp_path / "summary.json").is_file()
    with pytest.raises(RuntimeError, match="ValueError: bad optimizer state"):
        lb.forked_runner(_spec("raises-tiny-seed0"), tmp_path)
    with pytest.raises(RuntimeError, match="killed by signal 9"):
        lb.forked_runner(_spec("dies-tiny-seed0"), tmp_path)


# ----------------------------------------------------------------------------------------------
# Rendering


def test_render_fixture_to_exact_markdown():
    rows = lb.read_jsonl(FIXTURES / "results.jsonl")
    expected = (FIXTURES / "LEADERBOARD.md").read_text()
    assert lb.render_markdown(rows, plots=list(lb.PLOTS)) == expected
    random.Random(0).shuffle(rows)  # a pure function of the rows, not of their order
    assert lb.render_markdown(rows, plots=list(lb.PLOTS)) == expected


def test_plots_and_rerender_from_results_only(tmp_path):
    (tmp_path / "results.jsonl").write_text((FIXTURES / "results.jsonl").read_text())
    assert lb.main(["--out", str(tmp_path)]) == 0
    for name in lb.PLOTS:
        assert (tmp_path / name).stat().st_size > 1000
    assert (tmp_path / "LEADERBOARD.md").read_text() == (FIXTURES / "LEADERBOARD.md").read_text()


def test_pareto_front():
    pts = [(3.0, 10.0), (1.0, 30.0), (2.0, 20.0), (2.5, 25.0), (4.0, 10.0)]
    assert lb.pareto_front(pts) == [1, 2, 0]


def test_flops_per_token_dense_and_factorized():
    from effpretrain.flops import flops_per_token
    from effpretrain.models.llama import PRESETS

    p = PRESETS["tiny"]
    h, i, L, V, T = p.hidden, p.intermediate, p.layers, 512, 32
    dense = 6 * (L * (4 * h * h + 3 * h * i) + V * h) + 12 * L * h * T  # no embedding lookup cost
    assert flops_per_token("tiny", V, T) == dense
    r = 8
    low = flops_per_token("tiny", V, T, "lowrank", r)
    assert low == dense - 6 * L * (4 * h * h + 3 * h * i) + 6 * r * L * (4 * 2 * h + 3 * (h + i))
    assert flops_per_token("tiny", V, T, "lora", r) == low + 4 * L * (4 * h * h + 3 * h * i)


def test_collect_run_reads_summary_metrics_and_config(tmp_path):
    from effpretrain.config import config_hash, dump_yaml, load_config

    cfg = load_config(ROOT / "recipes" / "tiny" / "adamw.yaml", ["data.vocab_size=512", "data.seq_len=32"])
    run = tmp_path / "runs" / "adamw-tiny-seed0"
    run.mkdir(parents=True)
    spec = lb.RunSpec(
        "adamw-tiny-seed0", "recipes/tiny/adamw.yaml", "adamw", "tiny", 0, 1000, 8, (), config_hash(cfg)
    )
    (run / lb.RUN_RECORD).write_text(json.dumps(spec.__dict__ | {"overrides": []}))
    (run / "config.yaml").write_text(dump_yaml(cfg))
    h, i, L, V = 128, 352, 4, 500  # a BPE can end below its requested vocabulary
    params = 2 * V * h + L * (4 * h * h + 3 * h * i + 2 * h) + h
    summary = {"method": "adamw", "model": "tiny", "params": params, "steps": 8, "tokens": 4096,
               "final_val_ppl": 100.0, "tokens_per_s": 512.0, "device": "cpu (x86_64, 2 cores)",
               "estimated": {"total": 5, "weights": 1}, "opt/refreshes": 3, "opt/refresh_s": 0.5}  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text(
        '{"step": 4, "tokens": 2048, "loss": 5.0, "opt/refreshes": 1}\n'
        '{"event": "eval", "step": 4, "tokens": 2048, "val_loss": 5.0, "val_ppl": 148.4}\n'
        '{"event": "eval", "step": 8, "tokens": 4096, "val_loss": 4.6, "val_ppl": 100.0}\n'
        '{"event": "eval", "step": 8, "tokens": 4096, "val_loss": 4.6, "val_ppl": 99.0}\n'  # after a resume
        '{"step": 9, "tok'  # cut short by a crash
    )
    (row,) = lb.collect(tmp_path)
    assert row["status"] == "ok" and row["token_budget"] == 1000 and row["seed"] == 0
    assert row["val_curve"] == [[2048, 148.4], [4096, 99.0]]
    assert row["telemetry"] == {"opt/refreshes": 3, "opt/refresh_s": 0.5}
    assert row["train_s"] == 8.0
    from effpretrain.flops import flops_per_token

    assert row["flops_per_token"] == flops_per_token("tiny", V, 32)
    assert row["hardware"] == lb.cpu_description() and "cores" in row["hardware"]
    assert row["estimated"]["total"] == 5


# ----------------------------------------------------------------------------------------------
# --paper


@pytest.mark.parametrize("method", ["adamw", "galore"])
def test_paper_memory_within_001_gb(method):
    # GaLore needs optimizers/galore.py: if it cannot be imported the row says n/a and this fails.
    rows = paper.paper_memory_table([m for m in paper.paper_methods() if m[0] == method])
    assert [r["model"] for r in rows] == ["llama_60m", "llama_130m", "llama_350m", "llama_1b"]
    for r in rows:
        assert r["gb"] is not None, f"{method} {r['model']}: {r.get('error')}"
        assert abs(r["gb"] - r["paper_gb"]) <= 0.01, r


def test_paper_methods_follow_the_registries():
    # A method registered at run time is listed with no other edit; factor kinds train with AdamW.
    import optimizers
    from effpretrain.models import FACTOR_KINDS

    optimizers.register(optimizers.MethodSpec(name="toy_sgd", target="torch.optim:SGD"))
    try:
        rows = paper.paper_methods()
        assert rows == [(n, n, "none") for n in optimizers.METHODS] + [(k, "adamw", k) for k in FACTOR_KINDS]
        assert ("toy_sgd", "toy_sgd", "none") in rows and ("spam", "spam", "none") in rows
    finally:
        optimizers.unregister("toy_sgd")
    mini = paper.paper_memory_table([("apollo_mini", "apollo_mini", "none")])
    assert {r["rank"] for r in mini} == {1}  # the registry's fixed rank, not the size's


def test_paper_table_cli_shows_na_for_a_method_that_cannot_load(monkeypatch, capsys):
    # The full method list imports bitsandbytes (slow); the CLI path is the same for any list.
    # "notyet" is registered but its backend is missing (ImportError): n/a, and the table goes on.
    import optimizers

    methods = [m for m in paper.paper_methods() if m[0] in ("galore", "lowrank")] + [
        ("notyet", "notyet", "none")
    ]
    monkeypatch.setattr(paper, "paper_methods", lambda: methods)
    optimizers.register(optimizers.MethodSpec(name="notyet", target="effpretrain_missing_backend:Opt"))
    try:
        assert lb.main(["--paper"]) == 0
    finally:
        optimizers.unregister("notyet")
    text = capsys.readouterr().out
    assert "| galore | llama_350m | 384 | 1.584 | 1.59 | -0.006 | r384: reproduces" in text
    assert "| lowrank | llama_1b | 512 | 3.656 | 3.66 | -0.004 |" in text
    assert "| notyet | llama_60m | 128 | n/a | - | - |" in text


def test_bad_input_is_reported(tmp_path):
    with pytest.raises(lb.BadInput, match="--tokens"):
        lb.main(["--grid", "tiny", "--out", str(tmp_path)])
    with pytest.raises(lb.BadInput, match="no runs/"):
        lb.main(["--out", str(tmp_path / "empty")])

"""benchmarks/leaderboard.py as a study (issue 20): lr sweeps, seed statistics, claims from the rows,
budget floors, timing, serial cost, parallel runs and resuming from results.jsonl alone."""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import pytest
from _common import ROOT
from test_leaderboard import _load_leaderboard  # the one loader of the script

lb = _load_leaderboard()


# ----------------------------------------------------------------------------------------------
# Sweep parsing and selection


def test_parse_sweep_multipliers_and_absolute_values():
    pts = lb.parse_sweep("lr=x0.25,x1, x4")
    assert [p.label for p in pts] == ["x0.25", "x1", "x4"]
    assert [p.lr(2e-3) for p in pts] == [5e-4, 2e-3, 8e-3]
    (a, b) = lb.parse_sweep("lr=1e-3,3e-3")
    assert (a.lr(0.5), b.lr(0.5)) == (1e-3, 3e-3)  # absolute: the recipe's lr does not matter
    for bad in ("lr=", "wd=x1", "lr=x0,x1", "lr=fast", "lr=x1,x1", "lr=-1e-3"):
        with pytest.raises(lb.BadInput):
            lb.parse_sweep(bad)


def _row(
    method,
    seed,
    ppl,
    *,
    model="tiny",
    phase="final",
    lr=None,
    peak=None,
    factor="none",
    rank=None,
    status="ok",
):
    r = {
        "run": f"{method}-{model}-{phase}-{lr}-seed{seed}",
        "method": method,
        "model": model,
        "seed": seed,
        "phase": phase,
        "lr": lr,
        "status": status,
        "final_val_ppl": ppl,
        "factor": factor,
        "optim_rank": rank,
        "params": 1000,
        "steps": 512,
        "tokens": 512 * 2048,
        "token_budget": 512 * 2048,
    }
    if peak is not None:
        r["measured"] = {"peak": peak}
    return r


def test_select_lrs_lowest_ppl_ties_to_smaller_and_flags_edges():
    rows = [
        _row("adamw", 0, 120.0, phase="sweep", lr=5e-4),
        _row("adamw", 0, 100.0, phase="sweep", lr=1e-3),
        _row("adamw", 0, 100.0, phase="sweep", lr=2e-3),  # a tie: the smaller lr wins
        _row("adamw", 0, 130.0, phase="sweep", lr=4e-3),
        _row("galore", 0, 150.0, phase="sweep", lr=5e-3),
        _row("galore", 0, 140.0, phase="sweep", lr=1e-2),
        _row("galore", 0, 130.0, phase="sweep", lr=2e-2),  # best at the top of its grid
        _row("fira", 0, 90.0, phase="sweep", lr=1e-3),  # best at the bottom
        _row("fira", 0, 95.0, phase="sweep", lr=2e-3),
        _row("fira", 0, float("nan"), phase="sweep", lr=4e-3),  # diverged: not a candidate
        _row("apollo", 0, None, phase="sweep", lr=1e-2, status="error"),
        _row("adamw", 0, 10.0, phase="final", lr=4e-3),  # final rows never count
    ]
    c = lb.select_lrs(rows)
    assert (c["tiny", "adamw"].lr, c["tiny", "adamw"].ppl, c["tiny", "adamw"].edge) == (1e-3, 100.0, None)
    assert (c["tiny", "galore"].lr, c["tiny", "galore"].edge) == (2e-2, "highest")
    assert (c["tiny", "fira"].lr, c["tiny", "fira"].edge) == (1e-3, "lowest")
    assert c["tiny", "fira"].trials[-1] == (4e-3, None)
    assert c["tiny", "apollo"].lr is None and c["tiny", "apollo"].edge is None
    md = lb.render_markdown(rows)
    assert (
        "| galore | 0.005: 150.00; 0.01: 140.00; **0.02: 130.00** | 0.02 | edge of grid (highest lr): widen it |"
        in md
    )
    assert (
        "| fira | **0.001: 90.00**; 0.002: 95.00; 0.004: failed | 0.001 | edge of grid (lowest lr): widen it,"
        in md
    )
    assert "| apollo | 0.01: failed | - | 1 failed or diverged, no finished run: no final runs |" in md
    assert "| adamw | 0.0005: 120.00; **0.001: 100.00**; 0.002: 100.00; 0.004: 130.00 | 0.001 | - |" in md


# ----------------------------------------------------------------------------------------------
# Claims: every claim of the table, each verdict, from hand-made rows


def _verdict(rows, key):
    (found,) = [c for c in lb.evaluate_claims(rows) if c["claim"] == key]
    return found["verdict"], found["evidence"]


def _seeds(method, ppls, **kw):
    return [_row(method, s, p, **kw) for s, p in enumerate(ppls)]


def test_every_claim_has_a_kind_the_tests_cover():
    assert [c.kind for c in lb.CLAIMS] == ["best", "below", "below", "below", "pareto"]
    assert {m for c in lb.CLAIMS for pair in c.pairs for m in pair} == {
        "fira", "apollo", "galore", "lowrank_restarts", "lowrank", "sltrain_restarts", "sltrain"
    }  # fmt: skip


def test_claim_full_rank_best_each_verdict():
    (claim,) = [c for c in lb.CLAIMS if c.kind == "best"]
    key = claim.key
    other = _seeds("galore", [110.0, 112.0])
    assert _verdict(_seeds("adamw", [100.0, 102.0]) + other, key)[0] == "reproduced"
    assert _verdict(_seeds("adamw", [120.0, 122.0]) + other, key)[0] == "not reproduced"
    # |104 - 111| = 7 <= max(sd) = 7.07 (adamw 99, 109)
    verdict, evidence = _verdict(_seeds("adamw", [99.0, 109.0]) + other, key)
    assert verdict == "within noise" and "difference -7.00, noise 7.07" in evidence
    # Stable-SPAM counts as full-rank: the best of the two is compared with the best other method.
    rows = _seeds("adamw", [130.0]) + _seeds("stable_spam", [90.0]) + other
    assert _verdict(rows, key)[0] == "reproduced"
    assert _verdict(other + _seeds("fira", [100.0]), key)[0] == "not measured"  # no adamw
    assert _verdict(_seeds("adamw", [100.0]), key)[0] == "not measured"  # nothing to compare with


@pytest.mark.parametrize("claim", [c for c in lb.CLAIMS if c.kind == "below"], ids=lambda c: c.key)
def test_claim_below_each_verdict(claim):
    def rows(better, worse, spread=0.0):
        out = []
        for a, b in claim.pairs:
            out += _seeds(a, [better - spread, better + spread]) + _seeds(b, [worse, worse])
        return out

    assert _verdict(rows(100.0, 110.0), claim.key)[0] == "reproduced"
    assert _verdict(rows(120.0, 110.0), claim.key)[0] == "not reproduced"
    assert _verdict(rows(105.0, 110.0, spread=5.0), claim.key)[0] == "within noise"  # sd 7.07 >= 5
    a, b = claim.pairs[0]
    verdict, evidence = _verdict(_seeds(b, [110.0]), claim.key)
    assert verdict == "not measured" and evidence.startswith("no finished runs of") and a in evidence
    if len(claim.pairs) > 1:  # one pair not reproduced makes the claim not reproduced
        mixed = rows(100.0, 110.0)
        mixed = [r for r in mixed if r["method"] != claim.pairs[1][0]] + _seeds(
            claim.pairs[1][0], [130.0, 130.0]
        )
        verdict, evidence = _verdict(mixed, claim.key)
        assert verdict == "not reproduced" and "(reproduced)" in evidence and "(not reproduced)" in evidence


def test_claim_pareto_each_verdict():
    (claim,) = [c for c in lb.CLAIMS if c.kind == "pareto"]
    key = claim.key
    galore = _seeds("galore", [110.0, 110.0], peak=80e6, rank=32)
    adam8 = _seeds("adamw_8bit", [100.0, 100.0], peak=60e6)  # less memory, not low-rank/projected
    verdict, evidence = _verdict(_seeds("adamw", [100.0, 100.0], peak=100e6) + galore, key)
    assert verdict == "reproduced" and "low-rank/projected on the front: galore" in evidence
    # AdamW beaten by a method with less memory and a lower perplexity, beyond noise:
    rows = _seeds("adamw", [104.0, 104.0], peak=100e6) + galore + adam8
    assert _verdict(rows, key)[0] == "not reproduced"
    near = _seeds("adamw_8bit", [100.0, 100.0], peak=90e6)
    rows = _seeds("adamw", [96.0, 112.0], peak=100e6) + _seeds("galore", [110.0], peak=60e6, rank=32) + near
    # AdamW 104 vs 100 with less memory, sd 11.3: off the front within noise; GaLore on it.
    verdict, evidence = _verdict(rows, key)
    assert verdict == "within noise" and "adamw: off it within noise" in evidence
    # No low-rank/projected method measured: not measured; a low-rank one only dominated: not reproduced.
    assert _verdict(_seeds("adamw", [100.0], peak=100e6) + adam8, key)[0] == "not measured"
    lowrank = _seeds("lowrank", [130.0, 130.0], peak=70e6, factor="lowrank")
    cheap = _seeds("adam_mini", [90.0, 90.0], peak=50e6)
    rows = _seeds("adamw", [80.0, 80.0], peak=100e6) + lowrank + cheap
    assert _verdict(rows, key)[0] == "not reproduced"


def test_claims_are_per_model_and_ignore_sweep_rows():
    rows = _seeds("adamw", [100.0], model="a") + _seeds("galore", [110.0], model="a")
    rows += _seeds("adamw", [100.0], model="b") + _seeds("galore", [90.0], model="b")
    rows += [_row("galore", 0, 1.0, model="a", phase="sweep", lr=1e-2)]
    got = {(c["model"], c["claim"]): c["verdict"] for c in lb.evaluate_claims(rows)}
    assert got["a", "full_rank_best"] == "reproduced" and got["b", "full_rank_best"] == "not reproduced"


def test_versus_baseline_column_marks_differences_within_noise():
    rows = _seeds("adamw", [100.0, 110.0]) + _seeds("galore", [104.0, 104.0]) + _seeds("fira", [130.0, 130.0])
    md = lb.render_markdown(rows)
    assert "| galore | - | 104.00 ± 0.00 (n=2) | -1.00 (within noise) |" in md
    assert "| fira | - | 130.00 ± 0.00 (n=2) | +25.00 |" in md
    assert lb.NOISE_RULE in md


# ----------------------------------------------------------------------------------------------
# Budgets


def test_budget_floors_warn_in_the_plan_and_the_markdown():
    recipe = ROOT / "recipes" / "tiny" / "adamw.yaml"
    small = lb.plan_runs([recipe], 100_000, extra_overrides=["data.seq_len=64", "train.batch_size=8"])
    warnings = lb.budget_warnings(small)
    assert any("512 tokens per step" in w for w in warnings) and any("196 steps" in w for w in warnings)
    tiny = list(lb.GRID_OVERRIDES["tiny"])
    ok = lb.plan_runs([recipe], lb.GRID_TOKENS["tiny"], extra_overrides=tiny)
    assert ok[0].tokens_per_step == 2048 and ok[0].steps == 512 and lb.budget_warnings(ok) == []
    sweep = lb.plan_runs(
        [recipe], lb.GRID_TOKENS["tiny"] // 4, extra_overrides=tiny, sweep=lb.parse_sweep("lr=x1")
    )
    assert sweep[0].steps == 128 and lb.budget_warnings(sweep) == []  # a short sweep is by design

    rows = [_row("adamw", 0, 100.0)]
    rows[0].update(steps=196, tokens=196 * 512)
    md = lb.render_markdown(rows)
    assert "- Final runs: 512 tokens per step x 196 steps = 100,352 tokens per run" in md
    assert "**Warning: below the budget floor**: final runs train 512 tokens per step (floor 2,000)" in md
    assert "**Warning: below the budget floor**: final runs take 196 steps (floor 500)" in md
    assert "Warning" not in lb.render_markdown([_row("adamw", 0, 100.0)])


# ----------------------------------------------------------------------------------------------
# Serial cost and timing


def test_serial_cost_from_the_registry_and_the_config():
    from effpretrain.config import load_config

    def cost(method, *overrides):
        return lb.serial_cost(load_config(ROOT / "recipes" / "tiny" / f"{method}.yaml", list(overrides)))

    assert cost("adamw") == {"per_update": 0.0, "detail": ""}
    assert cost("muon") == {"per_update": 5.0, "detail": "5 Newton-Schulz"}
    assert cost("muon", "optim.extra.ns_steps=3")["per_update"] == 3.0
    assert cost("swan")["per_update"] == 10.0
    # GaLore's default randomized SVD with one power round: LU, Householder QR, eigh, QR.
    assert cost("galore") == {"per_update": 4 / 50, "detail": "4 per refresh / 50"}
    assert cost("galore", "optim.basis=svd")["per_update"] == 1 / 50
    assert cost("apollo")["per_update"] == 0.0  # a seeded Gaussian basis decomposes nothing
    assert cost("lowrank_restarts") == {"per_update": 3 / 50, "detail": "3 per restart / 50"}
    assert cost("lowrank_reset")["per_update"] == 0.0  # restarts without refactorization
    assert cost("loro")["per_update"] == 5 / 50


def test_timed_events_adds_eval_and_restart_seconds(tmp_path, monkeypatch):
    from effpretrain.trainer import Trainer
    from optimizers.restarts import Restarts

    monkeypatch.setattr(Trainer, "evaluate", lambda self: time.sleep(0.02) or "evaluated")
    monkeypatch.setattr(Restarts, "restart", lambda self: time.sleep(0.01))
    patched = Trainer.evaluate
    totals = []
    for _ in range(2):  # a resumed run: the second process's seconds add to the first's
        with lb.timed_events(tmp_path) as spent:
            assert Trainer.evaluate is not patched
            assert Trainer.evaluate(None) == "evaluated"
            Restarts.restart(None)
        assert Trainer.evaluate is patched and spent["eval_s"] >= 0.02 and spent["restart_s"] >= 0.01
        totals.append(json.loads((tmp_path / lb.TIMING_FILE).read_text()))
    assert totals[1]["eval_s"] == pytest.approx(totals[0]["eval_s"] + spent["eval_s"])
    assert totals[1]["restart_s"] == pytest.approx(totals[0]["restart_s"] + spent["restart_s"])


# ----------------------------------------------------------------------------------------------
# A fixture grid end to end: sweep, selection, final runs, claims; then resume from results only

#: The fake training's perplexity: base per method, plus a penalty away from the lr multiple that
#: suits it, plus a little per seed.
BASE = {
    "adamw": 100.0,
    "galore": 110.0,
    "fira": 105.0,
    "apollo": 120.0,
    "lowrank": 130.0,
    "lowrank_restarts": 125.0,
}
BEST_MULT = {"adamw": 1.0, "galore": 2.0, "fira": 0.5, "apollo": 1.0, "lowrank": 1.0, "lowrank_restarts": 1.0}
PEAK = {
    "adamw": 100e6,
    "galore": 80e6,
    "fira": 80e6,
    "apollo": 78e6,
    "lowrank": 70e6,
    "lowrank_restarts": 70e6,
}


def _fake_train(calls):
    from effpretrain.config import dump_yaml, load_config

    def run(spec, run_dir: Path) -> None:
        calls.append(spec.name)
        recipe = ROOT / spec.recipe
        cfg = load_config(recipe, list(spec.overrides))
        mult = cfg.optim.lr / load_config(recipe, []).optim.lr
        ppl = BASE[spec.method] + 10 * math.log2(mult / BEST_MULT[spec.method]) ** 2 + 0.5 * spec.seed
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
        tokens = spec.steps * spec.tokens_per_step
        summary = {
            "method": spec.method, "model": spec.model, "optimizer": cfg.optim.name, "factor": cfg.factor.kind,
            "params": 2_901_120, "steps": spec.steps, "tokens": tokens, "final_val_ppl": ppl,
            "tokens_per_s": 5000.0, "config_hash": spec.config_hash, "git_commit": "abc1234",
            "device": "cpu (x86_64, 2 cores)", "estimated": {"total": PEAK[spec.method]},
            "memory_measured": {"max": {"peak": PEAK[spec.method], "optimizer_state": 1}},
        }  # fmt: skip
        (run_dir / "summary.json").write_text(json.dumps(summary))
        evals = {"event": "eval", "step": spec.steps, "tokens": tokens, "val_ppl": ppl}
        (run_dir / "metrics.jsonl").write_text(json.dumps(evals) + "\n")

    return run


def test_fixture_grid_sweeps_selects_flags_runs_seeds_and_resumes_from_results_alone(tmp_path, monkeypatch):
    recipes = [ROOT / "recipes" / "tiny" / f"{m}.yaml" for m in BASE]
    monkeypatch.setattr(lb.cli, "grid_recipes", lambda grid: list(recipes))
    out = tmp_path / "study"
    argv = ["--grid", "tiny", "--sweep", "lr=x0.5,x1,x2", "--seeds", "0,1,2", "--tokens", "20480"]
    argv += ["--out", str(out), "--no-plots"]
    calls: list[str] = []
    assert lb.main(argv, runner=_fake_train(calls)) == 0
    sweep = [c for c in calls if "-sweep-" in c]
    assert len(sweep) == 6 * 3 and all(c.endswith("-seed0") for c in sweep)  # the first seed
    assert sorted(set(calls) - set(sweep)) == sorted(f"{m}-tiny-seed{s}" for m in BASE for s in range(3))

    rows = lb.read_jsonl(out / "results.jsonl")
    final = {r["run"]: r for r in rows if r["phase"] == "final"}
    assert final["galore-tiny-seed1"]["lr"] == 0.02 and final["fira-tiny-seed2"]["lr"] == 0.005
    assert final["adamw-tiny-seed0"]["lr"] == 1e-3 and final["adamw-tiny-seed0"]["token_budget"] == 20480
    assert "optim.lr=0.02" in final["galore-tiny-seed0"]["overrides"]
    sw = [r for r in rows if r["phase"] == "sweep"]
    assert {r["lr_label"] for r in sw} == {"x0.5", "x1", "x2"} and all(r["token_budget"] == 5120 for r in sw)

    md = (out / "LEADERBOARD.md").read_text()
    assert "- Sweep runs: 2,048 tokens per step x 3 steps = 6,144 tokens per run (budget 5,120" in md
    assert "- Final runs: 2,048 tokens per step x 10 steps = 20,480 tokens per run (budget 20,480" in md
    assert "final runs take 10 steps (floor 500)" in md
    assert (
        "| galore | 0.005: 150.00; 0.01: 120.00; **0.02: 110.00** | 0.02 | edge of grid (highest lr): widen it |"
        in md
    )
    assert (
        "| fira | **0.005: 105.00**; 0.01: 115.00; 0.02: 145.00 | 0.005 | edge of grid (lowest lr): widen it |"
        in md
    )
    assert "| adamw | 0.0005: 110.00; **0.001: 100.00**; 0.002: 110.00 | 0.001 | - |" in md
    assert "| 1 | adamw | 0.001 | 100.50 ± 0.50 (n=3) | - |" in md
    galore_row = next(line for line in md.splitlines() if line.startswith("| 3 | galore | 0.02 |"))
    assert "| +10.00 | 80.0 MB (0.80x) |" in galore_row and "| 0.08 (4 per refresh / 50) |" in galore_row
    assert final["lowrank_restarts-tiny-seed0"]["serial"] == {
        "per_update": 0.06,
        "detail": "3 per restart / 50",
    }
    verdicts = {c["claim"]: c["verdict"] for c in lb.evaluate_claims(rows)}
    assert verdicts == {
        "full_rank_best": "reproduced",
        "fira_apollo_over_galore": "not reproduced",  # APOLLO 120.5 > GaLore 110.5
        "lowrank_restarts": "reproduced",
        "sltrain_restarts": "not measured",
        "pareto": "reproduced",
    }
    for c in lb.evaluate_claims(rows):
        assert f"| tiny | {c['statement']} | **{c['verdict']}** | {c['evidence']} |" in md

    # Acceptance 2: the run folders gone (a new machine with the committed results.jsonl), the
    # same command trains nothing and renders the same markdown and results.
    results = (out / "results.jsonl").read_text()
    shutil.rmtree(out / "runs")
    (out / "LEADERBOARD.md").unlink()
    calls.clear()
    assert lb.main(argv, runner=_fake_train(calls)) == 0
    assert calls == []
    assert (out / "LEADERBOARD.md").read_text() == md
    assert (out / "results.jsonl").read_text() == results
    assert lb.main(["--out", str(out), "--no-plots"]) == 0  # render only, from the results
    assert (out / "LEADERBOARD.md").read_text() == md


def test_run_grid_skips_runs_recorded_in_results(tmp_path):
    spec = lb.RunSpec("adamw-tiny-seed0", "recipes/tiny/adamw.yaml", "adamw", "tiny", 0, 1000, 3, (), "h")
    lines: list[str] = []
    done = {"adamw-tiny-seed0": {"run": "adamw-tiny-seed0", "status": "ok", "config_hash": "old"}}
    result = lb.run_grid(
        [spec], tmp_path, runner=lambda s, d: pytest.fail("ran"), log=lines.append, finished=done
    )
    assert result["skipped"] == ["adamw-tiny-seed0"]
    assert "skipped (in results.jsonl); WARNING: it was made with another config (old != h)" in lines[1]
    failed = {"adamw-tiny-seed0": {"run": "adamw-tiny-seed0", "status": "error"}}  # a failure is retried
    calls: list[str] = []
    lb.run_grid([spec], tmp_path, runner=lambda s, d: calls.append(s.name), log=lines.append, finished=failed)
    assert calls == ["adamw-tiny-seed0"]


def test_gather_rows_keeps_recorded_rows_and_prefers_finished_folders(tmp_path):
    previous = [
        {"run": "a-tiny-seed0", "status": "ok", "final_val_ppl": 1.0},
        {"run": "b-tiny-seed0", "status": "ok", "final_val_ppl": 2.0},
        {"run": "other-tiny-seed0", "status": "ok", "final_val_ppl": 3.0},  # not planned now: kept
    ]
    crashed = tmp_path / "runs" / "b-tiny-seed0"  # a rerun that crashed must not replace a result
    crashed.mkdir(parents=True)
    (crashed / lb.ERROR_FILE).write_text("boom\n")
    (crashed / lb.RUN_RECORD).write_text(json.dumps({"method": "b", "model": "tiny", "cpu": "x"}))
    rows = lb.gather_rows(tmp_path, ["a-tiny-seed0", "b-tiny-seed0"], previous)
    assert rows == previous


# ----------------------------------------------------------------------------------------------
# Parallel runs


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked runs are the Linux default")
def test_jobs_run_forked_runs_side_by_side_on_a_share_of_the_cores(tmp_path, monkeypatch):
    def fake_train(spec, run_dir: Path, threads=None) -> None:  # in the forked child
        import torch

        if threads:
            torch.set_num_threads(threads)
        start = time.time()
        time.sleep(1.0)
        record = {"start": start, "end": time.time(), "threads": torch.get_num_threads()}
        (run_dir / "summary.json").write_text(json.dumps(record))

    monkeypatch.setattr(lb.run, "train_spec", fake_train)
    monkeypatch.setattr(lb.run, "prewarm_imports", lambda: None)
    specs = [
        lb.RunSpec(f"m{i}-tiny-seed0", "recipes/tiny/adamw.yaml", f"m{i}", "tiny", 0, 1, 1, (), "h")
        for i in range(3)
    ]
    result = lb.run_grid(specs, tmp_path, log=lambda _: None, jobs=2)
    assert sorted(result["done"]) == [s.name for s in specs]
    recs = [json.loads((tmp_path / "runs" / s.name / "summary.json").read_text()) for s in specs]
    assert all(r["threads"] == max(1, lb._cores() // 2) for r in recs)
    first, second = recs[0], recs[1]
    assert second["start"] < first["end"]  # the first two ran at the same time


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked runs are the Linux default")
def test_jobs_sigterm_stops_every_running_run_and_starts_no_more(tmp_path, monkeypatch):
    import os
    import signal
    import threading

    def fake_train(spec, run_dir: Path, threads=None) -> None:  # in the forked child, as the trainer:
        stop = []  # SIGTERM finishes the step, saves, and the run reports it stopped
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        (run_dir / "started").write_text("")
        deadline = time.time() + 30
        while not stop and time.time() < deadline:
            time.sleep(0.05)
        (run_dir / "stopped").write_text("")
        raise KeyboardInterrupt

    monkeypatch.setattr(lb.run, "train_spec", fake_train)
    monkeypatch.setattr(lb.run, "prewarm_imports", lambda: None)
    specs = [
        lb.RunSpec(f"m{i}-tiny-seed0", "recipes/tiny/adamw.yaml", f"m{i}", "tiny", 0, 1, 1, (), "h")
        for i in range(3)
    ]
    runs = tmp_path / "runs"

    def terminate_when_both_started():
        deadline = time.time() + 30
        while time.time() < deadline and not all((runs / s.name / "started").exists() for s in specs[:2]):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_when_both_started, daemon=True).start()
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        lb.run_grid(specs, tmp_path, log=lines.append, jobs=2)
    assert all((runs / s.name / "stopped").exists() for s in specs[:2])
    assert not (runs / specs[2].name).exists()  # never started
    assert not any((runs / s.name / lb.ERROR_FILE).exists() for s in specs[:2])  # not failures
    assert sum("interrupted; run the same command again" in line for line in lines) == 2


# ----------------------------------------------------------------------------------------------
# The README's excerpt: generated from the committed results, never edited by hand


def test_readme_excerpt_is_what_the_committed_study_renders():
    """The README's leaderboard section is `readme_summary` of the committed results.jsonl."""
    readme = ROOT / "README.md"
    text, start, end = lb.readme_span(readme)
    study = ROOT / "benchmarks" / "results" / "tiny-cpu-study"
    want = lb.readme_summary(lb.read_jsonl(study / "results.jsonl"), "benchmarks/results/tiny-cpu-study")
    assert text[start:end] == want, (
        "README.md's leaderboard excerpt is out of date: run\n"
        "  python benchmarks/leaderboard.py --out benchmarks/results/tiny-cpu-study --readme README.md"
    )


def test_readme_excerpt_ranks_top_rows_and_states_every_claim(tmp_path):
    rows = _seeds("adamw", [100.0, 102.0]) + _seeds("galore", [110.0, 112.0], rank=32)
    rows += _seeds("fira", [105.0, 107.0], rank=32) + [_row("apollo", 0, 1.0, phase="sweep", lr=1e-2)]
    text = lb.readme_summary(rows, "runs/x", top=2)
    assert "the 2 best of 3 methods" in text and "(6 final and 1 sweep runs;" in text
    lines = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert [line.split(" | ")[1] for line in lines] == ["adamw", "fira"]  # galore is 3rd: not shown
    for c in lb.evaluate_claims(rows):
        assert f"| {c['statement']} | **{c['verdict']}** | {c['evidence']} |" in text

    readme = tmp_path / "README.md"
    readme.write_text(
        "# x\n\n<!-- leaderboard:start (generated) -->\nold text\n<!-- leaderboard:end -->\ntail\n"
    )
    assert lb.update_readme(readme, rows, "runs/x")
    got, full = readme.read_text(), lb.readme_summary(rows, "runs/x")  # the default top 10: all 3
    assert "the 3 best of 3 methods" in full
    assert got == f"# x\n\n<!-- leaderboard:start (generated) -->\n{full}<!-- leaderboard:end -->\ntail\n"
    assert not lb.update_readme(readme, rows, "runs/x")  # the same rows: unchanged
    assert "No final run has finished yet" in lb.readme_summary(rows[-1:], "runs/x")


def test_readme_without_markers_is_refused_before_anything_runs(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    with pytest.raises(lb.BadInput, match="lacks the markers"):
        lb.main(["--out", str(tmp_path / "out"), "--grid", "tiny", "--readme", str(readme)])
    assert not (tmp_path / "out").exists() and readme.read_text() == "# no markers\n"
    with pytest.raises(lb.BadInput, match="not found"):
        lb.main(["--out", str(tmp_path / "out"), "--readme", str(tmp_path / "missing.md")])

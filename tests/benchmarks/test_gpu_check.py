"""benchmarks/gpu_check.py: its smoke runs every section's code on the CPU in under 90 s and exits
0; a package a section needs is checked before it starts, and a missing one is reported "missing"
(not skipped) with exit code 3 while the rest runs; a case leaves nothing alive; the budget stops
it cleanly; the docs' "On a GPU" tables are the committed JSON rendered."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import weakref

import pytest
from _common import child_env
from bench_scripts import ROOT, load

gc = load("gpu_check")


@pytest.mark.run
def test_smoke_runs_every_section_on_cpu(tmp_path):
    """The smoke run finishes every section with status ok (its wall time is printed, not asserted:
    a timed test fails on a loaded machine and proves nothing about the product)."""
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
    for section in gc.SECTIONS:
        saved = json.loads((tmp_path / f"{section}.json").read_text())
        assert saved["device"].startswith("cpu") and saved["commit"] and saved["torch"]
        rows = saved["rows"]
        assert rows and all(r["status"] == "ok" for r in rows), rows
        assert (tmp_path / f"{section}.md").read_text().startswith(f"### {section}")
    rows = {s: json.loads((tmp_path / f"{s}.json").read_text())["rows"] for s in gc.SECTIONS}
    # Every registry row is checked, and the CPU against itself is exact (the same five steps run
    # twice in one process: the same kernels in the same order).
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


def test_a_missing_package_is_missing_not_skipped_named_first_and_last_and_exits_3(
    tmp_path, monkeypatch, capsys
):
    """docs/gpu.md, G10: a run without the carried wheels must not look complete."""
    monkeypatch.setitem(sys.modules, "galore_torch", None)  # import galore_torch now fails
    started = []

    def numerics(scale, budget):
        started.append(capsys.readouterr().err)  # what was printed before the first case
        return [{"case": "stub", "status": "ok"}]

    monkeypatch.setattr(gc, "section_numerics", numerics)
    code = gc.main(["--smoke", "--out", str(tmp_path), "--sections", "numerics,hf"])
    assert code == 3
    (hf,) = json.loads((tmp_path / "hf.json").read_text())["rows"]
    assert hf["status"] == "missing" and "galore_torch" in hf["note"]
    assert json.loads((tmp_path / "numerics.json").read_text())["rows"][0]["status"] == "ok"
    line = "gpu_check: MISSING PACKAGES: galore_torch (hf)"
    assert line in started[0]  # checked before the first case ran
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith(line)  # and the run's last line


def test_a_case_whose_package_is_missing_is_missing_and_a_broken_import_is_a_failure():
    from _bench import Budget, run_cases

    def no_bnb():
        try:
            import bitsandbytes_not_installed  # noqa: F401
        except ImportError as err:  # as the 8-bit optimizers re-raise it, with a hint
            raise ImportError("adamw_8bit needs bitsandbytes: pip install bitsandbytes") from err
        return {}

    def broken():
        from json import no_such_name  # noqa: F401

        return {}

    rows = run_cases([("8-bit", 0.0, no_bnb), ("broken", 0.0, broken)], Budget(60))
    assert (
        rows[0]["status"] == "missing"
        and rows[0]["note"] == "needs bitsandbytes_not_installed (not installed)"
    )
    assert rows[1]["status"] == "failed" and "no_such_name" in rows[1]["note"]


def test_packages_flag_checks_the_needed_packages_alone(monkeypatch, capsys):
    assert gc.main(["--packages"]) == 0  # this environment has every wheel (pyproject's dev extra)
    assert [line.split()[:2] for line in capsys.readouterr().out.splitlines()] == [
        ["ok", name] for name in gc.NEEDS
    ]
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    assert gc.main(["--packages"]) == 3
    out = capsys.readouterr().out
    assert (
        "MISSING  bitsandbytes" in out and "MISSING PACKAGES: bitsandbytes (numerics, memory, step_7b)" in out
    )


@pytest.mark.run
@pytest.mark.parametrize("compiled", [False, True])
def test_a_speed_case_leaves_no_tensor_of_its_own_alive(monkeypatch, compiled):
    """docs/gpu.md, G11: a case's model, optimizer and their state are garbage by the time the case
    calls `free` (its collection and CUDA's ``empty_cache``), so that call can return their memory
    and cases do not pile up on the device; checked by weak references inside `free`'s call."""
    from effpretrain import optim_setup, run_model

    refs = []
    alive_at_free = []
    real_free = gc.free

    def free_spy(device):
        real_free(device)
        alive_at_free.append([type(x).__name__ for r in refs if (x := r()) is not None])

    monkeypatch.setattr(gc, "free", free_spy)
    build_model, build_opt = run_model.build_run_model, optim_setup.build_optimizer_and_schedule

    def model_spy(cfg, vocab):
        model, extra = build_model(cfg, vocab)
        refs.extend([weakref.ref(model), *(weakref.ref(p) for p in model.parameters())])
        return model, extra

    def opt_spy(model, cfg):
        opt, sched = build_opt(model, cfg)
        refs.extend([weakref.ref(opt), weakref.ref(sched)])
        return opt, sched

    monkeypatch.setattr(run_model, "build_run_model", model_spy)
    monkeypatch.setattr(optim_setup, "build_optimizer_and_schedule", opt_spy)
    row = gc.speed_case("galore", gc.SMOKE, 2, compiled)
    assert row["tokens_per_s"] > 0 and len(refs) > 3
    assert alive_at_free == [[]]
    assert all(r() is None for r in refs)


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

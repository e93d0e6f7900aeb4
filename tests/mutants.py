"""Mutation checks: each test that claims a behaviour must fail when that behaviour is broken.

``make mutants`` (in CI) copies the checkout to a temporary folder and, for each entry of
`MUTATIONS` in turn, replaces one exact piece of product code by a broken version (a real way the
product could break: a resume that restores nothing, compilation ignored, DDP gradients summed
instead of averaged, ...), runs the tests listed for it, and puts the code back. A mutation is
caught when at least one of its listed tests fails in *every* test file listed (each file claims
the behaviour on its own); the run fails unless every mutation is caught, and prints which tests
caught each one. The listed tests pass on the unmutated code: `make test` runs them all.

A mutation whose text is not found exactly once is an error of this table (the code moved on): it
must be updated with the code, never skipped.

Usage: ``python tests/mutants.py [--list] [--only NAME ...] [--jobs N]``.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    """One way the product could break.

    Attributes:
        name: a short id (``--only`` takes it).
        claim: the behaviour the listed tests claim, which the mutation breaks.
        path: the file mutated, relative to the repository root.
        old: the exact text replaced (found exactly once in `path`).
        new: what replaces it.
        tests: pytest node ids; at least one test of each file listed must fail.
    """

    name: str
    claim: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]

    def files(self) -> list[str]:
        return sorted({t.split("::")[0] for t in self.tests})


RESUME_TESTS = (
    "tests/test_models.py::test_family_trains_matches_the_estimate_and_resumes_exactly[llama_gqa-adamw]",
    "tests/test_trainer.py::test_split_run_equals_straight_run[adamw]",
    "tests/test_in_backward.py::test_exact_resume[galore]",
    "tests/test_reliability.py::test_sigkill_mid_save_keeps_previous_checkpoint_and_resume_continues",
    "tests/test_compile.py::test_compiled_split_run_equals_straight_run[galore]",
    "tests/test_distributed.py::test_resume_under_two_processes_is_exact[galore]",
    "tests/test_fsdp2.py::test_resume_under_two_fsdp2_processes_is_exact[lowrank_restarts]",
    "tests/test_in_backward_dist.py::test_resume_under_two_fsdp2_processes_is_exact_with_updates_in_backward",
)
#: One split run of the trainer: where each restored part is shown to matter.
SPLIT = "tests/test_trainer.py::test_split_run_equals_straight_run[adamw]"

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "resume-noop",
        "a resumed run continues from its checkpoint (and not from step 0 with the same config)",
        "effpretrain/trainer.py",
        "        if self.resume_path is not None:\n            self._load(self.resume_path)",
        "        if False:\n            self._load(self.resume_path)",
        RESUME_TESTS,
    ),
    Mutation(
        "restore-only-checks",
        "resuming restores the run's state, not only its compatibility checks",
        "effpretrain/checkpoint/states.py",
        "        self.launch.checkpoint_format.read(path, state, self.model(), self.opt)\n"
        "        for name in order[1:]:\n            self._restore(name, tr, path)",
        "        pass",
        (SPLIT, "tests/test_distributed.py::test_resume_under_two_processes_is_exact[galore]"),
    ),
    Mutation(
        "restore-no-weights",
        "resuming restores the weights",
        "effpretrain/checkpoint/states.py",
        '        weights.load_model_weights(self.launch.unwrap(model), state["model"], path)',
        "        pass",
        (SPLIT,),
    ),
    Mutation(
        "restore-no-optimizer-state",
        "resuming restores the optimizer state",
        "effpretrain/checkpoint/states.py",
        '            opt.load_state_dict(state["optimizer"])',
        "            pass",
        (SPLIT,),
    ),
    Mutation(
        "restore-no-scheduler",
        "resuming restores the learning-rate schedule",
        "effpretrain/checkpoint/states.py",
        "        for name in order[1:]:\n            self._restore(name, tr, path)",
        '        for name in order[1:]:\n            if name != "scheduler":\n                self._restore(name, tr, path)',
        (SPLIT,),
    ),
    Mutation(
        "restore-no-data-position",
        "resuming restores the data position",
        "effpretrain/checkpoint/states.py",
        "        for name in order[1:]:\n            self._restore(name, tr, path)",
        '        for name in order[1:]:\n            if name != "data":\n                self._restore(name, tr, path)',
        (SPLIT,),
    ),
    Mutation(
        "restore-no-rng",
        "resuming restores the random state (ReLoRA draws each merge's new factor from it)",
        "effpretrain/checkpoint/states.py",
        "        for name in order[1:]:\n            self._restore(name, tr, path)",
        '        for name in order[1:]:\n            if name != "rng":\n                self._restore(name, tr, path)',
        ("tests/test_trainer.py::test_split_relora_run_restores_the_random_state",),
    ),
    Mutation(
        "compile-ignored",
        "train.compile compiles the decoder blocks",
        "effpretrain/run_model.py",
        "    if cfg.train.compile:\n        compile_blocks(model)",
        "    if False:\n        compile_blocks(model)",
        (
            "tests/test_compile.py::test_compiled_run_matches_eager[adamw]",
            "tests/test_flops.py::test_a_compiled_run_reports_its_compile_time",
        ),
    ),
    Mutation(
        "tied-stepped-twice",
        "a matrix two modules share (tied embedding and head) gets one update and one state",
        "effpretrain/optim_setup.py",
        "            if id(p) in seen or id(p) in w0s or not (p.requires_grad or id(p) in phased):",
        "            if id(p) in w0s or not (p.requires_grad or id(p) in phased):",
        ("tests/test_tied_and_targets.py::test_tied_step_equals_torch_adamw_bitwise",),
    ),
    Mutation(
        "ddp-loss-not-scaled",
        "DDP's gradient is the global batch's token mean (DDP's average times the world size)",
        "effpretrain/trainer.py",
        "                self.acc.backward(s * (self.world / n_targets))",
        "                self.acc.backward(s * (1 / n_targets))",
        ("tests/test_distributed.py::test_ddp_two_processes_equal_one_process_at_same_global_batch[adamw]",),
    ),
    Mutation(
        "ddp-in-backward-grads-summed",
        "with updates in backward, each DDP gradient is averaged over the ranks",
        "effpretrain/in_backward.py",
        "        grad.mul_(1.0 / self.world)\n",
        "",
        (
            "tests/test_in_backward_dist.py::test_two_processes_equal_one_process_with_updates_in_backward"
            "[adamw-noclip-ddp]",
        ),
    ),
    Mutation(
        "in-backward-drops-a-micro-batch",
        "updates in backward accumulate every micro-batch's gradient",
        "effpretrain/in_backward.py",
        "        if basis is None:\n            acc.add_(g)\n",
        "        if basis is None:\n            pass\n",
        ("tests/test_in_backward.py::test_parity_with_normal_path[adamw]",),
    ),
    Mutation(
        "estimator-drops-sdpa-logsumexp",
        "the activation estimate counts every tensor a block saves (SDPA's fp32 logsumexp per head)",
        "effpretrain/memory/activations.py",
        "            + 8\n            + 4 * s.heads\n",
        "            + 8\n",
        ("tests/test_memory.py::test_activations_equal_saved_bytes[0-adamw-fp32]",),
    ),
    Mutation(
        "8bit-scales-not-saved",
        "a checkpoint holds the 8-bit moments' scales with their codes",
        "effpretrain/checkpoint/states.py",
        "            optimizer_state=opt.state_dict(),",
        '            optimizer_state={**opt.state_dict(), "state": {k: {n: t for n, t in v.items() '
        'if not n.endswith("_absmax")} for k, v in opt.state_dict()["state"].items()}},',
        ("tests/test_trainer.py::test_split_run_equals_straight_run[galore_8bit]",),
    ),
    Mutation(
        "shape-drops-head-dim",
        "the estimate counts the model the trainer builds, whatever its head size (drawn shapes)",
        "effpretrain/models/llama.py",
        "            head_dim=self.dim,\n",
        "",
        ("tests/test_shapes.py::test_estimate_counts_the_model_the_trainer_builds[Qwen3ForCausalLM-galore]",),
    ),
    Mutation(
        "measure-clips-always",
        "a measured step clips at the run's own train.grad_clip (0: not at all)",
        "effpretrain/run_model.py",
        "    clip = cfg.train.grad_clip",
        "    clip = 1.0",
        ("tests/test_memory_measure.py::test_measured_step_clips_at_the_runs_grad_clip",),
    ),
    Mutation(
        "full-disk-zip-writer-traceback",
        "a full disk while torch.save writes a checkpoint file ends the run in one line, exit 4",
        "effpretrain/checkpoint/commit.py",
        "        except RuntimeError as e:\n            os_err = os_error_of(e)",
        "        except KeyboardInterrupt as e:\n            os_err = os_error_of(e)",
        (
            "tests/test_full_disk.py::test_a_file_size_limit_hit_in_each_checkpoint_file_stops_in_one_line"
            "_and_resume_is_exact[optimizer.pt]",
        ),
    ),
    Mutation(
        "full-disk-sharded-partial-folder",
        "a sharded save that fails leaves no partial folder behind",
        "effpretrain/checkpoint/commit.py",
        '    shutil.rmtree(ckpt_root / f"step-{step}.tmp-{pid or os.getpid()}", ignore_errors=True)',
        "    pass",
        (
            "tests/test_full_disk.py::test_a_file_size_limit_hit_in_a_sharded_save_stops_every_rank_in_one_line",
        ),
    ),
    Mutation(
        "bf16-rounding-biased",
        "stochastic rounding to bf16 is unbiased",
        "optimizers/rounding.py",
        "    r = (u * 65536.0).to(torch.int32)",
        "    r = (u * 32768.0).to(torch.int32)",
        ("tests/optimizers/test_rounding.py::test_stochastic_rounding_to_bf16_is_unbiased[0.3]",),
    ),
    Mutation(
        "int8-rounding-biased",
        "stochastic rounding of an INT8 group is unbiased",
        "optimizers/rounding.py",
        "        q = torch.floor(q + up.reshape(m, g, group))",
        "        q = torch.floor(q + 0.5 * up.reshape(m, g, group))",
        (
            "tests/optimizers/test_rounding.py::test_stochastic_rounding_of_an_int8_group_is_unbiased[128-128]",
        ),
    ),
    Mutation(
        "int8-written-in-place",
        "an INT8 weight's updates go through the one writer (an in-place write is refused)",
        "optimizers/int8.py",
        "        if func._schema.is_mutable:",
        "        if False:",
        ("tests/test_int8.py::test_an_int8_weight_refuses_in_place_writes_and_takes_the_writers",),
    ),
    Mutation(
        "int8-scales-not-restored",
        "an INT8 run resumes its weights' codes and scales exactly",
        "effpretrain/models/quantize.py",
        "        inner.scales.copy_(scales)",
        "        pass",
        ("tests/test_int8.py::test_an_int8_split_run_ends_on_the_straight_runs_codes[adamw]",),
    ),
    Mutation(
        "int8-rounding-plan-lost",
        "a trainer's INT8 weights round stochastically (the plan survives Module.to)",
        "optimizers/int8.py",
        "            return _carry(w, Int8Weight(w.codes, w.scales, w.group, w.dtype))",
        "            return Int8Weight(w.codes, w.scales, w.group, w.dtype)",
        ("tests/test_int8.py::test_the_trainer_rounds_every_int8_weight_stochastically_at_its_step",),
    ),
    Mutation(
        "shard-noise-not-offset",
        "an FSDP2 shard rounds its rows with the whole tensor's noise (its rows' offsets)",
        "optimizers/writer.py",
        "    offset = (_row_offset(p) + start_row) * width",
        "    offset = start_row * width",
        ("tests/test_int8.py::test_int8_under_ddp_and_fsdp2_follows_one_process",),
    ),
    Mutation(
        "estimator-drops-writer-bytes",
        "the estimate counts the writer's fp32 value and rounding temporaries (a measured big step)",
        "effpretrain/memory/terms.py",
        "            step += rounded",
        "            step += 0",
        ("tests/benchmarks/test_big_step.py::test_a_small_big_step_measures_what_the_estimator_states",),
    ),
    Mutation(
        "dtensor-caches-kept",
        "a finished multi-process command leaves no gloo group for the exit to destroy (it can abort)",
        "effpretrain/cli.py",
        "        _drop_dtensor_caches()\n",
        "",
        ("tests/test_process_group.py::test_no_gloo_thread_outlives_the_end_of_an_fsdp2_run",),
    ),
    Mutation(
        "init-weights-ignored",
        "a run from model.init starts from the folder's weights (step 0 is the source model's loss)",
        "effpretrain/run_model.py",
        "    if weights is not None:\n        model, weights.report = load_pretrained(",
        "    if False:\n        model, weights.report = load_pretrained(",
        (
            "tests/test_continue.py::test_starts_from_the_weights_trains_and_resumes_exactly[qwen2_tied-adamw]",
        ),
    ),
    Mutation(
        "init-shard-rows-from-zero",
        "under FSDP2 each rank reads its own rows of every tensor (parity with one process)",
        "effpretrain/models/pretrained.py",
        "            start = sum(counts[:r])",
        "            start = 0",
        ("tests/test_continue.py::test_two_processes_from_the_folder_equal_one[llama_sharded]",),
    ),
    Mutation(
        "lowrank-pretrained-random",
        "Low-Rank from pretrained weights starts at their truncated SVD",
        "effpretrain/models/factorized/surgery.py",
        "            new.from_dense_(w)",
        "            pass",
        ("tests/test_continue.py::test_factorized_kinds_start_by_their_rule",),
    ),
    Mutation(
        "shard-write-as-stranger",
        "under FSDP2 a rule's write of a bf16 shard rounds stochastically as its parameter's (noise index, row offset)",
        "optimizers/_owners.py",
        "                with stepping(q):",
        "                with contextlib.nullcontext():",
        (
            "tests/optimizers/test_sharded_rounding.py::test_fsdp2_shards_round_stochastically_as_one_process[spam]",
        ),
    ),
)


# -- the pytest plugin loaded into each mutant's run (``-p mutants``) ------------------------------

_failed_files: set[str] = set()


def pytest_runtest_setup(item) -> None:  # pragma: no cover - runs inside the mutant's pytest
    """Once a test of a file has failed, the mutant is caught there: skip the file's other tests."""
    import pytest

    if item.nodeid.split("::")[0] in _failed_files:
        pytest.skip("mutant already caught in this file")


def pytest_runtest_logreport(report) -> None:  # pragma: no cover - runs inside the mutant's pytest
    if report.failed:
        _failed_files.add(report.nodeid.split("::")[0])


# -- the runner ------------------------------------------------------------------------------------


def copy_checkout(dest: Path) -> None:
    """The checkout's tracked and untracked-but-not-ignored files (no .venv, runs, caches)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, out.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def check_table(mutations: tuple[Mutation, ...] = MUTATIONS, root: Path = ROOT) -> list[str]:
    """Problems of the table itself: duplicate names, text not found exactly once, tests missing."""
    problems, names = [], set()
    for m in mutations:
        if m.name in names:
            problems.append(f"{m.name}: duplicate name")
        names.add(m.name)
        text = (root / m.path).read_text()
        if text.count(m.old) != 1:
            problems.append(f"{m.name}: its text occurs {text.count(m.old)} times in {m.path}, not once")
        if m.old == m.new:
            problems.append(f"{m.name}: the replacement changes nothing")
        for t in m.tests:
            f, _, func = t.partition("::")
            if not (root / f).is_file():
                problems.append(f"{m.name}: no test file {f}")
            elif f"def {func.split('[')[0]}(" not in (root / f).read_text():
                problems.append(f"{m.name}: no test {t}")
    return problems


def run_mutant(m: Mutation, copy: Path, workers: int) -> tuple[dict[str, list[str]], float, str]:
    """Applies `m` in `copy`, runs its tests, restores the file; returns the failed tests by file,
    the seconds it took and pytest's output tail."""
    target = copy / m.path
    original = target.read_text()
    target.write_text(original.replace(m.old, m.new, 1))
    report = copy / f".mutant-{m.name}.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy / "tests"), str(copy)]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "mutants"]
    cmd += ["-o", "addopts=", f"--junitxml={report}", "-x" if workers == 0 else "--dist=loadfile"]
    if workers:
        cmd += ["-n", str(workers)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd + list(m.tests), cwd=copy, env=env, capture_output=True, text=True)
    finally:
        target.write_text(original)
    failed: dict[str, list[str]] = defaultdict(list)
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                f = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
                failed[f].append(case.get("name", "?"))
    return dict(failed), time.time() - t0, (proc.stdout + proc.stderr)[-3000:]


def caught_in(m: Mutation, failed: dict[str, list[str]]) -> dict[str, list[str]]:
    """The failed tests of each of `m`'s files (matched by the file's path)."""
    out = {}
    for f in m.files():
        hits = [name for key, names in failed.items() if key.endswith(f) or f.endswith(key) for name in names]
        out[f] = hits
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="list the mutations and their tests")
    p.add_argument("--only", nargs="*", default=None, help="run only these mutations")
    p.add_argument("--jobs", type=int, default=2, help="processes at once (the machine's cores)")
    args = p.parse_args(argv)
    mutations = [m for m in MUTATIONS if args.only is None or m.name in args.only]
    if args.only and len(mutations) != len(set(args.only)):
        print(f"mutants: unknown name in {args.only}", file=sys.stderr)
        return 2
    if args.list:
        for m in mutations:
            print(f"{m.name}: {m.claim}\n  {m.path}\n  " + "\n  ".join(m.tests))
        return 0
    problems = check_table()
    if problems:
        print("mutants: the table is out of date:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    jobs = max(1, args.jobs)
    # A mutant with tests in several files runs them on `jobs` pytest-xdist workers, alone; the
    # others run `jobs` at a time, one process each (a single file gains nothing from xdist).
    several = [m for m in mutations if len(m.files()) > 1 and jobs > 1]
    single = [m for m in mutations if m not in several]
    results: dict[str, tuple[dict[str, list[str]], float, str]] = {}
    lock, t_all = threading.Lock(), time.time()

    def report(m: Mutation) -> None:
        failed, seconds, tail = results[m.name]
        by_file = caught_in(m, failed)
        ok = all(by_file.values())
        with lock:
            print(f"{m.name}: {'caught' if ok else 'SURVIVED'} ({seconds:.0f} s) - {m.claim}")
            for f, names in by_file.items():
                print(f"    {f}: {', '.join(names) if names else 'NOT CAUGHT (every listed test passed)'}")
            if not ok:
                print("    " + tail.replace("\n", "\n    "))
            sys.stdout.flush()

    with tempfile.TemporaryDirectory(prefix="effpretrain-mutants-") as tmp:
        copies: queue.Queue[Path] = queue.Queue()
        for j in range(jobs if single else 1):
            copy = Path(tmp) / f"src{j}"
            copy_checkout(copy)
            copies.put(copy)

        def run(m: Mutation, workers: int) -> None:
            copy = copies.get()
            try:
                results[m.name] = run_mutant(m, copy, workers)
            finally:
                copies.put(copy)
            report(m)

        for m in several:
            run(m, jobs)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(lambda m: run(m, 0), single))
    survived = [m.name for m in mutations if not all(caught_in(m, results[m.name][0]).values())]
    print(
        f"mutants: {len(mutations) - len(survived)} of {len(mutations)} caught in {time.time() - t_all:.0f} s"
    )
    if survived:
        print(f"mutants: survived: {', '.join(survived)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared by the tests: the repository's paths, the tiny-run overrides, and the environment of a
child process (the checkout under test first on the import path, one OpenMP thread, no GPU visible
outside `make test-gpu`)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
TINY = RECIPES / "tiny"

#: A tiny recipe run that trains in seconds: short sequences, a small BPE, a small validation set.
TINY_OVERRIDES = [
    "data.seq_len=32",
    "data.vocab_size=512",
    "train.batch_size=4",
    "train.eval_tokens=256",
    "train.log_every=5",
    "train.plot=false",
]


#: `make test-gpu` sets this: the session runs tests/gpu/ with the GPUs visible. Any other session
#: hides every GPU, so the suite runs on the CPU and means the same on any machine (on a GPU box,
#: two ranks would otherwise share cuda:0 and the CPU-calibrated exactness tests would run on CUDA).
GPU_SESSION = os.environ.get("EFFPRETRAIN_TEST_GPU") == "1"


def hide_gpus(env: dict[str, str] | os._Environ) -> None:
    """Sets ``CUDA_VISIBLE_DEVICES=""`` in `env` (CUDA then finds no device; torch's
    ``cuda.is_available()`` is False), except in a `GPU_SESSION`. tests/conftest.py applies it to
    the test process at start-up, before anything can initialise CUDA; `child_env` to every child."""
    if not GPU_SESSION:
        env["CUDA_VISIBLE_DEVICES"] = ""


def child_env(threads: int | None = 1, **extra: str) -> dict[str, str]:
    """This process's environment for a child process: the repository first on PYTHONPATH (so the
    child imports the checkout under test), ``OMP_NUM_THREADS=threads`` (None: as inherited; one
    thread each keeps concurrent processes from fighting over the cores), no GPU visible
    (`hide_gpus`), then `extra`."""
    env = dict(os.environ)
    hide_gpus(env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra)
    return env


#: How `train.update_in_backward` accumulates a method's micro-batch gradients, by kind (read from
#: the registry by `in_backward_kind`).
IN_BACKWARD_KINDS = ("element_wise", "whole_matrix", "projected", "low_rank")


def in_backward_kind(method: str) -> str:
    """A registered method's in-backward kind, from its registry entry: ``low_rank`` (its update
    reads G only through R = P^T G, ``PROJECTED_GRAD_ONLY``: the engine sums the projected
    micro-gradients), ``projected`` (a basis, full accumulators), ``whole_matrix`` (steps that
    need a whole matrix, no basis: Muon's orthogonalization, 8-bit blocks; owner ranks under
    FSDP2) or ``element_wise``."""
    import optimizers

    spec = optimizers.method_spec(method)
    if spec.projects:
        return "low_rank" if getattr(spec.cls, "PROJECTED_GRAD_ONLY", False) else "projected"
    return "whole_matrix" if spec.whole_matrix_steps else "element_wise"


def train_records(run: Path, since: int = 0) -> dict[int, dict]:
    """A run's logged training steps (the metrics.jsonl records that carry a loss and an lr), by
    step; from line `since` on (a run resumed into its own folder appends to the file)."""
    import json

    lines = (run / "metrics.jsonl").read_text().splitlines()[since:]
    records = [json.loads(line) for line in lines]
    return {r["step"]: r for r in records if "event" not in r and "loss" in r and "lr" in r}


#: What a resumed run's logged step must share with the straight run's at the same step: the
#: quantities that depend on the restored state (weights and data: the loss; the schedule: lr;
#: the optimizer state: every later step; the tokens counted so far).
RESUMED_KEYS = ("loss", "lr", "grad_norm", "tokens", "optimizer_state_bytes")


def metrics_lines(run: Path) -> int:
    """How many records a run's metrics.jsonl holds now (0 before it exists)."""
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def assert_resumed_from(straight: Path, resumed: Path, at: int, since: int = 0) -> None:
    """The resume happened, from step `at`, and was exact: the resumed run's first logged step is
    `at` + 1 (a resume that restored nothing would log step 1 first), and every step it logged
    equals the straight run's at the same step in `RESUMED_KEYS` (both runs need
    ``train.log_every=1``); `since`: the resumed run's first line in its metrics.jsonl, where it
    was resumed into a folder that already held a run's records. A restore that got the weights or the data position wrong shows in
    step `at` + 1's loss, the schedule in its lr, the optimizer state from step `at` + 2 on.

    Bitwise: once its state is restored, the resumed run executes the same operations in the same
    order as the straight run (same code, config and thread count), so every logged float is the
    same bits."""
    s, r = train_records(straight), train_records(resumed, since)
    assert r, f"{resumed} logged no training step"
    assert min(r) == at + 1, f"the resumed run logged step {min(r)} first, not {at + 1}: it did not resume"
    assert sorted(r) == [k for k in sorted(s) if k > at], (sorted(r), sorted(s))
    for step, rec in r.items():
        for key in RESUMED_KEYS:
            assert rec.get(key) == s[step].get(key), (step, key, rec.get(key), s[step].get(key))

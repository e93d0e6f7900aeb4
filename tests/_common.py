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

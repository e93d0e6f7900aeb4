"""Shared by the tests: the repository's paths, the tiny-run overrides, and the environment of a
child process (the checkout under test first on the import path, one OpenMP thread)."""

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


def child_env(threads: int | None = 1, **extra: str) -> dict[str, str]:
    """This process's environment for a child process: the repository first on PYTHONPATH (so the
    child imports the checkout under test), ``OMP_NUM_THREADS=threads`` (None: as inherited; one
    thread each keeps concurrent processes from fighting over the cores), then `extra`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra)
    return env

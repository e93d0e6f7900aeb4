"""Shared fixtures: one tokenizer cache per test session, tiny fast configs.

The shared optimizer-test helpers and contract checks are in tests/optimizers/harness.py; its
folder is put on the import path here so that any test module can ``import harness``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "optimizers"))


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    # The built-in BPE is trained once per session into a private cache, never the user's.
    path = os.environ.get("EFFPRETRAIN_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    os.environ["EFFPRETRAIN_CACHE"] = path
    yield path


TINY_OVERRIDES = [
    "data.seq_len=32",
    "data.vocab_size=512",
    "train.batch_size=4",
    "train.eval_tokens=256",
    "train.log_every=5",
    "train.plot=false",
]


@pytest.fixture
def tiny_overrides():
    return list(TINY_OVERRIDES)

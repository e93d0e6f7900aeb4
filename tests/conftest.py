"""Shared fixtures: one tokenizer cache per test session, tiny fast configs."""

from __future__ import annotations

import os

import pytest


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
    "train.eval_batches=2",
    "train.log_every=5",
    "train.plot=false",
]


@pytest.fixture
def tiny_overrides():
    return list(TINY_OVERRIDES)

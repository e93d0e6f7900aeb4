"""Shared fixtures: one tokenizer cache per test session, tiny fast configs.

The shared optimizer-test helpers and contract checks are in tests/optimizers/harness.py; its
folder is put on the import path here so that any test module can ``import harness``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from _common import TINY_OVERRIDES

sys.path.insert(0, str(Path(__file__).resolve().parent / "optimizers"))


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    # The built-in BPE is trained once per session into a private cache, never the user's.
    path = os.environ.get("EFFPRETRAIN_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    os.environ["EFFPRETRAIN_CACHE"] = path
    yield path


@pytest.fixture
def tiny_overrides():
    return list(TINY_OVERRIDES)


def pytest_collection_modifyitems(config, items):
    """Kinds: a test not marked `run` or `multiprocess` is a `unit` test; `make test-fast` runs
    the `fast` tier, every unit test and the runs marked `fast`."""
    for item in items:
        kinds = {m.name for m in item.iter_markers()} & {"run", "multiprocess"}
        if not kinds:
            item.add_marker(pytest.mark.unit)
            item.add_marker(pytest.mark.fast)
        elif "multiprocess" in kinds and item.get_closest_marker("fast"):
            raise pytest.UsageError(f"{item.nodeid}: a multiprocess test cannot be in the fast tier")

"""Shared fixtures: one tokenizer cache per test session, tiny fast configs; no GPU visible.

The shared optimizer-test helpers and contract checks are in tests/optimizers/harness.py; its
folder is put on the import path here so that any test module can ``import harness``.

The suite runs on the CPU on any machine: this file hides every GPU from the test process and its
children when pytest loads it, before any test can initialise CUDA (`_common.hide_gpus`), whether
pytest runs through `make test` or directly. The CUDA-only tests in tests/gpu/ (marker `gpu`) run
in a session of their own, `make test-gpu`, which leaves the GPUs visible; each session skips the
other's tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from _common import GPU_SESSION, TINY_OVERRIDES, hide_gpus

hide_gpus(os.environ)
sys.path.insert(0, str(Path(__file__).resolve().parent / "optimizers"))
GPU_TESTS = Path(__file__).resolve().parent / "gpu"


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
    the `fast` tier, every unit test and the runs marked `fast`. A test in tests/gpu/ is marked
    `gpu` (and nothing else): it runs only in `make test-gpu`'s session, which runs nothing else."""
    for item in items:
        if GPU_TESTS in item.path.resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not GPU_SESSION:
                item.add_marker(
                    pytest.mark.skip(reason="a CUDA test: make test-gpu runs it, with the GPUs visible")
                )
            continue
        if GPU_SESSION:
            item.add_marker(pytest.mark.skip(reason="the CPU suite runs with the GPUs hidden: make test"))
        kinds = {m.name for m in item.iter_markers()} & {"run", "multiprocess"}
        if not kinds:
            item.add_marker(pytest.mark.unit)
            item.add_marker(pytest.mark.fast)
        elif "multiprocess" in kinds and item.get_closest_marker("fast"):
            raise pytest.UsageError(f"{item.nodeid}: a multiprocess test cannot be in the fast tier")

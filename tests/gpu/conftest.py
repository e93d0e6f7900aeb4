"""The CUDA-only tests (marker `gpu`), run by `make test-gpu` on a machine with a GPU.

Nothing here hides the GPUs: in make test-gpu's session (EFFPRETRAIN_TEST_GPU=1) tests/conftest.py
leaves them visible and skips every other test; in any other session it hides them and skips these.
Where no CUDA device is visible, each test here is skipped with the reason.
"""

from __future__ import annotations

import pytest
import torch


def pytest_runtest_setup(item):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible (make test-gpu runs these on a machine with a GPU)")

"""Fixtures for the optimizer tests (the shared helpers are in harness.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These tensors are tiny: a second intra-op thread only adds synchronisation, which stalls
    # badly when the machine is busy. Restored after each module.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

"""benchmarks/row_mixing.py: the spread of batch means that the fixed-model section compares."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    # benchmarks/ is a folder of scripts, not an installed package: load the file itself.
    name = "effpretrain_benchmarks_row_mixing"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "row_mixing.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


bench = _load()


def test_block_spread_is_the_std_of_consecutive_block_means():
    # Four "documents" of 4 rows each, every row of a document at the document's loss.
    losses = [1.0] * 4 + [3.0] * 4 + [2.0] * 4 + [6.0] * 4
    assert bench.block_spread(losses, 4) == pytest.approx(statistics.stdev([1.0, 3.0, 2.0, 6.0]))
    # Interleaved, every block of 4 holds one row of each document: the block means are equal.
    mixed = [losses[d * 4 + i] for i in range(4) for d in range(4)]
    assert bench.block_spread(mixed, 4) == 0.0
    # A trailing partial block is not a batch.
    assert bench.block_spread(losses + [100.0], 4) == bench.block_spread(losses, 4)

"""benchmarks/row_mixing.py: the spread of batch means that the fixed-model section compares."""

from __future__ import annotations

import statistics

import pytest
from bench_scripts import load

bench = load("row_mixing")


def test_block_spread_is_the_std_of_consecutive_block_means():
    # Four "documents" of 4 rows each, every row of a document at the document's loss.
    losses = [1.0] * 4 + [3.0] * 4 + [2.0] * 4 + [6.0] * 4
    assert bench.block_spread(losses, 4) == pytest.approx(statistics.stdev([1.0, 3.0, 2.0, 6.0]))
    # Interleaved, every block of 4 holds one row of each document: the block means are equal.
    mixed = [losses[d * 4 + i] for i in range(4) for d in range(4)]
    assert bench.block_spread(mixed, 4) == 0.0
    # A trailing partial block is not a batch.
    assert bench.block_spread(losses + [100.0], 4) == bench.block_spread(losses, 4)

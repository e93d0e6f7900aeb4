"""CUDA only (`make test-gpu`): a compiled run's memory is measured after its compiling step (G12
of the CUDA review, docs/gpu.md), and what it measures then is the estimate's."""

from __future__ import annotations

import pytest
import torch
from _common import TINY, TINY_OVERRIDES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_compiled_measurement_starts_after_the_compiling_step():
    """Step 0 compiles the blocks (Inductor; Triton's autotuning buffers in the allocator's peak):
    `measure_run` measures steps 1 and 2, and their weights, gradients and optimizer state equal
    the estimate, as an eager run's do."""
    from effpretrain.config import load_config
    from effpretrain.memory import estimate_from_config
    from effpretrain.memory.measure import measure_run
    from effpretrain.trainer import memory_steps

    cfg = load_config(TINY / "adamw.yaml", [*TINY_OVERRIDES, "train.compile=true", "train.max_steps=10"])
    assert memory_steps(cfg) == [2, 3]
    rows = measure_run(cfg, 512, steps=2, device="cuda")
    assert [r["step"] for r in rows] == [1, 2]
    est = estimate_from_config(cfg, 512)
    for r in rows:
        assert (r["weights"], r["gradients"], r["optimizer_state"]) == (
            est.weights,
            est.grads,
            est.optimizer_state,
        ), r

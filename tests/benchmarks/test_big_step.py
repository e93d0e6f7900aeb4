"""`benchmarks/big_step.py` at a size that runs here in seconds (llama_20m, INT8 weights with the
embedding and head, APOLLO-Mini on every linear layer and the head, updates in backward): the
measured weights, gradients and optimizer state equal the estimate to the byte, the measured peak
is within 2% of the estimated one (the claim the committed 7B and 13B steps are held to), the
losses are finite, and the result carries what the docs quote and where it came from."""

from __future__ import annotations

import json
import math

import pytest
from bench_scripts import load

TARGETS = "optim.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]"


@pytest.mark.run
def test_a_small_big_step_measures_what_the_estimator_states(tmp_path):
    bs = load("big_step")
    argv = ["--model", "llama_20m", "--method", "apollo_mini", "--weight-quant", "int8"]
    argv += ["--weight-quant-embeddings", "--update-in-backward", "--steps", "2", "--set", TARGETS]
    assert bs.main([*argv, "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "big_step.json").read_text())
    est = r["estimated"]
    for step in r["measured"]:
        assert step["weights"] == est["weights"] and step["optimizer_state"] == est["optimizer_state"]
        assert step["gradients"] == est["gradients"]
    assert abs(r["measured_peak_bytes"] / r["estimated_peak_bytes"] - 1) <= 0.02, r["peak_ratio"]
    assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
    assert r["params"] == 19_548_416 and r["peak_rss_bytes"] > r["measured_peak_bytes"] / 2
    assert r["commit"] and r["machine"] and r["wall_s"] > 0

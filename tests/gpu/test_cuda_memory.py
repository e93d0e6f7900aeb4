"""Memory bookkeeping on CUDA: the peak floor across a measured step's resets (G2) and the
pre-flight's limit from the free memory (G8)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _common import ROOT

from effpretrain.config import load_config
from effpretrain.errors import ConfigError
from effpretrain.memory import measure, preflight
from effpretrain.trainer import train

MiB = 2**20


@pytest.fixture
def fresh_floor(monkeypatch):
    monkeypatch.setattr(measure, "_CUDA_PEAK_FLOOR", {})
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def test_peak_floor_survives_a_measured_steps_resets(fresh_floor):
    """A 512 MiB spike, then a measured step (which resets the allocator's peak at every phase
    boundary): max_memory_allocated forgets the spike, process_peak_bytes keeps it under every
    spelling of the device (the step saved it under its parameters' cuda:0)."""
    dev = torch.device("cuda", 0)
    model = torch.nn.Linear(256, 256, device=dev)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 256, device=dev)

    def step():
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    spike = torch.empty(512 * MiB, dtype=torch.uint8, device=dev)
    del spike
    torch.cuda.synchronize()
    before = torch.cuda.max_memory_allocated(dev)
    assert before >= 512 * MiB
    rec = measure.measure_step(step, model, opt, 1)
    assert rec["device"] == "cuda" and rec["peak"] < 512 * MiB
    assert torch.cuda.max_memory_allocated(dev) < 512 * MiB  # the resets took the spike away
    for spelling in ("cuda", "cuda:0", torch.device("cuda", 0), torch.device("cuda")):
        assert measure.process_peak_bytes(torch.device(spelling)) >= before, spelling


def test_a_cuda_runs_reported_peak_covers_its_measured_steps(tmp_path, fresh_floor, tiny_overrides):
    """summary.json's peak_memory_bytes (read under Accelerate's device) is at least every
    measured step's peak (taken under the parameters' device before the resets)."""
    over = [*tiny_overrides, "train.max_steps=4", "train.eval_every=0", "train.device=cuda"]
    summary = train(load_config(ROOT / "recipes/tiny/galore.yaml", over), tmp_path / "run")
    measured = summary["memory_measured"]["max"]["peak"]
    assert summary["peak_memory_bytes"] >= measured > 0


def test_preflight_limit_is_the_free_memory_less_the_reserve():
    dev = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(dev)
    limit, what = preflight.device_memory_limit(dev)
    expected = int(free - preflight.CUDA_RESERVE_BYTES - preflight.FRAGMENTATION * free)
    # Free memory moves a little between two reads (this process's own allocator, other processes).
    assert abs(limit - expected) <= 64 * MiB and limit < total, (limit, expected, total)
    assert what.startswith("free GPU memory")
    # An estimate between the limit and the total, which the old check (total memory) let through.
    between = (limit + total) // 2
    est = SimpleNamespace(peak=between, total=between, detail={"peak_terms": {"activations": between}})
    with pytest.raises(ConfigError, match="exceeds free GPU memory"):
        preflight.check_fits(est, dev)

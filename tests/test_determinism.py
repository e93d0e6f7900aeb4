"""`train.deterministic` (effpretrain/determinism.py): deterministic algorithms and the cuBLAS
workspace setting are on for the whole run, set before the Accelerator (and so before CUDA) starts,
and put back when the run ends; off, the process's own settings stay; a bad value is refused."""

from __future__ import annotations

import os

import pytest
import torch
from _common import ROOT

from effpretrain import trainer
from effpretrain.config import load_config
from effpretrain.determinism import CUBLAS_WORKSPACE, deterministic
from effpretrain.errors import ConfigError


def _state() -> tuple:
    cudnn = torch.backends.cudnn
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn.deterministic,
        cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )


@pytest.mark.parametrize("workspace", [None, ":16:8", ":0:0"])
def test_deterministic_sets_every_knob_and_restores_them(workspace, monkeypatch):
    if workspace is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", workspace)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    before = _state()
    assert before[0] is False
    with pytest.raises(RuntimeError, match="raised inside"), deterministic(True):
        # A deterministic setting the user chose (:16:8) stays; any other becomes :4096:8.
        kept = ":16:8" if workspace == ":16:8" else CUBLAS_WORKSPACE
        assert _state() == (True, False, True, False, kept)
        raise RuntimeError("raised inside")
    assert _state() == before
    with deterministic(False):
        assert _state() == before  # off: nothing changes


@pytest.mark.run
def test_a_deterministic_run_trains_with_it_and_gives_it_back(tmp_path, monkeypatch, tiny_overrides):
    """The whole run (the Accelerator built, the steps, the final checkpoint) sees deterministic
    algorithms and CUBLAS_WORKSPACE_CONFIG; no CPU op of the run lacks a deterministic kernel; after
    `train` returns, the process's settings are back."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen = {}
    make_acc, fit = trainer.make_accelerator, trainer.Trainer.fit

    def make_accelerator(*a, **k):
        seen["accelerator"] = _state()
        return make_acc(*a, **k)

    def checked_fit(self, stop):
        seen["fit"] = _state()
        return fit(self, stop)

    monkeypatch.setattr(trainer, "make_accelerator", make_accelerator)
    monkeypatch.setattr(trainer.Trainer, "fit", checked_fit)
    before = _state()
    over = [*tiny_overrides, "train.max_steps=3", "train.eval_every=0", "train.deterministic=true"]
    summary = trainer.train(load_config(ROOT / "recipes/tiny/galore.yaml", over), tmp_path / "run")
    assert summary["steps"] == 3
    on = (True, False, True, False, CUBLAS_WORKSPACE)
    assert seen == {"accelerator": on, "fit": on}
    assert _state() == before


def test_train_deterministic_takes_a_bool_only():
    assert load_config(None, []).train.deterministic is False
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.deterministic=maybe"])
    assert (
        str(e.value)
        == "--set train.deterministic: train.deterministic='maybe' has the wrong type (expected bool)"
    )

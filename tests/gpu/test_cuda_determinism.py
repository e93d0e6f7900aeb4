"""train.deterministic on CUDA (G15): a run split at a checkpoint ends bitwise equal to the straight
run, eager and compiled, as on the CPU without it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _common import ROOT
from safetensors.torch import load_file

from effpretrain.config import load_config
from effpretrain.trainer import train


def _split_equals_straight(tmp_path, recipe: str, extra: list[str], tiny_overrides: list[str]) -> None:
    over = [*tiny_overrides, "train.max_steps=20", "train.save_every=10", "train.eval_every=0"]
    over += ["train.device=cuda", "train.deterministic=true", *extra]
    path = ROOT / "recipes" / "tiny" / f"{recipe}.yaml"
    straight = train(load_config(path, over), tmp_path / "straight")
    split = train(
        load_config(path, over), tmp_path / "split", resume=str(tmp_path / "straight/checkpoints/step-10")
    )
    a = load_file(str(tmp_path / "straight/checkpoints/step-20/model.safetensors"))
    b = load_file(str(tmp_path / "split/checkpoints/step-20/model.safetensors"))
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]
    assert split["final_val_loss"] == straight["final_val_loss"]


@pytest.mark.parametrize(
    ("recipe", "extra"),
    [("galore", []), ("lowrank_restarts", ["train.loss=standard"])],  # the chunked loss, then F.cross_entropy
)
def test_deterministic_split_run_equals_straight_run_on_cuda(recipe, extra, tmp_path, tiny_overrides):
    _split_equals_straight(tmp_path, recipe, extra, tiny_overrides)


def test_deterministic_compiled_split_run_equals_straight_run_on_cuda(tmp_path, tiny_overrides):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("torch.compile on CUDA needs Triton")
    _split_equals_straight(tmp_path, "galore", ["train.compile=true"], tiny_overrides)

"""Shared by the 2-process tests (test_distributed.py, test_fsdp2.py): the tiny-run overrides and
how final weights are read and compared."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

# 20 steps of the tiny recipes, a basis refresh every 5 and restarts every 7.
COMMON = [
    "data.seq_len=32",
    "data.vocab_size=512",
    "train.eval_batches=2",
    "train.max_steps=20",
    "train.eval_every=20",
    "train.plot=false",
    "train.log_every=5",
    "optim.update_proj_gap=5",
    "optim.rank=8",
    "factor.rank=8",
    "restarts.every=7",
    "restarts.recovery_steps=3",
    "optim.lr=1e-3",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def final(run: Path) -> dict[str, torch.Tensor]:
    """The step-20 weights of a run, read whole whichever way they were written (an FSDP2 run's
    checkpoint is sharded: dcp/ instead of model.safetensors)."""
    from effpretrain.checkpoint import read_model_state

    return read_model_state(run / "checkpoints" / "step-20")


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).norm() / b[k].float().norm().clamp_min(1e-12)) for k in a)

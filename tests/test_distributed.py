"""Distributed claims (2 CPU processes, gloo, torchrun): DDP equals one process at the same global
batch for every method family, resume under 2 processes is exact, and a launch that does not give
the processes it asked for is refused."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from effpretrain.config import load_config
from effpretrain.trainer import train

ROOT = Path(__file__).resolve().parent.parent
METHODS = ["adamw", "galore", "fira", "apollo", "lowrank_restarts", "sltrain"]
RESUME_METHODS = ["galore", "lowrank_restarts"]
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

WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from effpretrain.config import load_config
    from effpretrain.trainer import train

    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    methods, resume_methods, common = sys.argv[3].split(","), sys.argv[4].split(","), sys.argv[5:]
    for m in methods:
        train(load_config(root / "recipes" / "tiny" / f"{m}.yaml", common + ["train.batch_size=2"]), out / f"{m}-2p")
    for m in resume_methods:
        over = common + ["train.batch_size=2", "train.save_every=10"]
        recipe = root / "recipes" / "tiny" / f"{m}.yaml"
        train(load_config(recipe, over), out / f"{m}-straight")
        train(load_config(recipe, over), out / f"{m}-split",
              resume=str(out / f"{m}-straight" / "checkpoints" / "step-10"))
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def final(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / "step-20" / "model.safetensors"))


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).norm() / b[k].float().norm().clamp_min(1e-12)) for k in a)


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    worker = out / "worker.py"
    worker.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(worker),
        str(ROOT),
        str(out),
        ",".join(METHODS),
        ",".join(RESUME_METHODS),
        *COMMON,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.parametrize("method", METHODS)
def test_ddp_two_processes_equal_one_process_at_same_global_batch(method, two_process_runs, tmp_path):
    # The same global batch of 4 rows as 2 micro-batches of 2 (one per rank in the DDP run), on one
    # thread like torchrun's workers: then every floating-point operation matches DDP's (x2 scalings
    # are exact, and a two-operand all-reduce sum is commutative), which is what lets the
    # SVD-based methods agree; a batch of 4 in one micro-batch differs in rounding at ~1e-7, which
    # Adam and basis refreshes amplify. eval_batches doubles so both evaluate the same 8 rows.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        over = COMMON + ["train.batch_size=2", "train.grad_accum=2", "train.eval_batches=4"]
        one = train(load_config(ROOT / "recipes" / "tiny" / f"{method}.yaml", over), tmp_path / "1p")
    finally:
        torch.set_num_threads(threads)
    two = json.loads((two_process_runs / f"{method}-2p" / "summary.json").read_text())
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["tokens"] == one["tokens"]
    assert abs(two["final_val_loss"] - one["final_val_loss"]) <= 1e-5 * abs(one["final_val_loss"])
    assert rel_diff(final(two_process_runs / f"{method}-2p"), final(tmp_path / "1p")) <= 1e-5


@pytest.mark.parametrize("method", RESUME_METHODS)
def test_resume_under_two_processes_is_exact(method, two_process_runs):
    a, b = final(two_process_runs / f"{method}-straight"), final(two_process_runs / f"{method}-split")
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa = json.loads((two_process_runs / f"{method}-straight" / "summary.json").read_text())
    sb = json.loads((two_process_runs / f"{method}-split" / "summary.json").read_text())
    assert sa["final_val_loss"] == sb["final_val_loss"]


def test_single_process_from_a_multi_process_launch_is_refused(monkeypatch):
    """accelerate launch on CPU with a MULTI_CPU config starts one process with MASTER_ADDR set and
    no WORLD_SIZE; silently training one replica would be wrong, so the trainer refuses."""
    from effpretrain.config import ConfigError
    from effpretrain.trainer import check_launch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match="started a single process"):
        check_launch(1, load_config(None))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="launched 2 processes"):
        check_launch(1, load_config(None))

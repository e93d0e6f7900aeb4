"""The README's CPU launch commands, run as a user types them (issue #5, acceptance 2), and the
launcher consistency checks: `accelerate launch` with recipes/accelerate/ddp_cpu.yaml and with
fsdp2_cpu.yaml, and `torchrun --nproc_per_node 2 ... --set dist.sharding=fsdp2`, each at
train.batch_size=2 per process, end where one process at batch 4 does; an Accelerate FSDP config
with dist.sharding=ddp, or with FSDP version 1, is refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _common import ROOT, child_env
from distributed_helpers import COMMON, final, free_port, rel_diff, torchrun

RECIPE = ROOT / "recipes" / "tiny" / "galore.yaml"
BIN = Path(sys.executable).parent


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _train(launcher: list[str], out: Path, extra: list[str]) -> list[str]:
    """`<launcher> -m effpretrain train galore.yaml --out OUT` with the shared tiny overrides."""
    cli = ["-m", "effpretrain", "train", str(RECIPE), "--out", str(out)]
    return [*launcher, *cli, *_sets([*COMMON, *extra])]


def _accelerate(config: str) -> list[str]:
    path = ROOT / "recipes" / "accelerate" / config
    return [
        str(BIN / "accelerate"),
        "launch",
        "--config_file",
        str(path),
        "--main_process_port",
        str(free_port()),
    ]


PER_PROCESS = ["train.batch_size=2"]
LAUNCHES = {
    "accelerate-ddp": lambda out: _train(_accelerate("ddp_cpu.yaml"), out, PER_PROCESS),
    "accelerate-fsdp2": lambda out: _train(
        _accelerate("fsdp2_cpu.yaml"), out, [*PER_PROCESS, "dist.sharding=fsdp2"]
    ),
    "torchrun-fsdp2": lambda out: _train(torchrun(2), out, [*PER_PROCESS, "dist.sharding=fsdp2"]),
    # The reference: one process at the global batch 2 x 2 (the same validation rows: train.eval_tokens).
    "one-process": lambda out: _train([sys.executable], out, ["train.batch_size=4"]),
}


def _env() -> dict[str, str]:
    env = child_env()
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    if shutil.which("accelerate", path=str(BIN)) is None:
        pytest.fail("the accelerate CLI is not installed beside this Python (pip install -e '.[dev]')")
    out = tmp_path_factory.mktemp("launchers")
    for name, cmd in LAUNCHES.items():
        res = subprocess.run(cmd(out / name), env=_env(), capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"{name}: {res.stderr[-3000:]}"
    return out


@pytest.mark.parametrize("name", ["accelerate-ddp", "accelerate-fsdp2", "torchrun-fsdp2"])
@pytest.mark.multiprocess
def test_two_processes_at_batch_b_match_one_process_at_2b(name, launched):
    two = json.loads((launched / name / "summary.json").read_text())
    one = json.loads((launched / "one-process" / "summary.json").read_text())
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["sharding"] == ("ddp" if name == "accelerate-ddp" else "fsdp2")
    assert two["tokens"] == one["tokens"] == 20 * 4 * 32
    assert abs(two["final_val_loss"] - one["final_val_loss"]) <= 1e-5 * one["final_val_loss"]
    assert rel_diff(final(launched / name), final(launched / "one-process")) <= 1e-5


@pytest.mark.parametrize(
    ("env", "sharding", "needle"),
    [
        ({"FSDP_VERSION": "2"}, "ddp", "pass --set dist.sharding=fsdp2"),
        ({"FSDP_VERSION": "1"}, "fsdp2", "FSDP version 1"),
    ],
)
def test_accelerate_fsdp_config_must_agree_with_the_recipe(env, sharding, needle, monkeypatch):
    from effpretrain.config import ConfigError, load_config
    from effpretrain.trainer import check_launch

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=needle):
        check_launch(2, load_config(None, [f"dist.sharding={sharding}"]))
    monkeypatch.setenv("FSDP_VERSION", "2")
    check_launch(2, load_config(None, ["dist.sharding=fsdp2"]))  # agreeing: accepted


@pytest.mark.parametrize(
    "config", sorted(p.name for p in (ROOT / "recipes" / "accelerate").glob("*_cpu.yaml"))
)
def test_cpu_launch_configs_hide_every_gpu(config, monkeypatch):
    """What `accelerate launch --config_file <config>` gives its processes on a GPU machine
    (Accelerate's own argument checks and environment, with its device backend reported as CUDA
    as a CUDA build of torch reports it): a CUDA_VISIBLE_DEVICES under which torch finds no GPU
    and the trainer knows the GPUs are hidden on purpose (no driver warning)."""
    import accelerate.utils.launch as acc_launch
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from effpretrain.devices import gpus_hidden

    monkeypatch.setattr(
        acc_launch, "get_torch_accelerator_backend", lambda check_available=True: ("cuda", None)
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # a user's shell, not this suite's
    path = ROOT / "recipes" / "accelerate" / config
    args = launch_command_parser().parse_args(
        ["--config_file", str(path), "--main_process_port", "0", "x.py"]
    )
    args, _, _ = _validate_launch_command(args)
    env = acc_launch.prepare_multi_gpu_env(args)
    assert "CUDA_VISIBLE_DEVICES" in env, config
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env["CUDA_VISIBLE_DEVICES"])
    assert torch.cuda._parse_visible_devices() == []
    assert gpus_hidden(env)

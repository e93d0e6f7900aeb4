"""train.device and hidden GPUs on a GPU machine (G3, G4): `cuda` trains on the GPU; with the GPUs
hidden, as make test and the *_cpu launch configs hide them, `cuda` is refused in one line and
`auto` takes the CPU without a driver warning; the ranks of a *_cpu launch see no GPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from _common import ROOT, child_env

from effpretrain.config import load_config
from effpretrain.launch import make_accelerator
from effpretrain.trainer import train


def test_train_device_cuda_trains_on_the_gpu(tmp_path, capsys, tiny_overrides):
    over = [*tiny_overrides, "train.max_steps=2", "train.eval_every=0", "train.device=cuda"]
    summary = train(load_config(ROOT / "recipes/tiny/adamw.yaml", over), tmp_path / "run")
    assert summary["device"] == torch.cuda.get_device_name(0)
    assert any(ln.startswith("device: cuda") for ln in capsys.readouterr().out.splitlines())


def test_auto_chooses_cuda(tmp_path, capsys):
    acc = make_accelerator(load_config(None, []), tmp_path)
    assert acc.device.type == "cuda"
    assert capsys.readouterr().out.startswith("device: cuda")


def _cli(tmp_path: Path, *sets: str, **env: str) -> subprocess.CompletedProcess:
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run(
        [sys.executable, "-m", "effpretrain", "train", *args, "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(**env),
        timeout=600,
    )


def test_hidden_gpus_refuse_cuda_in_one_line_and_auto_takes_the_cpu_quietly(tmp_path):
    proc = _cli(tmp_path, "train.device=cuda", CUDA_VISIBLE_DEVICES="")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "CUDA_VISIBLE_DEVICES hides every GPU" in lines[0]
    proc = _cli(
        tmp_path,
        "train.max_steps=1",
        "train.eval_every=0",
        "train.eval_tokens=256",
        "data.vocab_size=512",
        "data.seq_len=32",
        "train.batch_size=2",
        "train.plot=false",
        CUDA_VISIBLE_DEVICES="-1,-1",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "device: cpu" in proc.stdout and "NVIDIA driver" not in proc.stderr


WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": torch.cuda.device_count()}, f)
    """
)


def test_cpu_launch_configs_hide_the_gpus_from_their_ranks(tmp_path):
    accelerate = Path(sys.executable).parent / "accelerate"
    assert shutil.which(str(accelerate)), "the accelerate CLI is not installed beside this Python"
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    for config in ("ddp_cpu.yaml", "fsdp2_cpu.yaml"):
        out = tmp_path / config
        out.mkdir()
        cmd = [str(accelerate), "launch", "--config_file", str(ROOT / "recipes/accelerate" / config)]
        cmd += ["--main_process_port", "0", str(worker), str(out)]
        proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for rank in (0, 1):
            seen = json.loads((out / f"rank{rank}.json").read_text())
            assert seen["count"] == 0, (config, rank, seen)

"""Where a run trains (`train.device`, effpretrain/devices.py) and what the tests see: `cuda` without
a working CUDA is refused in one line, `auto` says what it chose and warns when a driver is loaded
but CUDA does not start, the Makefile installs a CUDA build of torch where a driver is loaded
(found without nvidia-smi), and the suite hides every GPU from itself and the ranks it spawns."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _common import ROOT, child_env
from distributed_helpers import run_worker

from effpretrain import devices
from effpretrain.config import load_config
from effpretrain.errors import ConfigError
from effpretrain.launch import make_accelerator

DRIVER = "/proc/driver/nvidia/version"


def _facts(available=False, torch_cuda="12.8", driver=DRIVER, hidden=False, error=None) -> devices.CudaFacts:
    return devices.CudaFacts(
        available=available, torch_cuda=torch_cuda, driver=driver, hidden=hidden, error=error
    )


@pytest.mark.parametrize("rel", devices.DRIVER_FILES)
def test_a_driver_is_found_by_any_of_its_files(rel, tmp_path):
    assert devices.nvidia_driver(str(tmp_path)) is None
    (tmp_path / rel).parent.mkdir(parents=True)
    (tmp_path / rel).touch()
    assert devices.nvidia_driver(str(tmp_path)) == str(tmp_path / rel)


@pytest.mark.parametrize(
    ("value", "hidden"),
    [
        (None, False),
        ("", True),
        ("-1", True),
        ("-1,-1", True),
        ("0", False),
        ("0,1", False),
        ("GPU-5a", False),
    ],
)
def test_cuda_visible_devices_that_hide_every_gpu(value, hidden):
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert devices.gpus_hidden(env) is hidden


def test_the_device_rule():
    working = _facts(available=True)
    assert devices.choose("auto", working) == devices.Choice(False, "train.device=auto")
    assert devices.choose("cuda", working).cpu is False
    assert devices.choose("cpu", working).cpu is True  # forced, even where CUDA works
    # A CPU machine: the CPU, no warning.
    plain = devices.choose("auto", _facts(torch_cuda=None, driver=None))
    assert plain.cpu and plain.warning is None and "this torch is a CPU build" in plain.reason
    # A driver but no working CUDA: the CPU, with one warning line that says why.
    for facts, why in [
        (_facts(torch_cuda=None), "this torch is a CPU build"),
        (_facts(), "CUDA 12.8 does not start with the loaded driver"),
    ]:
        chosen = devices.choose("auto", facts)
        assert chosen.cpu and why in chosen.warning and DRIVER in chosen.warning
        assert "\n" not in chosen.warning
        with pytest.raises(ValueError, match=f"train.device=cuda but CUDA is not available: {why}"):
            devices.choose("cuda", facts)
    # GPUs hidden on purpose (the tests, the *_cpu launch configs): no warning.
    assert devices.choose("auto", _facts(hidden=True)).warning is None


def test_torchs_cuda_initialisation_warning_becomes_the_one_line_reason(monkeypatch):
    """A driver older than torch's CUDA: torch warns over several stderr lines when asked whether
    CUDA is available; the run keeps its text as the reason and lets nothing else through."""
    import warnings

    text = (
        "CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).\n"
        "Please update your GPU driver. (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:109.)"
    )

    def is_available() -> bool:
        warnings.warn(text, UserWarning, stacklevel=1)
        return False

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    with warnings.catch_warnings(record=True) as leaked:
        warnings.simplefilter("always")
        facts = devices.cuda_facts()
    assert not leaked and facts.available is False
    assert facts.error == (
        "CUDA initialization: The NVIDIA driver on your system is too old (found version 11040). "
        "Please update your GPU driver."
    )
    facts = _facts(error=facts.error)
    warning = devices.choose("auto", facts).warning
    assert (
        "CUDA 12.8 does not start: CUDA initialization: The NVIDIA driver" in warning and "\n" not in warning
    )


def test_train_device_cuda_without_cuda_exits_2_in_one_line(tmp_path):
    """The acceptance, as a user types it: on a machine without a working CUDA (here, or any box
    under make test, which hides the GPUs) `effpretrain train --set train.device=cuda` is refused
    before anything is written."""
    proc = subprocess.run(
        [
            *[sys.executable, "-m", "effpretrain", "train"],
            *["--set", "train.device=cuda", "--out", str(tmp_path / "run")],
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=300,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("effpretrain: error: train.device=cuda but CUDA is not available: ")
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_auto_prints_its_device_and_warns_once_when_a_driver_cannot_start_cuda(tmp_path, capsys, caplog):
    cfg = load_config(None, [])
    with caplog.at_level(logging.WARNING, logger="effpretrain"):
        acc = make_accelerator(cfg, tmp_path, facts=_facts())
    assert acc.device.type == "cpu"
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "device: cpu (train.device=auto, no CUDA: CUDA 12.8 does not start with the loaded driver "
        "(older than that CUDA, or no GPU visible))"
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"an NVIDIA driver is loaded ({DRIVER}) but CUDA")
    # eval keeps its stdout for its JSON.
    make_accelerator(cfg, tmp_path, announce=False, facts=_facts(hidden=True))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("setting", "available", "cpu"),
    [("auto", True, False), ("cuda", True, False), ("cpu", True, True), ("auto", False, True)],
)
def test_the_accelerator_is_built_for_the_chosen_device(setting, available, cpu, tmp_path, monkeypatch):
    """Accelerate gets cpu= from `train.device` and the machine's facts (the facts injected: on
    this machine Accelerate falls back to the CPU whatever it is asked)."""
    import accelerate

    asked = []

    class Spy(accelerate.Accelerator):
        def __init__(self, *a, **k):
            asked.append(k["cpu"])
            super().__init__(*a, **k)

    monkeypatch.setattr(accelerate, "Accelerator", Spy)
    cfg = load_config(None, [f"train.device={setting}"])
    try:
        make_accelerator(cfg, tmp_path, facts=_facts(available=available))
    except ConfigError:
        assert setting == "cuda"  # Accelerate placed it on this machine's CPU: refused after the build
    assert asked == [cpu]


def test_cuda_refused_before_and_after_accelerate(tmp_path):
    cfg = load_config(None, ["train.device=cuda"])
    with pytest.raises(ConfigError, match="CUDA is not available: this torch is a CPU build"):
        make_accelerator(cfg, tmp_path, facts=_facts(torch_cuda=None, driver=None))
    # Where CUDA works but Accelerate still places the run on the CPU (ACCELERATE_USE_CPU, or here
    # a machine whose "working CUDA" is injected), the run is refused rather than trained on the CPU.
    with pytest.raises(ConfigError, match="train.device=cuda but Accelerate placed the run on cpu"):
        make_accelerator(cfg, tmp_path, facts=_facts(available=True))


def test_train_device_values_are_checked_by_the_schema():
    assert load_config(None, []).train.device == "auto"
    with pytest.raises(
        ConfigError, match=r"^--set train.device: train.device='gpu' is not one of auto, cuda, cpu$"
    ):
        load_config(None, ["train.device=gpu"])


# -- the Makefile's choice of torch build ---------------------------------------------------------

_STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "$STUB_LOG"
case "$*" in
  *devices.py*) exit "$STUB_DRIVER_RC" ;;
  *torch.version.cuda*) exit "$STUB_CPU_BUILD_RC" ;;
esac
exit 0
"""


@pytest.mark.parametrize(
    ("driver", "cpu_build", "rc", "installed"),
    [
        (False, True, 0, "pip install -q torch==2.13.0"),  # no driver: the CPU build
        (True, False, 0, "pip install -q torch===2.13.0"),  # a driver: a CUDA build, checked
        (True, True, 2, "pip install -q torch===2.13.0"),  # a driver, but a CPU build came: make fails
    ],
)
def test_makefile_installs_the_torch_build_the_driver_calls_for(driver, cpu_build, rc, installed, tmp_path):
    """`make venv` with pip and python replaced by stubs that log their arguments: the driver test
    is effpretrain/devices.py (not nvidia-smi), run isolated (-I) before torch exists."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "pip"):
        (bin_dir / name).write_text(_STUB)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    env = {
        **os.environ,
        "STUB_LOG": str(log),
        "STUB_DRIVER_RC": "0" if driver else "1",
        "STUB_CPU_BUILD_RC": "1" if cpu_build else "0",
        "PATH": "/usr/bin:/bin",  # no nvidia-smi, whatever this machine has
    }
    proc = subprocess.run(
        ["make", "-C", str(ROOT), f"VENV={tmp_path / 'venv'}", "venv"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == rc, proc.stderr
    calls = log.read_text().splitlines()
    assert "python -I effpretrain/devices.py" in calls
    assert installed in calls
    assert ("pip install -q torch==2.13.0" in calls) is not driver
    if rc:
        assert "an NVIDIA driver is loaded but no CUDA build of torch installed" in proc.stderr
    else:  # the project, then the 'lowbit-ref' pin into a folder off the import path
        pin = re.search(r"torchao==[0-9.]+", (ROOT / "pyproject.toml").read_text()).group()
        assert calls[-2:] == [
            "pip install -q -e .[dev]",
            f"pip install -q --no-deps --target {tmp_path / 'venv' / 'lowbit-ref'} {pin}",
        ]


def test_the_driver_script_runs_alone():
    """The Makefile runs devices.py before torch is installed: the standard library only, exit 1
    on this machine exactly when none of the driver files exists."""
    proc = subprocess.run([sys.executable, "-I", str(ROOT / "effpretrain" / "devices.py")], timeout=60)
    assert proc.returncode == (0 if devices.nvidia_driver() else 1)


# -- the suite hides the GPUs --------------------------------------------------------------------


def test_the_test_process_sees_no_gpu():
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    assert torch.cuda.device_count() == 0 and not torch.cuda.is_available()


RANK_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    out = sys.argv[1]
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": torch.cuda.device_count()}, f)
    """
)


@pytest.mark.multiprocess
def test_spawned_ranks_see_no_gpu(tmp_path):
    """Two ranks started with torchrun as the suite starts them (distributed_helpers, child_env)
    read their own environment: no CUDA device is visible, so on a GPU box they do not share cuda:0
    and the CPU-calibrated checks stay on the CPU."""
    run_worker(RANK_WORKER, tmp_path)
    for rank in (0, 1):
        seen = json.loads(Path(tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"visible": "", "count": 0}, (rank, seen)

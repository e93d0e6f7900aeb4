"""Shared by the 2-process tests (test_distributed.py, test_fsdp2.py): the tiny-run overrides and
how final weights are read and compared."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import torch
from _common import ROOT, child_env

# 20 steps of the tiny recipes, a basis refresh every 5 and restarts every 7.
COMMON = [
    "data.seq_len=32",
    "data.vocab_size=512",
    "train.eval_tokens=256",
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


def registry_recipes() -> list[str]:
    """The tiny recipes that cover every registry row (`effpretrain.run_model.registry_recipes`),
    so the parity tests follow the registries instead of a hand-kept list; a new method needs its
    tiny recipe."""
    from effpretrain.run_model import registry_recipes as covering

    return covering(ROOT / "recipes" / "tiny")


def torchrun(nproc: int) -> list[str]:
    """The torchrun command for `nproc` local processes. ``--standalone``: the launcher binds its
    own rendezvous port (port 0) and keeps it, where a port picked by `free_port` and bound later
    can be taken in between by a concurrent test's processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]


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


def run_worker_pair(worker_source: str, out: Path, tail: list[str], nproc: int = 2, one: bool = True) -> None:
    """Writes `worker_source` to out/worker.py and runs it as `nproc` torchrun processes ("two")
    and, at the same time (unless `one` is false), as one plain process ("one"), both with argv
    [repo root, out, mode, *tail] and one thread each; fails the test with the stderr tail of a
    run that did not succeed."""
    root = Path(__file__).resolve().parent.parent
    worker = out / "worker.py"
    worker.write_text(worker_source)
    env = child_env()
    launchers = [(torchrun(nproc), "two")] + ([([sys.executable], "one")] if one else [])
    procs = [
        subprocess.Popen(
            [*launcher, str(worker), str(root), str(out), mode, *tail],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for launcher, mode in launchers
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=1200)
        assert proc.returncode == 0, err[-4000:]


def run_worker(worker_source: str, out: Path, nproc: int = 2, timeout: int = 300) -> None:
    """Writes `worker_source` to out/worker.py and runs it as `nproc` torchrun processes with argv
    [out], one thread each; fails the test with the stderr tail if it did not succeed."""
    worker = out / "worker.py"
    worker.write_text(worker_source)
    proc = subprocess.run(
        [*torchrun(nproc), str(worker), str(out)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def selected(request, argname: str, values: list[str]) -> list[str]:
    """The values of the parameter `argname` that the selected tests using the requesting
    module-scoped fixture ask for (``pytest -k`` or node ids may select a few), in `values`' order;
    all of `values` when a selected test uses the fixture without that parameter. The fixture then
    runs only the cases some selected test reads."""
    asked = set()
    for item in request.session.items:
        if item.path != request.node.path or request.fixturename not in getattr(item, "fixturenames", ()):
            continue
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if argname not in params:
            return list(values)
        asked.add(params[argname])
    return [v for v in values if v in asked] or list(values)

"""A disk that fills during a save, produced for real: the OS refuses the write, no mock.

Two real faults: ``RLIMIT_FSIZE`` (a process may not grow a file past the limit; Python ignores
SIGXFSZ, so the write fails with EFBIG, "File too large"; no root needed) and a small tmpfs that
runs out of space (ENOSPC, "No space left on device"; mounting needs root, the variant is skipped
where it is not permitted). The limit is sized from the checkpoint's own files, measured on a
straight run, so that it is exactly the wanted file of the wanted save that fails: the run saves at
steps 2, 4 and 6, the limit comes down once step 2's checkpoint is committed (a logging handler in
the wrapper below sees the trainer's "saved checkpoint" line), and it lies between the sizes of the
checkpoint's files, which a small model orders model < optimizer < trainer state (the builtin
corpus's data position in trainer.pt is ~2 MB). Each run must end with exit code 4, one error line
naming the checkpoint, the cause and the newest complete checkpoint, at most 3 lines on stderr and
no traceback, no partial folder; ``--resume auto`` once space is back must end bitwise equal to
the straight run (it runs the same operations from the same state) and really resume: its first
logged step is the newest complete checkpoint's step + 1, with the straight run's loss there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _common import ROOT, child_env
from distributed_helpers import free_port, torchrun

from effpretrain.checkpoint import CheckpointWriteError, commit, read_model_state, save_checkpoint
from effpretrain.models.llama import ModelShape

RECIPE = ROOT / "recipes" / "tiny" / "adamw.yaml"
VOCAB = 512
#: The run: saves at steps 2, 4 and 6; step 4's save is the one that fails.
OVER = [
    "data.seq_len=32",
    f"data.vocab_size={VOCAB}",
    "train.eval_tokens=256",
    "train.log_every=1",
    "train.plot=false",
    "train.max_steps=6",
    "train.save_every=2",
    "train.eval_every=0",
]
WHOLE = ["train.batch_size=4"]
SHARDED = ["train.batch_size=2", "dist.sharding=fsdp2"]
GOOD, FAILED = 2, 4

#: Runs `effpretrain.cli.main(argv[3:])` and lowers this process's RLIMIT_FSIZE to argv[1] bytes
#: once the checkpoint folder named argv[2] is committed (the trainer logs "saved checkpoint
#: <folder>" then, on rank 0 only): the OS then refuses any write that grows a file past it.
WRAPPER = textwrap.dedent(
    """
    import logging, resource, sys

    limit, after = int(sys.argv[1]), sys.argv[2]

    class LimitAfterSave(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("saved checkpoint") and msg.endswith(after):
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    logging.getLogger("effpretrain").addHandler(LimitAfterSave())
    from effpretrain.cli import main

    sys.exit(main(sys.argv[3:]))
    """
)


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _train_args(out: Path, overrides: list[str]) -> list[str]:
    return ["train", str(RECIPE), "--out", str(out), *_sets(overrides)]


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, env=env or child_env(), capture_output=True, text=True, timeout=600, check=False
    )


def _cli(out: Path, overrides: list[str], *extra: str) -> subprocess.CompletedProcess:
    """`python -m effpretrain train` as a user types it (one process)."""
    return _run([sys.executable, "-m", "effpretrain", *_train_args(out, overrides), *extra])


def _plain_env() -> dict[str, str]:
    env = child_env()
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _torchrun(out: Path, overrides: list[str], *extra: str) -> subprocess.CompletedProcess:
    cmd = [*torchrun(2), "-m", "effpretrain", *_train_args(out, overrides), *extra]
    return _run(cmd, _plain_env())


def _checkpoint_files(run: Path, step: int) -> dict[str, int]:
    folder = run / "checkpoints" / f"step-{step}"
    return {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}


def _small_model(folder: Path) -> Path:
    """A 2-layer, 64-wide LLaMA config: its weights (0.6 MB) and AdamW state (1.2 MB) are smaller
    than trainer.pt (2 MB), so a file size limit can fall in each of the three files."""
    shape = ModelShape(hidden=64, intermediate=160, heads=4, layers=2, kv_heads=2)
    shape.hf_config(VOCAB, 128).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> str:
    return f"model.config={_small_model(tmp_path_factory.mktemp('model'))}"


@pytest.fixture(scope="module")
def straight_whole(tmp_path_factory, model_config) -> tuple[Path, list[str]]:
    """The uninterrupted one-process run the failed-and-resumed ones must end equal to."""
    over = [model_config, *OVER, *WHOLE]
    out = tmp_path_factory.mktemp("straight-whole") / "run"
    res = _cli(out, over)
    assert res.returncode == 0, res.stderr[-3000:]
    sizes = _checkpoint_files(out, FAILED)
    order = [sizes["model.safetensors"], sizes["optimizer.pt"], sizes["trainer.pt"]]
    assert order == sorted(order), f"the limits below need model < optimizer < trainer state: {sizes}"
    return out, over


@pytest.fixture(scope="module")
def straight_sharded(tmp_path_factory, model_config) -> tuple[Path, list[str]]:
    """The uninterrupted run of two FSDP2 processes (gloo, torchrun)."""
    over = [model_config, *OVER, *SHARDED]
    out = tmp_path_factory.mktemp("straight-sharded") / "run"
    res = _torchrun(out, over)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, over


def _step_records(run: Path, skip: int = 0) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()[skip:]
    return [r for r in map(json.loads, lines) if "event" not in r and "loss" in r]


def _assert_failed_in_one_line(res_stderr: str, code: int, run: Path, cause: str) -> None:
    """Exit code 4, at most 3 lines on stderr, no traceback, the one error line naming the failed
    checkpoint, the cause and the newest complete one; no partial folder, final or temporary."""
    ckpts = run / "checkpoints"
    lines = res_stderr.splitlines()  # a progress bar's carriage-return redraws would count too
    assert code == CheckpointWriteError.EXIT_CODE == 4, res_stderr[-3000:]
    assert "Traceback" not in res_stderr and len(lines) <= 3, res_stderr[-3000:]
    errors = [ln for ln in lines if ln.startswith("effpretrain: error:")]
    assert len(errors) == 1, res_stderr[-3000:]
    assert f"could not write checkpoint {ckpts / f'step-{FAILED}'} ({cause})" in errors[0], errors[0]
    assert f"the newest complete checkpoint is {ckpts / f'step-{GOOD}'}" in errors[0], errors[0]
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-{GOOD}"]  # no step-4, no step-4.tmp-*


def _assert_resumes_exactly(run: Path, straight: Path, resumed: subprocess.CompletedProcess, skip: int):
    """The resumed run finished, started at step GOOD + 1 with the straight run's loss there, and
    ends with the straight run's weights bit for bit."""
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first = _step_records(run, skip)[0]
    ref = {r["step"]: r["loss"] for r in _step_records(straight)}
    assert first["step"] == GOOD + 1
    assert first["loss"] == ref[GOOD + 1]
    mine, theirs = (read_model_state(r / "checkpoints" / "step-6") for r in (run, straight))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


#: Where the limit falls, from the straight run's step-4 files: inside the named file, above every
#: file written before it in the checkpoint (model.safetensors, optimizer.pt, trainer.pt, ...).
LIMITS = {
    "model.safetensors": lambda s: s["model.safetensors"] // 2,
    "optimizer.pt": lambda s: (s["model.safetensors"] + s["optimizer.pt"]) // 2,
    "trainer.pt": lambda s: (s["optimizer.pt"] + s["trainer.pt"]) // 2,
}


@pytest.mark.parametrize(
    "file",
    # optimizer.pt (torch.save's zip writer, the user's case) is the fast tier's failing write.
    [pytest.param(f, marks=[pytest.mark.fast] if f == "optimizer.pt" else []) for f in LIMITS],
)
@pytest.mark.run
def test_a_file_size_limit_hit_in_each_checkpoint_file_stops_in_one_line_and_resume_is_exact(
    file, straight_whole, tmp_path
):
    straight, over = straight_whole
    limit = LIMITS[file](_checkpoint_files(straight, FAILED))
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    run = tmp_path / "run"
    wrapper = [sys.executable, str(tmp_path / "wrapper.py"), str(limit), f"step-{GOOD}"]
    res = _run([*wrapper, *_train_args(run, over)])
    _assert_failed_in_one_line(res.stderr, res.returncode, run, "File too large")
    skip = len((run / "metrics.jsonl").read_text().splitlines())
    _assert_resumes_exactly(run, straight, _cli(run, over, "--resume", "auto"), skip)


class _Tmpfs:
    """A tmpfs of `size` bytes mounted on `path` for a `with` block, always unmounted after; the
    test is skipped where mounting is not permitted (not root, no mount in the container)."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size

    def __enter__(self) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root (the RLIMIT_FSIZE tests cover the same code)")
        self.path.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if res.returncode != 0:
            pytest.skip(f"mounting a tmpfs is not permitted here: {res.stderr.strip()}")
        return self.path

    def __exit__(self, *exc) -> None:
        if subprocess.run(["umount", str(self.path)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(path: Path, leave: int) -> Path:
    """A file that takes all of `path`'s file system's free space but `leave` bytes."""
    filler = path / "filler"
    with open(filler, "wb") as fh:
        chunk = b"\0" * (1 << 20)
        todo = _free(path) - leave
        while todo > 0:
            todo -= fh.write(chunk[: min(todo, len(chunk))])
    return filler


PAGE = 4096


def _pages(size: int) -> int:
    """The bytes a tmpfs charges for a file of `size` bytes (whole pages; it never compresses)."""
    return -(-size // PAGE) * PAGE


@pytest.mark.run
def test_a_160_mb_tmpfs_that_fills_during_a_save_stops_in_one_line_and_resume_is_exact(
    straight_whole, tmp_path
):
    """The user's case: the run folder is a 160 MB tmpfs, and it fills while step 4's optimizer.pt
    is written (torch.save's zip writer, whose error was a 46-line RuntimeError traceback)."""
    straight, over = straight_whole
    sizes = _checkpoint_files(straight, FAILED)
    # What the run holds on disk when step 4's save starts: its step-2 checkpoint (as large as the
    # straight run's step-4 one, the one kept), config.yaml and four steps of metrics (a page each).
    before = sum(map(_pages, sizes.values())) + 3 * PAGE
    # ... then the save gets model.safetensors and half of optimizer.pt onto the disk.
    room = before + sizes["model.safetensors"] + sizes["optimizer.pt"] // 2
    with _Tmpfs(tmp_path / "mnt", 160 * 2**20) as mnt:
        filler = _fill(mnt, room)
        run = mnt / "run"
        res = _cli(run, over)
        _assert_failed_in_one_line(res.stderr, res.returncode, run, "No space left on device")
        skip = len((run / "metrics.jsonl").read_text().splitlines())
        filler.unlink()  # space is back
        _assert_resumes_exactly(run, straight, _cli(run, over, "--resume", "auto"), skip)


def _inside_the_largest_tensor(dcp_folder: Path, file: str) -> int:
    """An offset in the middle of the largest tensor that DCP wrote into `file` (one ``torch.save``
    per tensor; where it lies is in the folder's ``.metadata``)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(dcp_folder)).read_metadata()
    at = max((s.length, s.offset) for s in meta.storage_data.values() if s.relative_path == file)
    return at[1] + at[0] // 2


@pytest.mark.multiprocess
def test_a_file_size_limit_hit_in_a_sharded_save_stops_every_rank_in_one_line(straight_sharded, tmp_path):
    """Two FSDP2 processes: rank 0's limit falls inside its DCP shard (dcp/__0_0.distcp) of the
    step-4 checkpoint, in the middle of its largest tensor (as the bytes of a real model's shard
    mostly are: written in one piece, they leave torch's zip writer to fail with its RuntimeError
    over the OSError, not the file's close); rank 1 writes its own shard fine. Both ranks end with
    the same line naming rank 0's cause (it reaches rank 1 through DCP's exception, pickled: the
    errno must survive) and exit code 4. The ranks are started as torchrun starts them (its
    environment) but without its agent, which stops the other rank as soon as one exits and so
    hides that rank's exit code."""
    straight, over = straight_sharded
    limit = _inside_the_largest_tensor(straight / "checkpoints" / f"step-{FAILED}" / "dcp", "__0_0.distcp")
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    run = tmp_path / "run"
    argv = [sys.executable, str(tmp_path / "wrapper.py"), str(limit), f"step-{GOOD}"]
    argv += _train_args(run, over)
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            argv,
            env={
                **_plain_env(),
                **dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"),
                **dict(RANK=str(r), LOCAL_RANK=str(r)),
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    errs = [p.communicate(timeout=600)[1] for p in ranks]
    for p, err in zip(ranks, errs):
        _assert_failed_in_one_line(err, p.returncode, run, "File too large")
    assert errs[0].splitlines()[-1] == errs[1].splitlines()[-1]
    skip = len((run / "metrics.jsonl").read_text().splitlines())
    _assert_resumes_exactly(run, straight, _torchrun(run, over, "--resume", "auto"), skip)


# -- every file of a checkpoint, in one process: save_checkpoint on a tmpfs that is full ----------

FILES = ["model.safetensors", "optimizer.pt", "trainer.pt", "config.yaml", "COMPLETE"]


def _states() -> dict:
    """A checkpoint's parts, each a few pages on disk."""
    g = torch.Generator().manual_seed(0)
    return dict(
        model_state={"w": torch.randn(4096, generator=g)},
        optimizer_state={"state": {0: {"exp_avg": torch.randn(6000, generator=g)}}, "param_groups": []},
        trainer_state={"step": 3, "rng": torch.randn(3000, generator=g)},
        config_yaml="x: 1\n" * 3000,
    )


@pytest.mark.parametrize("file", FILES)
def test_save_checkpoint_on_a_full_tmpfs_raises_enospc_in_each_file_and_leaves_nothing(file, tmp_path):
    """The disk fills in `file` (sized from a save to a plain folder: room for every file written
    before it, half of `file` or, for the one-page marker, nothing): the write raises the OS's
    error, whichever library wrote the file, and the temporary folder is gone."""
    ref = save_checkpoint(tmp_path / "ref", 3, **_states())
    used = {f: _pages((ref / f).stat().st_size) for f in FILES}
    # FILES is the order _write_files writes them in
    room = sum(used[f] for f in FILES[: FILES.index(file)]) + used[file] // 2 // PAGE * PAGE
    with _Tmpfs(tmp_path / "mnt", 2**20) as mnt:
        root = mnt / "checkpoints"
        root.mkdir()
        _fill(mnt, room)
        with pytest.raises(OSError) as err:
            save_checkpoint(root, 3, **_states())
        assert err.value.errno == 28 and commit.write_error_cause(err.value) == "No space left on device"
        assert Path(err.value.filename).name == file  # the file the disk filled in
        assert list(root.iterdir()) == []

"""The atomic commit protocol of a checkpoint folder ``checkpoints/step-N/``.

Everything is written into ``step-N.tmp-<pid>/`` and renamed into place only when complete (the
``COMPLETE`` marker, listing the files, is written last and every file is synced first), so a
crash mid-save leaves the previous checkpoints untouched; a write that fails (no space left, an
I/O error) removes its temporary folder and raises, and the trainer turns that into
`CheckpointWriteError`. Old checkpoints beyond ``keep`` and stale temporary folders are pruned.

A failed write surfaces as an `OSError` with its errno, whichever library wrote the file: the
libraries do not all raise one. ``torch.save`` to a path writes through C++ streams that lose the
errno (``basic_ios::clear: iostream error``), so every ``.pt`` file is written through a Python file
object opened here; its write raises the OSError, and torch's zip writer, closing the archive while
that error propagates, raises ``RuntimeError("[enforce fail at inline_container.cc] ... unexpected
pos ...")`` over it, with the OSError as its ``__context__`` (`os_error_of` finds it there).
safetensors (Rust) raises its own error type whose message ends in Rust's ``(os error N)``.
torch.distributed.checkpoint writes with ``torch.save`` into Python files too, but sends each
rank's failure to every rank pickled, which drops ``__context__``: its writer
(`effpretrain.checkpoint.sharded`) turns the failure into the OSError on the rank that hit it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from effpretrain.checkpoint.weights import without_aliases

MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d+)$")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (no space left on the device, a file size limit, an I/O
    error). The run stops: `effpretrain train` reports it in one line and exits with `EXIT_CODE`;
    the partial folder is removed and the earlier checkpoints stay complete, so ``--resume auto``
    continues from the newest of them once the cause is fixed."""

    #: `effpretrain train`'s exit code for a checkpoint that could not be written.
    EXIT_CODE = 4

    def __init__(self, target: Path, cause: str, newest: Path | None):
        self.target, self.cause, self.newest = target, cause, newest
        newest_text = (
            f"the newest complete checkpoint is {newest}" if newest else "no complete checkpoint exists"
        )
        super().__init__(
            f"could not write checkpoint {target} ({cause}); {newest_text}; "
            "fix the cause and continue with --resume auto"
        )


def unwrap_dcp(err: BaseException) -> BaseException:
    """The first failing rank's own exception inside torch.distributed.checkpoint's wrapper (a
    ``CheckpointException`` with ``failures``), else `err` itself."""
    failures = getattr(err, "failures", None)
    if failures:
        wrapped = next(iter(failures.values()))
        return wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return err


#: How Rust's ``std::io::Error`` names an errno in its message (safetensors' errors carry it so).
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_error_of(err: BaseException) -> OSError | None:
    """The OS's error behind `err`, with its errno: `err` itself, an OSError in its chain of causes
    and contexts (torch's zip writer raises a RuntimeError over the file's OSError), or one named in
    its message as Rust words it (safetensors: ``... File too large (os error 27)``); None when
    there is none (not a failed write: a bug, which keeps its traceback)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e
        todo += [e.__cause__, e.__context__]
    m = _RUST_OS_ERROR.search(str(err))
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code))
    return None


def write_error_cause(err: BaseException) -> str:
    """One line naming why a write failed: the OS's words for its errno (``No space left on
    device``, ``File too large``), else the error's first line; through DCP's wrapper to the
    first failing rank's error."""
    err = unwrap_dcp(err)
    os_err = os_error_of(err)
    if os_err is not None:
        return os.strerror(os_err.errno)
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


def save_torch(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` into `path` through a Python file object, so that a failed write raises
    the OS's error (an OSError with its errno) rather than torch's zip writer's RuntimeError."""
    with open(path, "wb") as fh:
        try:
            torch.save(obj, fh)
        except RuntimeError as e:
            os_err = os_error_of(e)
            if os_err is None:
                raise
            raise OSError(os_err.errno, os.strerror(os_err.errno), str(path)) from e


def _write_text(path: Path, text: str) -> None:
    """``path.write_text(text)``; a failed write's OSError names `path` (a write's own does not)."""
    try:
        path.write_text(text)
    except OSError as e:
        if e.filename is not None or not e.errno:
            raise
        raise OSError(e.errno, os.strerror(e.errno), str(path)) from e


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file``, its failed write raised as the OS's error (an OSError)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        os_err = os_error_of(e)
        if os_err is None:
            raise
        raise OSError(os_err.errno, os.strerror(os_err.errno), str(path)) from e


def discard_temp(ckpt_root: Path, step: int, pid: int | None = None) -> None:
    """Removes a checkpoint's temporary folder (this process's, or `pid`'s) after a failed write."""
    shutil.rmtree(ckpt_root / f"step-{step}.tmp-{pid or os.getpid()}", ignore_errors=True)


def temp_folder(ckpt_root: Path, step: int) -> Path:
    """A fresh, empty temporary folder for checkpoint `step` (named after this process)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f"step-{step}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    *,
    trainer_state: dict[str, Any],
    config_yaml: str,
    model_state: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict[str, Any] | None = None,
    keep: int = 2,
    tmp: Path | None = None,
) -> Path:
    """Writes checkpoint `step` atomically and prunes old ones, keeping the newest `keep` complete.

    With `tmp` (a `temp_folder` that other ranks already wrote a ``dcp/`` sharded state into),
    `model_state` and `optimizer_state` are left out and only the remaining files are added before
    the folder is committed. A failed write removes the temporary folder and re-raises.
    """
    final = ckpt_root / f"step-{step}"
    if tmp is None:
        tmp = temp_folder(ckpt_root, step)
    try:
        _write_files(tmp, step, trainer_state, config_yaml, model_state, optimizer_state)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # no partial folder is left behind
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_root)
    prune(ckpt_root, keep)
    return final


def _write_files(
    tmp: Path,
    step: int,
    trainer_state: dict[str, Any],
    config_yaml: str,
    model_state: dict[str, torch.Tensor] | None,
    optimizer_state: dict[str, Any] | None,
) -> None:
    """A checkpoint's files into `tmp`, synced, the completion marker last; a failed write raises
    an OSError (module docstring)."""
    if model_state is not None:
        # safetensors refuses shared or non-contiguous storage: a tied matrix is stored once (under
        # its first key; loading ties it again), the rest made contiguous.
        tensors = {k: v.detach().contiguous().cpu() for k, v in without_aliases(model_state).items()}
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"step": str(step)})
    if optimizer_state is not None:
        save_torch(optimizer_state, tmp / "optimizer.pt")
    save_torch(trainer_state, tmp / "trainer.pt")
    _write_text(tmp / "config.yaml", config_yaml)
    for f in tmp.iterdir():
        if f.is_file():  # dcp/ was synced by its writer (FileSystemWriter(sync_files=True))
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _write_text(tmp / MARKER, json.dumps({"step": step, "files": sorted(p.name for p in tmp.iterdir())}))
    _fsync_dir(tmp)


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Checkpoint folders that carry the completion marker, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / MARKER).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def prune(ckpt_root: Path, keep: int) -> None:
    """Deletes all but the newest `keep` complete checkpoints and stale temporary folders."""
    done = complete_checkpoints(ckpt_root)
    for p in done[: max(0, len(done) - max(keep, 1))]:
        shutil.rmtree(p, ignore_errors=True)
    for p in ckpt_root.iterdir():
        if ".tmp-" in p.name and p.is_dir():
            pid = p.name.rsplit("-", 1)[-1]
            if pid != str(os.getpid()):
                shutil.rmtree(p, ignore_errors=True)

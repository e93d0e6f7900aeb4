"""Complete, atomic, weights_only-safe checkpoints.

A checkpoint is a folder ``checkpoints/step-N/`` holding:

- ``model.safetensors``: the model's state_dict (parameters and persistent buffers);
- ``optimizer.pt``: the optimizer's state_dict (tensors and plain numbers only);
- or, for FSDP2 runs, instead of those two: ``dcp/``, the model's and optimizer's tensors written
  shard by shard by every rank with torch.distributed.checkpoint (effpretrain/fsdp.py), the
  optimizer's non-tensor part being kept in ``trainer.pt``;
- ``trainer.pt``: step, tokens, data-stream position (for a streamed source every rank's, gathered
  as ``data.ranks``), scheduler state, RNG states, event counters;
- ``config.yaml``: the resolved config;
- ``COMPLETE``: written last; a folder without it does not count.

Everything is written into ``step-N.tmp-<pid>/`` and renamed into place only when complete, so a
crash mid-save leaves the previous checkpoints untouched. Loading uses safetensors for the model
and ``torch.load(weights_only=True)`` for the rest: a file holding an arbitrary pickled object is
refused. In a sharded ``dcp/`` folder, DCP reads tensors with ``weights_only=True`` but its
``.metadata`` with plain pickle, so that file is first checked against an allow-list of DCP's
metadata classes, and entries that are not tensors (which DCP would unpickle freely) are refused.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from effpretrain.errors import ConfigError

log = logging.getLogger("effpretrain")
MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


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
    """A checkpoint could not be written (no space left on the device, an I/O error). The run
    stops: `effpretrain train` reports it in one line and exits with `EXIT_CODE`; the partial
    folder is removed and the earlier checkpoints stay complete, so ``--resume auto`` continues
    from the newest of them once the cause is fixed."""

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


def write_error_cause(err: BaseException) -> str:
    """One line naming why a write failed: the OS's words for an errno (``No space left on
    device``), else the error's first line; through DCP's wrapper to the failing rank's error."""
    err = unwrap_dcp(err)
    errno = getattr(err, "errno", None)
    if errno:
        return os.strerror(errno)
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


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
    """A checkpoint's files into `tmp`, synced, the completion marker last."""
    from safetensors.torch import save_file

    if model_state is not None:
        # safetensors refuses shared or non-contiguous storage; clone what needs it.
        tensors = {k: v.detach().contiguous().cpu() for k, v in model_state.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"step": str(step)})
    if optimizer_state is not None:
        torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save(trainer_state, tmp / "trainer.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    for f in tmp.iterdir():
        if f.is_file():  # dcp/ was synced by its writer (FileSystemWriter(sync_files=True))
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    (tmp / MARKER).write_text(json.dumps({"step": step, "files": sorted(p.name for p in tmp.iterdir())}))
    _fsync_dir(tmp)


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Checkpoint folders that carry the completion marker, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.iterdir():
        m = _STEP_DIR.match(p.name)
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


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Loads one checkpoint folder; ConfigError (bad input) if it is incomplete or unsafe."""
    from safetensors.torch import load_file

    if not (path / MARKER).is_file():
        raise ConfigError(f"checkpoint {path} is incomplete (no {MARKER} marker)")
    out: dict[str, Any] = {"path": path, "sharded": (path / "dcp").is_dir()}
    if out["sharded"]:
        # FSDP2: tensors are read by the trainer's ranks (fsdp.load_sharded) or `read_model_state`.
        _check_dcp_metadata(path)
        out["model"] = out["optimizer"] = None
        names = ("trainer",)
    else:
        try:
            out["model"] = load_file(str(path / "model.safetensors"))
        except Exception as e:
            raise ConfigError(
                f"checkpoint {path}: model.safetensors unreadable ({type(e).__name__})"
            ) from None
        names = ("optimizer", "trainer")
    for name in names:
        f = path / f"{name}.pt"
        try:
            out[name] = torch.load(f, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ConfigError(f"checkpoint {path}: {f.name} is missing") from None
        except Exception as e:
            # weights_only refuses arbitrary pickled objects; truncated files fail to unpickle.
            msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            raise ConfigError(f"checkpoint {path}: {f.name} refused or corrupt ({msg})") from None
    return out


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only the classes DCP metadata is made of.

    torch.distributed.checkpoint reads ``.metadata`` with a plain ``pickle.load``, which runs
    whatever a crafted file names; checkpoints here are meant to be safe to load, so the file is
    first read with this allow-list and refused if it references anything else.
    """

    def find_class(self, module: str, name: str) -> Any:
        import pathlib

        obj = super().find_class(module, name)
        allowed = (
            (module == "torch.distributed.checkpoint.metadata" and isinstance(obj, type))
            or (
                module == "torch.distributed.checkpoint.filesystem"
                and name in ("_StorageInfo", "_StoragePrefix")
            )
            or (module == "torch" and (name == "Size" or isinstance(obj, (torch.dtype, torch.layout))))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and isinstance(obj, type) and issubclass(obj, pathlib.PurePath))
            or (module == "collections" and name == "OrderedDict")
            or (module == "builtins" and name in ("set", "frozenset", "dict", "list", "tuple"))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")
        return obj


def _check_dcp_metadata(path: Path) -> None:
    """ConfigError unless ``dcp/.metadata`` exists and holds only DCP metadata classes."""
    meta = path / "dcp" / ".metadata"
    if not meta.is_file():
        raise ConfigError(f"checkpoint {path}: dcp/.metadata is missing")
    try:
        with open(meta, "rb") as fh:
            md = _MetadataUnpickler(fh).load()
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        # Only tensors are ever written; DCP would read a non-tensor entry with a full unpickler.
        for key, entry in md.state_dict_metadata.items():
            if not isinstance(entry, TensorStorageMetadata):
                raise pickle.UnpicklingError(f"entry {key!r} is not a tensor")
    except Exception as e:
        msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise ConfigError(f"checkpoint {path}: dcp/.metadata refused or corrupt ({msg})") from None


def read_model_state(path: Path, state: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The whole model state dict of checkpoint folder `path`, in this process, on CPU, whichever
    way it was written (safetensors, or FSDP2's sharded dcp/); ConfigError if unreadable.

    `state`: the folder's `load_checkpoint` result when the caller already has it (not read again).
    """
    state = state if state is not None else load_checkpoint(path)
    if not state["sharded"]:
        return state["model"]
    from torch.distributed.checkpoint.api import CheckpointException

    from effpretrain import fsdp

    try:
        return fsdp.read_model_state(path / "dcp")
    except (Exception, CheckpointException) as e:  # DCP's wrapper is a BaseException
        raise ConfigError(f"checkpoint {path}: dcp/ unreadable ({fsdp.dcp_error(e)})") from None


def load_model_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str | Path) -> None:
    """Loads a checkpoint's model state dict into `model`, requiring an exact match.

    Every parameter and persistent buffer of `model` must be in `weights` with its shape, and
    nothing else may be, except the model's non-persistent buffers (rotary ``inv_freq``), which
    are rebuilt rather than loaded. Otherwise a one-line ConfigError naming `source` (the
    checkpoint) and the first offending keys.
    """
    non_persistent = {
        f"{name}.{b}" if name else b
        for name, m in model.named_modules()
        for b in m._non_persistent_buffers_set
    }
    try:
        missing, unexpected = model.load_state_dict(
            {k: v for k, v in weights.items() if k not in non_persistent}, strict=False
        )
    except RuntimeError as e:  # a shape mismatch: torch lists each one on its own line
        detail = next((ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()), type(e).__name__)
        raise ConfigError(f"checkpoint {source} does not match the model ({detail[:200]})") from None
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint {source} does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )


def resolve_checkpoint(path: str | Path, what: str = "--resume") -> Path:
    """A complete checkpoint folder from `path`: the folder itself, or a run directory's newest
    loadable checkpoint. ConfigError (starting with `what`, the argument being resolved) if `path`
    does not exist, holds no complete checkpoint, or is not a complete checkpoint folder."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{what}: {path} does not exist")
    if (p / "checkpoints").is_dir():
        found = find_resume(p, "auto")
        if found is None:
            raise ConfigError(f"{what}: {path} holds no complete checkpoint")
        return found
    if not (p / MARKER).is_file():
        raise ConfigError(f"{what}: {path} is not a complete checkpoint folder")
    return p


def find_resume(run_dir: Path, resume: str) -> Path | None:
    """Resolves --resume: `auto` = newest loadable checkpoint of run_dir (None if there is none),
    else a path to a checkpoint folder or to a run directory (`resolve_checkpoint`)."""
    if resume != "auto":
        return resolve_checkpoint(resume, "--resume")
    root = run_dir / "checkpoints"
    for p in reversed(complete_checkpoints(root)):
        try:
            load_checkpoint(p)
            return p
        except ConfigError as e:
            log.warning("skipping checkpoint %s: %s", p.name, e)
    if root.is_dir() and any(_STEP_DIR.match(p.name) for p in root.iterdir()):
        # Starting over would silently discard a run: refuse instead.
        raise ConfigError(f"{root}: checkpoints exist but none is complete and loadable")
    return None

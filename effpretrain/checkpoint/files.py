"""Reading checkpoints: complete, and safe to load.

Loading uses safetensors for the model and ``torch.load(weights_only=True)`` for the rest: a file
holding an arbitrary pickled object is refused. In a sharded ``dcp/`` folder, DCP reads tensors with
``weights_only=True`` but its ``.metadata`` with plain pickle, so that file is first checked against
an allow-list of DCP's metadata classes, and entries that are not tensors (which DCP would unpickle
freely) are refused. Every problem is a one-line `ConfigError` naming the checkpoint.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import torch

from effpretrain.checkpoint.commit import MARKER, STEP_DIR, complete_checkpoints
from effpretrain.checkpoint.sharded import dcp_error
from effpretrain.checkpoint.sharded import read_model_state as read_sharded_model_state
from effpretrain.errors import ConfigError

log = logging.getLogger("effpretrain")


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

    try:
        return read_sharded_model_state(path / "dcp")
    except (Exception, CheckpointException) as e:  # DCP's wrapper is a BaseException
        raise ConfigError(f"checkpoint {path}: dcp/ unreadable ({dcp_error(e)})") from None


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
    if root.is_dir() and any(STEP_DIR.match(p.name) for p in root.iterdir()):
        # Starting over would silently discard a run: refuse instead.
        raise ConfigError(f"{root}: checkpoints exist but none is complete and loadable")
    return None

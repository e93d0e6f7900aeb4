"""A run's checkpoint as named stateful parts, saved together and restored together.

The trainer hands `Checkpointer` its parts by name (as torchtitan's ``states={...}``): the model
and the optimizer, which the launch mode's format writes (`WholeFormat`: rank 0 writes
``model.safetensors`` and ``optimizer.pt``; `ShardedFormat`: every rank writes its shards with DCP),
and every other part (progress, data position, scheduler, RNG, the in-backward engine, the run's
facts), whose state goes into ``trainer.pt`` under the part's name, or at its top level for the
parts listed in `FLAT` (``trainer.pt``'s keys are the same as before parts had names). A part is any
object with ``state_dict()`` and ``load_state_dict(state)``; a part that needs the checkpoint's path
for its errors takes it as ``load_state_dict(state, path)`` (`PathAware`). Restoring runs the
``run`` part first (its checks refuse a checkpoint this run cannot continue, before anything is
loaded), then the model and optimizer, then the other parts in the order given.

A write that fails on any rank (no space left, an I/O error) raises `CheckpointWriteError` on
every rank, with the partial folder removed (`effpretrain.checkpoint.commit`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from effpretrain.checkpoint import commit, files, sharded, weights
from effpretrain.errors import ConfigError

log = logging.getLogger("effpretrain")

#: Parts whose state dict's keys sit at the top level of trainer.pt.
FLAT = ("progress", "run", "rng")


class PathAware:
    """Marks a part whose ``load_state_dict`` takes the checkpoint's path (for one-line errors)."""


class WholeFormat:
    """Rank 0 writes the whole model (safetensors) and optimizer (``torch.save``) and commits."""

    def __init__(self, launch: Any):
        self.launch = launch

    def write(
        self, root: Path, step: int, model: Any, opt: Any, trainer_state: dict, config_yaml: str, keep: int
    ):
        if not self.launch.is_main:
            return None
        return commit.save_checkpoint(
            root,
            step,
            model_state=self.launch.unwrap(model).state_dict(),
            optimizer_state=opt.state_dict(),
            trainer_state=trainer_state,
            config_yaml=config_yaml,
            keep=keep,
        )

    def read(self, path: Path, state: dict[str, Any], model: Any, opt: Any) -> None:
        weights.load_model_weights(self.launch.unwrap(model), state["model"], path)
        try:
            opt.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise ConfigError(
                f"checkpoint {path}: optimizer state does not match ({e})".splitlines()[0]
            ) from None


class ShardedFormat:
    """Every rank writes its own shards into rank 0's temporary folder (DCP); rank 0 then adds
    ``trainer.pt`` (with the optimizer's non-tensor skeleton) and commits the folder."""

    def __init__(self, launch: Any):
        self.launch = launch

    def write(
        self, root: Path, step: int, model: Any, opt: Any, trainer_state: dict, config_yaml: str, keep: int
    ):
        import torch.distributed as dist

        shared = [str(commit.temp_folder(root, step)) if self.launch.is_main else None]
        dist.broadcast_object_list(shared, src=0)  # rank 0's temporary folder, for every rank
        tmp = Path(shared[0])
        trainer_state["optimizer_skeleton"] = sharded.save_sharded(tmp / "dcp", model, opt)
        self.launch.barrier()
        if not self.launch.is_main:
            return None
        return commit.save_checkpoint(
            root, step, trainer_state=trainer_state, config_yaml=config_yaml, keep=keep, tmp=tmp
        )

    def read(self, path: Path, state: dict[str, Any], model: Any, opt: Any) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        # Each rank reads its own shards of the model and of the sharded optimizer state.
        try:
            sharded.load_sharded(
                path / "dcp", self.launch.unwrap(model), opt, state["trainer"]["optimizer_skeleton"]
            )
        except ConfigError:
            raise  # already one line naming the checkpoint (the weight loader's check)
        except (ValueError, KeyError, RuntimeError, CheckpointException) as e:
            # (CheckpointException is a BaseException: DCP's wrapper of any rank's read error.)
            raise ConfigError(
                f"checkpoint {path}: sharded state unreadable or does not match ({sharded.dcp_error(e)})"
            ) from None


class Checkpointer:
    """Saves and restores a run's named parts (module docstring).

    Args:
        root: the run's ``checkpoints/`` folder.
        launch: the run's launch mode (`effpretrain.launch`): its format, ranks and gathers.
        parts: the parts other than the model and the optimizer, by name, in restore order.
        model: returns the model as the loop holds it now (a warm start may wrap it again).
        opt: the optimizer below Accelerate's wrapper.
        config_yaml: returns the resolved config, written beside the state.
        keep: the newest complete checkpoints kept.
    """

    def __init__(
        self,
        root: Path,
        launch: Any,
        parts: dict[str, Any],
        model: Callable[[], Any],
        opt: torch.optim.Optimizer,
        config_yaml: Callable[[], str],
        keep: int,
    ):
        self.root, self.launch, self.parts = root, launch, parts
        self.model, self.opt, self.config_yaml, self.keep = model, opt, config_yaml, keep

    def trainer_state(self) -> dict[str, Any]:
        """Every part's state, for trainer.pt (a collective: a part may gather over the ranks)."""
        out: dict[str, Any] = {}
        for name, part in self.parts.items():
            sd = part.state_dict()
            if name in FLAT:
                out.update(sd)
            else:
                out[name] = sd
        return out

    def save(self, step: int) -> Path | None:
        """Writes checkpoint `step` (every process takes part) and returns its folder on rank 0.

        Raises:
            CheckpointWriteError: on every rank, when any rank's write failed; the partial folder
                is gone and the earlier checkpoints are untouched.
        """
        from torch.distributed.checkpoint.api import CheckpointException

        self.launch.barrier()
        path, cause = None, None
        try:
            state = self.trainer_state()
            fmt = self.launch.checkpoint_format
            path = fmt.write(self.root, step, self.model(), self.opt, state, self.config_yaml(), self.keep)
        except (OSError, CheckpointException) as e:  # (DCP's wrapper is a BaseException)
            cause = commit.write_error_cause(e)
        # Every rank learns of any rank's failure, so none waits for a checkpoint that never comes.
        cause = next((c for c in self.launch.gather(cause) if c is not None), None)
        if cause is not None:
            if self.launch.is_main:
                commit.discard_temp(self.root, step)  # the sharded format's shared folder
            newest = commit.complete_checkpoints(self.root)
            raise commit.CheckpointWriteError(
                self.root / f"step-{step}", cause, newest[-1] if newest else None
            )
        if path is not None:
            log.info("saved checkpoint %s", path)
        self.launch.barrier()
        return path

    def load(self, path: Path) -> dict[str, Any]:
        """Restores every part from checkpoint `path` (the ``run`` part's checks first); returns
        trainer.pt's contents."""
        state = files.load_checkpoint(path)
        tr = state["trainer"]
        order = ["run", *(n for n in self.parts if n != "run")]
        for name in order[:1]:
            self._restore(name, tr, path)
        self.launch.checkpoint_format.read(path, state, self.model(), self.opt)
        for name in order[1:]:
            self._restore(name, tr, path)
        return tr

    def _restore(self, name: str, tr: dict[str, Any], path: Path) -> None:
        part = self.parts.get(name)
        if part is None:
            return
        sd = tr if name in FLAT else tr.get(name, {})
        if isinstance(part, PathAware):
            part.load_state_dict(sd, path)
        else:
            part.load_state_dict(sd)

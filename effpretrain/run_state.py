"""The stateful parts of a run that its checkpoints save by name (`effpretrain.checkpoint.states`):
where the run is (`Progress`), what it was launched as (`RunFacts`, checked on resume), the random
state (`RngState`) and the data stream's position (`DataPosition`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from effpretrain.checkpoint.states import PathAware
from effpretrain.config import RunConfig, to_dict
from effpretrain.errors import ConfigError

# Config sections whose change breaks exact resume (issue: resume must refuse them).
EXACTNESS_KEYS = {
    "model": None,
    "factor": None,
    "optim": ("name", "rank", "update_proj_gap", "proj_type", "basis", "targets", "extra"),
    "data": None,
    "train": ("batch_size", "grad_accum", "seed", "precision", "update_in_backward", "in_backward_refresh"),
}


@dataclass
class Progress:
    """Where the run is: optimizer steps taken, tokens trained, skipped (non-finite) steps."""

    step: int = 0
    tokens: int = 0
    skipped: int = 0
    consecutive_skips: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens": self.tokens, "skipped": self.skipped}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.tokens = int(sd["step"]), int(sd["tokens"])
        self.skipped, self.consecutive_skips = int(sd.get("skipped", 0)), 0


class RunFacts(PathAware):
    """What the run was launched as (process count, sharding, resolved config); restoring refuses
    a checkpoint that this run cannot continue exactly, before anything is loaded."""

    def __init__(self, cfg: RunConfig, world: int, sharding: str, allow_config_change: bool = False):
        self.cfg, self.world, self.sharding = cfg, world, sharding
        self.allow_config_change = allow_config_change

    def state_dict(self) -> dict[str, Any]:
        return {"world_size": self.world, "sharding": self.sharding, "config": to_dict(self.cfg)}

    def load_state_dict(self, sd: dict[str, Any], path: Path) -> None:
        self._check_compatible(sd.get("config", {}))
        if sd.get("world_size", 1) != self.world:
            raise ConfigError(
                f"checkpoint {path} was written by {sd.get('world_size')} processes, this run has {self.world}; "
                "resume with the same number of processes"
            )
        saved = sd.get("sharding", "ddp" if self.world > 1 else "none")
        if "fsdp2" in (saved, self.sharding) and saved != self.sharding:
            # An FSDP2 checkpoint is sharded (dcp/), the others are whole files: not interchangeable.
            raise ConfigError(
                f"checkpoint {path} was written with dist.sharding={saved}, this run uses "
                f"{self.sharding}; resume with the same dist.sharding"
            )

    def _check_compatible(self, saved: dict[str, Any]) -> None:
        now, default = to_dict(self.cfg), to_dict(RunConfig())
        diffs = []
        for section, keys in EXACTNESS_KEYS.items():
            # A key newer than the checkpoint stands at its default there (it behaved as that).
            a, b = {**default[section], **saved.get(section, {})}, now[section]
            for k in keys or b.keys():
                if a.get(k) != b.get(k):
                    diffs.append(f"{section}.{k}: {a.get(k)!r} -> {b.get(k)!r}")
        if diffs and not self.allow_config_change:
            raise ConfigError(
                "resume config differs in what exact resume depends on ("
                + "; ".join(diffs[:4])
                + "); pass --allow-config-change to resume anyway"
            )


class RngState:
    """torch's CPU random state, and CUDA's where there is a GPU."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        st = {"rng_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            st["rng_cuda"] = torch.cuda.get_rng_state()
        return st

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        torch.set_rng_state(sd["rng_cpu"])
        if "rng_cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["rng_cuda"])


class DataPosition(PathAware):
    """The token stream's position: one global position, or for a per-rank stream every rank's
    (gathered: the list ``ranks``, indexed by rank), each restored to its own rank."""

    def __init__(self, stream: Any, launch: Any):
        self.stream, self.launch = stream, launch

    def state_dict(self) -> dict[str, Any]:
        state = self.stream.state_dict()
        if not self.stream.per_rank:
            return state
        return {"ranks": self.launch.gather(state)}

    def load_state_dict(self, saved: dict[str, Any], path: Path) -> None:
        if self.stream.per_rank != ("ranks" in saved):
            raise ConfigError(
                f"checkpoint {path}: its data position is "
                f"{'per rank' if 'ranks' in saved else 'global'} but this run's source reads "
                f"{'per rank' if self.stream.per_rank else 'globally'}; resume with the same data.source"
            )
        if "ranks" not in saved:
            self.stream.load_state_dict(saved)
            return
        world = self.launch.world
        if len(saved["ranks"]) != world:  # each rank's documents depend on the world size
            raise ConfigError(
                f"checkpoint {path} holds the data positions of {len(saved['ranks'])} ranks, this run "
                f"has {world}; a streamed source resumes with the same number of processes"
            )
        self.stream.load_state_dict(saved["ranks"][self.launch.rank])


class OptionalPart:
    """A part that a run may not have (the in-backward engine): nothing saved or restored
    without it; `get` returns the current object (it is rebuilt at a warm start's switch)."""

    def __init__(self, get: Any):
        self.get = get

    def state_dict(self) -> dict[str, Any]:
        obj = self.get()
        return obj.state_dict() if obj is not None else {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        obj = self.get()
        if obj is not None:
            obj.load_state_dict(sd)

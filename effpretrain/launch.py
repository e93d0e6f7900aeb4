"""A run's processes: the Accelerator it trains with, and checks that the launch is the one asked for."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from effpretrain.config import RunConfig
from effpretrain.errors import ConfigError


def make_accelerator(cfg: RunConfig, out_dir: Path) -> Any:
    """The run's `accelerate.Accelerator`: CPU without CUDA, bf16 autocast for `bf16-mixed`,
    the configured trackers (refused up front when not installed), and DDP with
    ``gradient_as_bucket_view``: the gradients live in DDP's communication buckets instead of
    being copied into them, so a rank holds one full gradient, not two (the trainer's re-wrap
    after a warm start reuses these kwargs)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    for name in cfg.train.trackers:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"train.trackers: {name} is not installed (pip install 'effpretrain[track]')")
    return Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision="bf16" if cfg.train.precision == "bf16-mixed" else "no",
        log_with=list(cfg.train.trackers) or None,
        project_dir=str(out_dir),
        kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)],
    )


def check_launch(world: int, cfg: RunConfig) -> None:
    """Refuses a distributed set-up that differs from the one launched (known silent traps)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != world:
        raise ConfigError(f"launched {launched} processes (WORLD_SIZE) but Accelerate set up {world}")
    mpi = any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
    if world == 1 and "WORLD_SIZE" not in os.environ and os.environ.get("MASTER_ADDR") and not mpi:
        # accelerate launch with a MULTI_CPU config (or --cpu --num_processes N) starts one process.
        raise ConfigError(
            "a multi-process launch started a single process (accelerate launch on CPU does this); "
            "use --config_file recipes/accelerate/ddp_cpu.yaml or torchrun --nproc_per_node N"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        # An Accelerate FSDP config: the trainer shards with FSDP2 itself, so the recipe must agree.
        version = os.environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise ConfigError(
                f"the Accelerate config asks for FSDP version {version}; effpretrain shards with FSDP2 "
                "(set fsdp_version: 2, see recipes/accelerate/fsdp2.yaml)"
            )
        if world > 1 and cfg.dist.sharding != "fsdp2":
            raise ConfigError(
                f"the Accelerate config launches FSDP but dist.sharding={cfg.dist.sharding}; "
                "pass --set dist.sharding=fsdp2"
            )

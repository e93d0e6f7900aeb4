"""A run's processes: the Accelerator it trains with, the checks that the launch is the one asked
for, and the launch mode (`choose_launch`): one process, DDP, DDP with updates in backward, FSDP2."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from effpretrain import devices, grad_norm
from effpretrain.checkpoint.states import ShardedFormat, WholeFormat
from effpretrain.config import RunConfig
from effpretrain.errors import ConfigError
from effpretrain.fsdp import apply_fsdp2
from effpretrain.in_backward import AllReduceMean, broadcast_module_, check_same_order
from effpretrain.models.quantize import quantized_weights

log = logging.getLogger("effpretrain")


def make_accelerator(
    cfg: RunConfig, out_dir: Path, announce: bool = True, facts: devices.CudaFacts | None = None
) -> Any:
    """The run's `accelerate.Accelerator`: on the device `train.device` chooses
    (`effpretrain.devices.choose`; ``cuda`` without a working CUDA is a ConfigError), bf16 autocast
    for `bf16-mixed`, the configured trackers (refused up front when not installed), and DDP with
    ``gradient_as_bucket_view``: the gradients live in DDP's communication buckets instead of
    being copied into them, so a rank holds one full gradient, not two (the trainer's re-wrap
    after a warm start reuses these kwargs).

    The main process prints the device it trains on (one line on stdout, with `announce`; `eval`
    keeps its stdout for its JSON) and logs the choice's warning, if any (one line). `facts`: this
    machine's (`devices.cuda_facts`) unless given."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    setting = cfg.train.device
    try:
        choice = devices.choose(setting, devices.cuda_facts() if facts is None else facts)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name in cfg.train.trackers:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"train.trackers: {name} is not installed (pip install 'effpretrain[track]')")
    acc = Accelerator(
        cpu=choice.cpu,
        mixed_precision="bf16" if cfg.train.precision == "bf16-mixed" else "no",
        log_with=list(cfg.train.trackers) or None,
        project_dir=str(out_dir),
        kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)],
    )
    if setting == "cuda" and acc.device.type != "cuda":
        # Accelerate honours ACCELERATE_USE_CPU (accelerate launch --cpu) over its cpu= argument.
        raise ConfigError(
            f"train.device=cuda but Accelerate placed the run on {acc.device} (ACCELERATE_USE_CPU?)"
        )
    if acc.is_main_process:
        name = f", {torch.cuda.get_device_name(acc.device)}" if acc.device.type == "cuda" else ""
        if announce:
            print(f"device: {acc.device} ({choice.reason}{name})", flush=True)
        if choice.warning is not None:
            log.warning(choice.warning)
    return acc


def _ddp_kwargs(**kwargs: Any) -> Any:
    """Accelerate's DDP kwargs handler, plus DDP's ``init_sync`` (which Accelerate's lacks)."""
    from dataclasses import dataclass

    from accelerate.utils import DistributedDataParallelKwargs

    @dataclass
    class DDPKwargs(DistributedDataParallelKwargs):
        init_sync: bool = True

    return DDPKwargs(**kwargs)


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


# ----------------------------------------------------------------------------------------------
# The launch mode, chosen once: everything that differs between one process, DDP, DDP with
# updates in backward and FSDP2 lives here, so the training loop never branches on it.


class Launch:
    """One process: Accelerate's `prepare`, no gradient synchronisation, whole checkpoints.

    Attributes:
        acc: the run's Accelerator; world, rank, is_main: the processes.
        sharding: ``none``, ``ddp`` or ``fsdp2``, as checkpoints and summaries record it.
    """

    sharding = "none"

    def __init__(self, acc: Any, cfg: RunConfig):
        self.acc, self.cfg = acc, cfg
        self.world, self.rank, self.is_main = acc.num_processes, acc.process_index, acc.is_main_process
        self.device = acc.device

    # -- the model ------------------------------------------------------------------------------
    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """Applied after the model is placed, before the optimizer is built (FSDP2 replaces the
        parameters); identity here."""
        return model

    def wrap(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, Any]:
        """The model and optimizer the loop calls (Accelerate's wrappers)."""
        return self.acc.prepare(model, opt)

    def unwrap(self, model: Any) -> torch.nn.Module:
        return self.acc.unwrap_model(model)

    def rewrap(self, model: Any) -> Any:
        """After a warm start's switch (new parameters require grad); nothing to do here."""
        return model

    def eval_view(self, model: Any) -> tuple[torch.nn.Module, bool]:
        """The module evaluation runs, and whether the ranks must run it in lockstep."""
        return self.unwrap(model), False

    # -- a step ---------------------------------------------------------------------------------
    def micro_sync(self, model: Any, last: bool, in_backward: bool) -> Any:
        """The context of one micro-step's forward and backward: gradients synchronise on the
        last micro-step only (Accelerate's ``no_sync`` before it)."""
        return contextlib.nullcontext() if last else self.acc.no_sync(model)

    def in_backward_reduce(self, model: torch.nn.Module) -> Any:
        """What an in-backward hook does to a final gradient before stepping (None: nothing)."""
        return None

    def finish_step(self, model: Any, in_backward: Any, loss: float) -> tuple[float, bool]:
        """After the micro-steps: the global gradient norm (clipped to `train.grad_clip`, or the
        in-backward engine's own finish) and whether the step is finite."""
        if in_backward is None:
            # One norm for every launch mode (fp64 partial sums): one process, DDP and FSDP2 clip alike.
            gnorm = grad_norm.clip_grad_norm_(model.parameters(), self.cfg.train.grad_clip)
            return gnorm, math.isfinite(loss) and math.isfinite(gnorm)
        gnorm = in_backward.finish()
        self._after_in_backward(in_backward)
        # A step that updated any parameter has happened: it counts, and the data moves on.
        return gnorm, len(in_backward.params) > in_backward.skipped

    def _after_in_backward(self, in_backward: Any) -> None:
        pass

    # -- collectives ----------------------------------------------------------------------------
    def gather(self, obj: Any) -> list[Any]:
        """`obj` from every rank, in rank order (a small picklable object)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def agree_max(self, value: int) -> int:
        """The largest of every rank's `value` (a stop signal asked of any rank stops them all)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        flag = torch.tensor(value, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def barrier(self) -> None:
        self.acc.wait_for_everyone()

    def telemetry(self, tel: dict[str, Any]) -> dict[str, Any]:
        """The optimizer's telemetry over the run's processes (each computes every basis here)."""
        return tel

    # -- checkpoints ----------------------------------------------------------------------------
    @property
    def checkpoint_format(self) -> Any:

        return WholeFormat(self)


class DDPLaunch(Launch):
    """Several processes, DistributedDataParallel (Accelerate's, with ``gradient_as_bucket_view``):
    gradients all-reduce on each step's last micro-step; rank 0 writes whole checkpoints."""

    sharding = "ddp"

    def wrap(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, Any]:
        if quantized_weights(model):
            # DDP's own start-up broadcast copies a flattened (dequantized) buffer back into each
            # parameter, which an INT8 weight refuses: rank 0's codes and scales are broadcast as
            # they are instead, and DDP is told not to repeat it.
            broadcast_module_(model)
            self.acc.ddp_handler = _ddp_kwargs(gradient_as_bucket_view=True, init_sync=False)
        model, opt = self.acc.prepare(model, opt)
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ConfigError(
                f"{self.world} processes but the model is not wrapped in DDP (got {type(model).__name__})"
            )
        return model, opt

    def rewrap(self, model: Any) -> Any:
        """A new DDP around the same module, built as Accelerate built the old one (its kwargs
        handler and device ids): DDP reduces only the parameters that required grad when it
        wrapped the model. Accelerate's reference to the old wrapper is replaced so the old
        reducer and its gradient hooks are released."""
        old, handler = model, self.acc.ddp_handler
        new = torch.nn.parallel.DistributedDataParallel(
            old.module,
            device_ids=old.device_ids,
            output_device=old.output_device,
            **(handler.to_kwargs() if handler is not None else {}),
        )
        if handler is not None:
            handler.register_comm_hook(new)
        new._is_accelerate_prepared = True
        self.acc._models[:] = [new if m is old else m for m in self.acc._models]
        return new


class DDPInBackwardLaunch(DDPLaunch):
    """DDP with updates in backward: no DDP wrapper (its buckets would keep every gradient alive).
    Every rank starts from rank 0's weights and each final gradient is averaged over the ranks in
    its hook (`in_backward.AllReduceMean`), in the same order on every rank (checked each step)."""

    def wrap(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, Any]:
        return model, opt

    def rewrap(self, model: Any) -> Any:
        return model

    def micro_sync(self, model: Any, last: bool, in_backward: bool) -> Any:
        return contextlib.nullcontext()  # the hooks all-reduce (last micro-step)

    def in_backward_reduce(self, model: torch.nn.Module) -> Any:

        broadcast_module_(model)  # also the factors a warm start's switch creates
        return AllReduceMean(self.world)

    def _after_in_backward(self, in_backward: Any) -> None:

        check_same_order(in_backward.order, self.device)


class FSDP2Launch(Launch):
    """Several processes, FSDP2 (torch's ``fully_shard`` on every decoder layer and the root, not
    Accelerate's plugin, which silently falls back to DDP on CPU): gradients reduce-scatter on the
    last micro-step (every micro-step with updates in backward, whose hooks FSDP2 runs on the
    reduced shards); evaluation runs in lockstep; checkpoints are sharded (DCP)."""

    sharding = "fsdp2"

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        # An INT8 weight's codes and scales travel in FSDP2's all-gather as they are, which needs
        # equal row shards on every rank (FSDP2 pads uneven ones, and its padding is one tensor's).
        for name, p in quantized_weights(model):
            if p.shape[0] % self.world:
                raise ConfigError(
                    f"train.weight_quant=int8 under FSDP2: {name} has {p.shape[0]} rows, "
                    f"which do not split evenly over {self.world} processes"
                )
        return apply_fsdp2(model)

    def wrap(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, Any]:
        return model, opt  # not through acc.prepare: without Accelerate's FSDP plugin it would wrap in DDP

    def eval_view(self, model: Any) -> tuple[torch.nn.Module, bool]:
        return model, True  # the forward gathers shards collectively

    def micro_sync(self, model: Any, last: bool, in_backward: bool) -> Any:
        # Earlier micro-steps accumulate unsharded gradients; in backward, every micro-step
        # reduce-scatters so the hooks accumulate 1/N-size shards.
        model.set_requires_gradient_sync(last or in_backward)
        return contextlib.nullcontext()

    def telemetry(self, tel: dict[str, Any]) -> dict[str, Any]:
        """Each owner rank computes its own parameters' bases: ``opt/refreshes`` summed over the
        ranks (the bases the run computed), ``opt/refresh_s`` the slowest rank's (a collective)."""
        if "opt/refreshes" not in tel:
            return tel
        ranks = self.gather(tel)
        return {
            **tel,
            "opt/refreshes": sum(r["opt/refreshes"] for r in ranks),
            "opt/refresh_s": max(r["opt/refresh_s"] for r in ranks),
        }

    @property
    def checkpoint_format(self) -> Any:

        return ShardedFormat(self)


def choose_launch(acc: Any, cfg: RunConfig) -> Launch:
    """The launch mode of this run, from its processes, `dist.sharding` and
    `train.update_in_backward` (FSDP2 needs nothing different in backward)."""
    if acc.num_processes == 1:
        return Launch(acc, cfg)
    if cfg.dist.sharding == "fsdp2":
        return FSDP2Launch(acc, cfg)
    return DDPInBackwardLaunch(acc, cfg) if cfg.train.update_in_backward else DDPLaunch(acc, cfg)

"""`EffPretrainCallback`: the periodic events, perplexity, memory and the in-backward driving, from Trainer hooks; `prepare_trainer` for updates in backward under several processes."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from accelerate.state import GradientState
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

import optimizers
from effpretrain import memory
from effpretrain.config import (
    RestartsConfig,
    RunConfig,
)
from effpretrain.errors import ConfigError
from effpretrain.hf.estimate import _estimate_fields, estimate_memory
from effpretrain.hf.factory import factor_config
from effpretrain.hf.registry import _DRIVEN, _UNWRAPPED, _engine_of, _find_restarts
from effpretrain.in_backward import AllReduceMean, InBackward, broadcast_module_, check_same_order
from effpretrain.optim_setup import opt_telemetry, restart_ramps, wrap_restarts
from optimizers.momentum_reset import unwrap_optimizer
from optimizers.restarts import Restarts, recovery_factor

log = logging.getLogger(__name__)


def _ppl(loss: float) -> float:
    # The trainer's convention: exp of the mean token loss, capped so a diverged run logs a number.
    return math.exp(min(float(loss), 50.0))


def _in_backward_refusal(args: Any, fsdp: bool = False) -> str | None:
    """Why the Trainer set up by `args` cannot update parameters inside backward (None: it can);
    `fsdp`: Accelerate's FSDP plugin is on (an accelerate config that `args` does not show)."""
    if getattr(args, "deepspeed", None):
        return "DeepSpeed partitions the gradients and runs the optimizer step itself"
    if fsdp or getattr(args, "fsdp", None):
        return "FSDP reduce-scatters the gradients after the per-parameter hooks have stepped; use DDP (torchrun)"
    if getattr(args, "fp16", False):
        return (
            "fp16's GradScaler unscales and checks the gradients only at optimizer.step(), so the "
            "parameters would step on scaled gradients; use bf16"
        )
    if getattr(args, "n_gpu", 0) > 1:
        return f"DataParallel over {args.n_gpu} GPUs replicates the model at every forward; use one device"
    return None


def prepare_trainer(trainer: Any) -> None:
    """Readies a transformers `Trainer` for an optimizer from ``create_optimizer(...,
    update_in_backward=True)`` under several processes: call it after building the Trainer and
    before ``trainer.train()`` (optional with one process; nothing to do for other optimizers).

    Under torchrun the Trainer has Accelerate wrap the model in DDP, whose reducer would reduce
    every gradient again after the per-parameter hooks have stepped, into buckets holding a full
    copy of the gradients. Here Accelerate prepares the model without a wrapper, the way the Trainer
    prepares a model that reduces its own gradients (``accelerator.prepare_model(model,
    evaluation_mode=True)``: device placement, mixed-precision autocast, ``torch_compile``); the
    Trainer then keeps it as it is, and `EffPretrainCallback` averages each final gradient over the
    ranks in its hook.

    Raises:
        ConfigError: the Trainer runs DeepSpeed, FSDP, fp16 or DataParallel.
    """
    if _engine_of(trainer.optimizer) is None or trainer.model in _UNWRAPPED:
        return
    why = _in_backward_refusal(trainer.args, fsdp=bool(getattr(trainer, "is_fsdp_enabled", False)))
    if why:
        raise ConfigError(f"create_optimizer(update_in_backward=True): {why}")
    prepared = trainer.accelerator.prepare_model(trainer.model, evaluation_mode=True)
    if prepared is not trainer.model:  # compiled: the Trainer trains model_wrapped and prepares no model
        trainer.model_wrapped = prepared
    _UNWRAPPED.add(trainer.model)


def _seq_len_of(dataloader: Any) -> int | None:
    # Pretraining rows have one length; indexing a map-style dataset draws no random numbers.
    try:
        row = dataloader.dataset[0]
        return int(len(row["input_ids"]))
    except Exception:
        return None


# Callback


class EffPretrainCallback(TrainerCallback, ExportableState):
    """Restarts, memory and perplexity for a transformers `Trainer` (see the module docstring).

    Events. With ``restarts_every = T > 0`` and an optimizer that is not already a `Restarts`
    wrapper (from `create_optimizer(..., restarts_every=T)`), right after optimizer update k T
    (k >= 1; gradient-accumulation micro-steps and skipped updates do not count) the callback runs
    `Restarts.restart()` built by the trainer's rules: the ReLoRA merge (ReLoRA models), then
    refactorization of the factor pairs (Low-Rank and SLTrain models, if `refactorize`), then the
    momentum reset of every parameter's Adam state (if `reset_momentum`, always for ReLoRA). The LR
    of the next R = `recovery_steps` updates is multiplied by `optimizers.restarts.recovery_factor`
    on top of the Trainer's scheduler (the scheduler's own value is put back before it steps, so any
    scheduler works), exactly as the trainer's `lr_factor` does. If the optimizer is a `Restarts`
    wrapper, the wrapper fires the events and its scheduler carries the ramp; the callback then only
    tracks (a different non-zero `restarts_every` is an error).

    Logs. Every ``loss`` gets its perplexity exp(loss): ``ppl``, ``eval_ppl`` (also in the dict
    ``trainer.evaluate()`` returns; ``eval_<set>_ppl`` per eval set) and the final ``train_ppl``. Training
    logs get the measured ``optimizer_state_bytes`` (summed over the state tensors) and
    ``peak_memory_bytes`` (CUDA max allocated, or peak RSS on CPU), ``opt/refreshes`` and
    ``opt/restarts`` where the optimizer counts them; the first training log and the final summary
    carry the estimate (`estimate_memory`) as ``est_weights_bytes``, ``est_grads_bytes``,
    ``est_optimizer_state_bytes``, ``est_activations_bytes`` (preset-shaped models), ``est_total_bytes``.
    The fields are added to ``trainer.state.log_history`` and seen by callbacks after this one
    (the progress printer); reporting integrations run before user callbacks, so to send the fields
    to TensorBoard or W&B put the callback first: ``trainer.callback_handler.callbacks.insert(0, cb)``.

    Updates in backward. With an optimizer from ``create_optimizer(..., update_in_backward=True)``
    the callback drives its engine (see the module docstring); it is required there (the
    optimizer refuses to step without it). ``TrainingArguments.max_grad_norm = c > 0`` multiplies
    step t's gradients by min(1, c / (||G_{t-1}|| + 1e-6)) (the first step unclipped), as
    ``train.grad_clip`` does in this mode: exact clipping would need every gradient before the
    first parameter steps, and refusing c > 0 would refuse the Trainer's default (1.0). Under
    several processes (a Trainer readied by `prepare_trainer`: no DDP wrapper) every rank starts
    from rank 0's weights, each final gradient is averaged over the ranks in its hook before it is
    clipped and stepped (`effpretrain.in_backward.AllReduceMean`, one all-reduce per parameter, no
    buckets), so the norm and clip coefficient are the same on every rank; after each update the
    ranks' all-reduce orders are compared (`check_same_order`: a graph that differs between ranks
    raises). DeepSpeed, FSDP, fp16 and DataParallel are refused, and so are several processes
    without `prepare_trainer` (the Trainer's DDP would reduce again after the hooks have stepped).

    Checkpoints. Its counters are saved in each checkpoint's ``trainer_state.json`` (as an
    `ExportableState`), with the previous step's gradient norm in updates in backward, and read back
    at the start of a resumed ``trainer.train(resume_from_checkpoint=...)``.

    Args:
        restarts_every: T, optimizer updates between restarts (0: none from the callback).
        refactorize: re-split factor pairs at restarts.
        reset_momentum: zero Adam moments and step counters at restarts (and ramp the LR back).
        recovery_steps: R, updates of the LR ramp after each restart (0: no ramp).
        track_memory: add the memory fields to the logs.
        seq_len: tokens per training row for the activation estimate; None reads it from the first
            row of the training dataset when it can.

    Attributes:
        num_updates: optimizer updates seen (callback-driven restarts only).
        num_restarts: restarts the callback fired.
        estimate: the `memory.Estimate` computed at train begin (None without `track_memory`).
    """

    def __init__(
        self,
        restarts_every: int = 0,
        refactorize: bool = True,
        reset_momentum: bool = True,
        recovery_steps: int = 10,
        track_memory: bool = True,
        seq_len: int | None = None,
    ) -> None:
        if not isinstance(restarts_every, int) or restarts_every < 0:
            raise ValueError(f"restarts_every must be an int >= 0, got {restarts_every!r}")
        if not isinstance(recovery_steps, int) or recovery_steps < 0:
            raise ValueError(f"recovery_steps must be an int >= 0, got {recovery_steps!r}")
        self.restarts_every = restarts_every
        self.refactorize = refactorize
        self.reset_momentum = reset_momentum
        self.recovery_steps = recovery_steps
        self.track_memory = track_memory
        self.seq_len = seq_len
        self.num_updates = 0
        self.num_restarts = 0
        # The scheduler's own LRs while the recovery ramp scales them (None when not scaled).
        self.scheduled_lrs: list[float] | None = None
        self.estimate: memory.Estimate | None = None
        self._restarts: Restarts | None = None  # set when this callback fires the events
        self._ramp = False
        self._wrapper: Restarts | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._device = torch.device("cpu")
        self._last_lr: float | None = None
        self._estimate_logged = False
        # update_in_backward: the engine this callback drives, the last step's global gradient
        # norm, the micro-batch index within the update, the model's forward pre-hook.
        self._inb: InBackward | None = None
        self._inb_norm: float | None = None
        self._inb_prev_norm: float | None = None  # read from a checkpoint
        self._micro = 0
        self._forward_hook: torch.utils.hooks.RemovableHandle | None = None

    # -- checkpointed state (transformers' ExportableState format) -----------------------------
    def state(self) -> dict[str, Any]:
        return {
            "args": {
                "restarts_every": self.restarts_every,
                "refactorize": self.refactorize,
                "reset_momentum": self.reset_momentum,
                "recovery_steps": self.recovery_steps,
                "track_memory": self.track_memory,
                "seq_len": self.seq_len,
            },
            "attributes": {
                "num_updates": self.num_updates,
                "num_restarts": self.num_restarts,
                "scheduled_lrs": self.scheduled_lrs,
                # update_in_backward: the next step clips with this norm (exact resume).
                "in_backward_prev_norm": self._inb.prev_norm if self._inb is not None else None,
            },
        }

    def _restore(self, state: Any) -> None:
        saved = state.stateful_callbacks.get(type(self).__name__)
        if isinstance(saved, list):
            saved = saved[0] if saved else None
        if isinstance(saved, dict):
            attrs = saved.get("attributes", {})
            self.num_updates = int(attrs.get("num_updates", 0))
            self.num_restarts = int(attrs.get("num_restarts", 0))
            lrs = attrs.get("scheduled_lrs")
            self.scheduled_lrs = [float(x) for x in lrs] if lrs is not None else None
            prev = attrs.get("in_backward_prev_norm")
            self._inb_prev_norm = float(prev) if prev is not None else None
        else:
            # A checkpoint written without this callback: assume no update was skipped.
            self.num_updates, self.num_restarts, self.scheduled_lrs = state.global_step, 0, None
            self._inb_prev_norm = None
            # transformers' checkpoint writer expects an entry for every ExportableState callback.
            state.stateful_callbacks[type(self).__name__] = self.state()

    # -- hooks ---------------------------------------------------------------------------------
    def on_train_begin(
        self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs
    ):
        self._restore(state)
        self._optimizer = optimizer
        self._device = next(model.parameters()).device
        self._wrapper = _find_restarts(optimizer)
        self._restarts, self._ramp = None, False
        self._set_up_in_backward(args, model, optimizer)
        if self._wrapper is not None:
            if self.restarts_every and self.restarts_every != self._wrapper.every:
                raise ValueError(
                    f"EffPretrainCallback(restarts_every={self.restarts_every}) but the optimizer already "
                    f"restarts every {self._wrapper.every} updates; drop one of the two"
                )
        elif self.restarts_every > 0:
            cfg = RunConfig(
                factor=factor_config(model),
                restarts=RestartsConfig(
                    every=self.restarts_every,
                    refactorize=self.refactorize,
                    reset_momentum=self.reset_momentum,
                    recovery_steps=self.recovery_steps,
                ),
            )
            self._restarts = wrap_restarts(unwrap_optimizer(optimizer), model, cfg)
            # The same condition under which the trainer's lr_factor applies the ramp.
            self._ramp = restart_ramps(cfg)
        if self.track_memory:
            self.estimate = estimate_memory(
                model,
                optimizer,
                bf16_autocast=bool(args.bf16),
                batch_size=args.per_device_train_batch_size,
                seq_len=self.seq_len or _seq_len_of(train_dataloader),
                activation_checkpointing=1 if args.gradient_checkpointing else 0,
                grad_accum=args.gradient_accumulation_steps,
                grad_clip=float(args.max_grad_norm or 0.0),
                world_size=int(getattr(args, "world_size", 1)),
            )
        self._estimate_logged = False

    def _set_up_in_backward(self, args: Any, model: torch.nn.Module, optimizer: Any) -> None:
        """Drives the engine of an optimizer from ``create_optimizer(update_in_backward=True)``."""
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._inb, self._inb_norm, self._micro = None, None, 0
        engine = _engine_of(optimizer)
        if engine is None:
            return
        why = _in_backward_refusal(args)
        world = int(getattr(args, "world_size", 1))
        if not why and world > 1 and model not in _UNWRAPPED:
            why = (
                f"{world} processes: call effpretrain.hf.prepare_trainer(trainer) before trainer.train(), "
                "or the Trainer's DDP reduces the gradients again after the per-parameter hooks have stepped"
            )
        if why:
            raise ConfigError(f"create_optimizer(update_in_backward=True): {why}")
        self._inb = engine
        # Several processes (DDP without a wrapper, as the trainer's ddp mode): the ranks start from
        # rank 0's weights, and each final gradient is averaged over them in its hook.
        self._inb.reduce = AllReduceMean(world) if world > 1 else None
        if world > 1:
            broadcast_module_(model)
        # The Trainer's own clipping would act on no gradients (they are freed in backward): its
        # threshold applies the engine's rule instead, c_t = min(1, max_norm / (||G_{t-1}|| + 1e-6)).
        self._inb.max_norm = float(args.max_grad_norm or 0.0)
        self._inb.prev_norm = self._inb_prev_norm
        if self._inb.max_norm > 0:
            log.info(
                "update_in_backward: max_grad_norm=%g clips each step with the previous step's global "
                "gradient norm (the first step is not clipped)",
                self._inb.max_norm,
            )
        _DRIVEN.add(self._inb)
        self._forward_hook = model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: torch.nn.Module, inputs: Any) -> None:
        if self._inb is None or not (module.training and torch.is_grad_enabled()):
            return  # evaluation and generation
        # The Trainer sets the flag it steps on (its do_sync_step) before each micro-batch's forward:
        # true on the last micro-batch of an update, also for an epoch's short last update.
        last = bool(GradientState().sync_gradients)
        k = self._micro
        # K is only known at the last micro-batch; the engine reads k == 0 and k == K - 1 only.
        self._inb.begin_micro(k, k + 1 if last else k + 2)
        self._micro = k + 1

    def on_step_begin(self, args, state, control, **kwargs):
        self._micro = 0

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self._last_lr = float(optimizer.param_groups[0]["lr"])
        if self._inb is not None:
            # Every parameter has stepped in backward; the Trainer's optimizer.step() that follows
            # finds no gradient and runs only a wrapper's bookkeeping (restarts), once per update.
            self._inb_norm = self._inb.finish()
            if self._inb.reduce is not None:  # a graph that differs between ranks paired wrong gradients
                check_same_order(self._inb.order, self._device)
            if self._inb.skipped:
                log.warning(
                    "update_in_backward, step %d: %d parameters with non-finite gradients were not updated",
                    state.global_step + 1,
                    self._inb.skipped,
                )

    def on_train_end(self, args, state, control, **kwargs):
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        if self._inb is not None:
            _DRIVEN.discard(self._inb)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self._restarts is None or getattr(optimizer, "step_was_skipped", False):
            return
        if self.scheduled_lrs is not None:
            # Give the scheduler back its own values before it steps (chainable schedulers read them).
            for group, lr in zip(optimizer.param_groups, self.scheduled_lrs):
                group["lr"] = lr
            self.scheduled_lrs = None
        self.num_updates += 1
        if self.num_updates % self.restarts_every == 0:
            self._restarts.restart()
            self.num_restarts += 1

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        # After the scheduler stepped: the LR for update num_updates + 1, as lr_factor(num_updates).
        if not self._ramp or self.scheduled_lrs is not None:
            return
        f = recovery_factor(self.num_updates, self.restarts_every, self.recovery_steps)
        if f != 1.0:
            self.scheduled_lrs = [float(g["lr"]) for g in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] *= f

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        extra: dict[str, float] = {}
        for key, value in logs.items():
            # loss -> ppl, eval_loss -> eval_ppl, eval_<set>_loss -> eval_<set>_ppl, train_loss -> train_ppl
            if (key == "loss" or key.endswith("_loss")) and isinstance(value, (int, float)):
                extra[key[: -len("loss")] + "ppl"] = _ppl(value)
        training = "loss" in logs or "train_loss" in logs
        if self._ramp and "learning_rate" in logs and self._last_lr is not None:
            extra["learning_rate"] = self._last_lr  # the scheduler's value misses the ramp
        if self._inb is not None and "grad_norm" in logs and self._inb_norm is not None:
            # The Trainer measured the freed gradients (0): the engine's norm of this step's final ones.
            extra["grad_norm"] = self._inb_norm
        if self.track_memory and training and self._optimizer is not None:
            extra["optimizer_state_bytes"] = optimizers.measured_state_bytes(
                unwrap_optimizer(self._optimizer)
            )
            extra["peak_memory_bytes"] = memory.peak_memory_bytes(self._device)
            extra.update(self._telemetry())
            if self.estimate is not None and (not self._estimate_logged or "train_loss" in logs):
                extra.update(_estimate_fields(self.estimate))
                self._estimate_logged = True
        logs.update(extra)
        # transformers appended a copy of `logs` to the history just before calling on_log.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        # Usually already added by on_log (transformers logs the same dict it returns).
        for key, value in list((metrics or {}).items()):
            if key.endswith("_loss") and isinstance(value, (int, float)):
                metrics[key[: -len("loss")] + "ppl"] = _ppl(value)

    def _telemetry(self) -> dict[str, Any]:
        # The trainer's own refresh telemetry, read from the optimizer below Accelerate's wrapper.
        owner = self._wrapper or unwrap_optimizer(self._optimizer)
        out = opt_telemetry(owner)
        if self._wrapper is not None:
            out["opt/restarts"] = int(self._wrapper.num_restarts)
        elif self._restarts is not None:
            out["opt/restarts"] = self.num_restarts
        return out

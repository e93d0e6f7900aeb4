"""HuggingFace `Trainer` integration: every effpretrain method in an existing Trainer job.

Two additions to a Trainer script bring in the optimizers, the periodic events and the tracking:

    optimizer, scheduler = create_optimizer(model, "galore", num_training_steps=1000, lr=1e-2, rank=128)
    trainer = Trainer(..., optimizers=(optimizer, scheduler), callbacks=[EffPretrainCallback()])

Nothing is reimplemented here: `create_optimizer` fills an `effpretrain.config.RunConfig` and calls
the trainer's own `build_param_groups`, `optimizer_kwargs`, `optimizers.build_optimizer`, restart
wrapping and `lr_factor`, so a Trainer job and an `effpretrain train` run with the same settings
build the same optimizer and schedule. With ``restarts_every > 0`` the optimizer is the
`optimizers.Restarts` wrapper (refactorization of factor pairs, momentum reset, ReLoRA merge, at
exactly every T-th update) and the schedule includes the quick-recovery LR ramp.

`EffPretrainCallback` runs the same events from Trainer hooks when the optimizer does not fire
them itself (any other optimizer, e.g. the Trainer's default AdamW): after update k T it calls the
same `Restarts.restart()` and scales the next R learning rates by the same `recovery_factor`. It
adds perplexity (``ppl``, ``eval_ppl``, ``train_ppl``) and memory fields (measured
``optimizer_state_bytes`` and ``peak_memory_bytes`` on every training log; the analytic estimate
``est_*_bytes`` on the first training log and the final summary log) to the Trainer's logs, and
keeps its counters in the Trainer's checkpoints (``trainer_state.json``), so
``trainer.train(resume_from_checkpoint=...)`` continues exactly.

``create_optimizer(..., update_in_backward=True)`` updates each parameter inside backward and
frees its gradient (`effpretrain.in_backward`, the engine of ``train.update_in_backward``) under
the Trainer's own loop: the callback tells the engine which micro-batch of the Trainer's gradient
accumulation is the last of an update (the Trainer's own sync flag, read in a forward pre-hook),
ends each update before the Trainer's ``optimizer.step()`` (which then finds no gradient and runs
only a wrapper's bookkeeping such as restarts; the LR scheduler steps as usual), replaces the
logged ``grad_norm`` (the Trainer measures the freed gradients: 0) by the engine's global norm,
and applies ``max_grad_norm`` with the engine's previous-step-norm rule. DeepSpeed, fp16
(GradScaler) and several processes are refused.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from accelerate.state import GradientState
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

import optimizers
from effpretrain import memory
from effpretrain.config import (
    ATTN_MLP_TARGETS,
    FactorConfig,
    OptimConfig,
    RestartsConfig,
    RunConfig,
    TrainConfig,
    validate,
)
from effpretrain.errors import ConfigError
from effpretrain.in_backward import InBackward
from effpretrain.models.factorized import FACTOR_KINDS, apply_factorization, factorized_layers
from effpretrain.models.llama import PRESETS
from effpretrain.optim_setup import build_optimizer_and_schedule, opt_telemetry, restart_ramps, wrap_restarts
from optimizers.momentum_reset import unwrap_optimizer
from optimizers.restarts import Restarts, recovery_factor

__all__ = [
    "EffPretrainCallback",
    "apply_factorization",
    "build_run_config",
    "create_optimizer",
    "estimate_memory",
    "factor_config",
]

# The RunConfig behind each optimizer create_optimizer returned: lets the callback see which method
# and settings it is tracking (and whether restarts are already handled) without tagging the object.
_CONFIGS: weakref.WeakKeyDictionary[torch.optim.Optimizer, RunConfig] = weakref.WeakKeyDictionary()
# The in-backward engine of each optimizer create_optimizer(update_in_backward=True) returned. The
# engine is kept alive by its hooks on the model's parameters; a weak reference here keeps the
# engine (which holds the optimizer) from holding its own key alive.
_ENGINES: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[InBackward]] = (
    weakref.WeakKeyDictionary()
)
# Engines a callback drives (marks micro-batches, finishes steps): the optimizer refuses to step
# for any other, as the Trainer's step would then silently run on whole gradients.
_DRIVEN: weakref.WeakSet[InBackward] = weakref.WeakSet()

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Config from a model


def _factor_kind(layer: torch.nn.Module) -> str:
    names = {spec.layer: name for name, spec in FACTOR_KINDS.items()}
    # The most derived registered class wins: a ReLoRALinear is also a LoRALinear.
    for cls in type(layer).__mro__:
        if cls in names:
            return names[cls]
    raise ValueError(f"{type(layer).__name__} is not a registered factorized layer")


def factor_config(model: torch.nn.Module) -> FactorConfig:
    """The `FactorConfig` describing the factorized layers `model` already holds (kind "none" if it has none).

    Raises:
        ValueError: the model mixes factorization kinds (one run uses one kind).
    """
    layers = factorized_layers(model)
    if not layers:
        return FactorConfig(kind="none")
    kinds = sorted({_factor_kind(layer) for _, layer in layers})
    if len(kinds) > 1:
        raise ValueError(f"model mixes factorization kinds {kinds}; effpretrain runs one kind per model")
    first = layers[0][1]
    return FactorConfig(
        kind=kinds[0],
        rank=first.rank,
        alpha=first.alpha,
        targets=sorted({name.rpartition(".")[2] for name, _ in layers}),
        density=float(getattr(first, "density", FactorConfig.density)),
    )


def build_run_config(
    model: torch.nn.Module,
    method: str,
    *,
    num_training_steps: int,
    lr: float,
    weight_decay: float = 0.0,
    warmup_ratio: float = 0.1,
    min_lr_ratio: float = 0.1,
    schedule: str = "cosine",
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float | None = None,
    rank: int = 128,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    proj_type: str = "std",
    basis: str = "default",
    targets: Sequence[str] | None = None,
    restarts_every: int = 0,
    refactorize: bool = True,
    reset_momentum: bool = True,
    recovery_steps: int = 10,
    update_in_backward: bool = False,
    **method_kwargs: Any,
) -> RunConfig:
    """The validated `RunConfig` that `create_optimizer` builds from (arguments as there).

    The factorization section is read from the model (`factor_config`), so the trainer's rules
    that depend on it (ReLoRA merges, which pairs are refactorized) apply unchanged.

    Raises:
        effpretrain.errors.ConfigError (a ValueError): a value out of range or an unknown method,
            naming the config key and the choices.
    """
    cfg = RunConfig(
        method=method,
        factor=factor_config(model),
        optim=OptimConfig(
            name=method,
            lr=float(lr),
            weight_decay=float(weight_decay),
            beta1=float(betas[0]),
            beta2=float(betas[1]),
            eps=None if eps is None else float(eps),
            rank=int(rank),
            update_proj_gap=int(update_proj_gap),
            scale=float(scale),
            proj_type=proj_type,
            basis=basis,
            targets=list(ATTN_MLP_TARGETS if targets is None else targets),
            extra=dict(method_kwargs),
        ),
        train=TrainConfig(
            max_steps=int(num_training_steps),
            warmup_ratio=float(warmup_ratio),
            min_lr_ratio=float(min_lr_ratio),
            schedule=schedule,
            update_in_backward=bool(update_in_backward),
        ),
        restarts=RestartsConfig(
            every=int(restarts_every),
            refactorize=refactorize,
            reset_momentum=reset_momentum,
            recovery_steps=int(recovery_steps),
        ),
    )
    return validate(cfg, "create_optimizer")


# ----------------------------------------------------------------------------------------------
# Optimizer factory


def create_optimizer(
    model: torch.nn.Module,
    method: str,
    *,
    num_training_steps: int,
    lr: float,
    weight_decay: float = 0.0,
    warmup_ratio: float = 0.1,
    min_lr_ratio: float = 0.1,
    schedule: str = "cosine",
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float | None = None,
    rank: int = 128,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    proj_type: str = "std",
    basis: str = "default",
    targets: Sequence[str] | None = None,
    restarts_every: int = 0,
    refactorize: bool = True,
    reset_momentum: bool = True,
    recovery_steps: int = 10,
    update_in_backward: bool = False,
    **method_kwargs: Any,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """Builds ``(optimizer, lr_scheduler)`` for ``Trainer(optimizers=...)`` the way the trainer does.

    Param groups follow the trainer's rules (attention/MLP linear weights named in `targets` are
    projected by projection methods; other matrices get weight decay; vectors get none; frozen
    parameters are left out). The schedule is the trainer's `lr_factor`: linear warmup over
    ``warmup_ratio * num_training_steps`` updates, then cosine / linear / constant to
    ``min_lr_ratio * lr``, times the restart recovery ramp when restarts reset momentum.

    Call it after model surgery (`apply_factorization`) and pass the Trainer's ``max_steps`` as
    `num_training_steps`.

    Args:
        model: the model to train (its trainable parameters are grouped).
        method: an optimizer name from the registry `optimizers.METHODS`.
        num_training_steps: optimizer updates in the run (the schedule's length).
        lr: peak learning rate (eta).
        weight_decay: decoupled weight decay (lambda) for matrices.
        warmup_ratio: fraction of updates spent in linear warmup.
        min_lr_ratio: final LR as a fraction of `lr`.
        schedule: "cosine", "linear" or "constant" after warmup.
        betas: Adam's (beta1, beta2).
        eps: Adam's epsilon; None: the method's reference value (its class default).
        rank: projection rank r (projection methods).
        update_proj_gap: basis refresh period T (projection methods).
        scale: projected update scale alpha (projection methods).
        proj_type: projection side, as galore-torch (`optimizers.projection.PROJ_TYPES`).
        basis: "default" (the method's own) or a basis of `optimizers.projection.METHODS`.
        targets: attribute names of the Linear layers a projection method projects.
        restarts_every: T of the benchmark's restarts (0: none); the optimizer is then the
            `optimizers.Restarts` wrapper.
        refactorize: re-split factor pairs at restarts (Low-Rank and SLTrain models).
        reset_momentum: zero Adam moments and step counters at restarts.
        recovery_steps: length R of the LR ramp after each restart.
        update_in_backward: update each parameter (LORO: each factor pair) inside backward as
            soon as its gradient is final and free the gradient (`effpretrain.in_backward`, as
            ``train.update_in_backward``). Needs `EffPretrainCallback` in the Trainer's callbacks,
            which marks the micro-batches of the Trainer's gradient accumulation, maps
            ``max_grad_norm`` to the previous-step-norm clipping rule and logs the real
            ``grad_norm``; one process only, no fp16 (GradScaler) and no DeepSpeed.
        **method_kwargs: extra constructor options of the method (``optim.extra`` of a recipe),
            e.g. ``gamma1=0.85`` for stable_spam, ``oversample=8`` for randomized bases.

    Returns:
        The optimizer (a `Restarts` wrapper with ``restarts_every > 0``) and its LambdaLR.

    Raises:
        ValueError: unknown method (naming the choices), values out of range, or a projection
            method whose `targets` match no linear weight.
        RuntimeError: (at the Trainer's first optimizer step) ``update_in_backward`` without
            `EffPretrainCallback` in the Trainer.
    """
    cfg = build_run_config(
        model,
        method,
        num_training_steps=num_training_steps,
        lr=lr,
        weight_decay=weight_decay,
        warmup_ratio=warmup_ratio,
        min_lr_ratio=min_lr_ratio,
        schedule=schedule,
        betas=betas,
        eps=eps,
        rank=rank,
        update_proj_gap=update_proj_gap,
        scale=scale,
        proj_type=proj_type,
        basis=basis,
        targets=targets,
        restarts_every=restarts_every,
        refactorize=refactorize,
        reset_momentum=reset_momentum,
        recovery_steps=recovery_steps,
        update_in_backward=update_in_backward,
        **method_kwargs,
    )
    opt, sched = build_optimizer_and_schedule(model, cfg)
    _CONFIGS[opt] = cfg
    if update_in_backward:
        _attach_in_backward(model, opt)
    return opt, sched


def _attach_in_backward(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    # max_norm comes from TrainingArguments.max_grad_norm when the callback starts driving it.
    engine = InBackward(model.parameters(), opt)
    _ENGINES[opt] = weakref.ref(engine)

    def require_callback(*_: Any) -> None:
        # Without the callback no micro-batch is marked: the hooks stay idle, every gradient is
        # kept and this step would quietly be the normal one.
        if engine not in _DRIVEN:
            raise RuntimeError(
                "create_optimizer(update_in_backward=True) needs EffPretrainCallback() in the Trainer's "
                "callbacks (it marks the micro-batches and logs the real gradient norm)"
            )

    unwrap_optimizer(opt).register_step_pre_hook(require_callback)


# ----------------------------------------------------------------------------------------------
# Looking through optimizer wrappers (Accelerate's AcceleratedOptimizer, Restarts)


def _chain(optimizer: Any) -> list[torch.optim.Optimizer]:
    out: list[torch.optim.Optimizer] = []
    while isinstance(optimizer, torch.optim.Optimizer) and all(o is not optimizer for o in out):
        out.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return out


def _find_restarts(optimizer: Any) -> Restarts | None:
    return next((o for o in _chain(optimizer) if isinstance(o, Restarts)), None)


def _engine_of(optimizer: Any) -> InBackward | None:
    ref = next((_ENGINES[o] for o in _chain(optimizer) if o in _ENGINES), None)
    return ref() if ref is not None else None


def _config_of(optimizer: Any) -> RunConfig | None:
    return next((_CONFIGS[o] for o in _chain(optimizer) if o in _CONFIGS), None)


def _method_of(optimizer: Any) -> str | None:
    """The registry name of the optimizer that owns the state, if it is a registered class."""
    cfg = _config_of(optimizer)
    if cfg is not None:
        return cfg.optim.name
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    cls = type(unwrap_optimizer(optimizer))
    # Compared by name first, so that no other registered class (or its backend) is imported.
    return next(
        (n for n, s in optimizers.METHODS.items() if s.class_name == cls.__name__ and s.cls is cls), None
    )


# ----------------------------------------------------------------------------------------------
# Memory


def _preset_of(model: torch.nn.Module) -> str | None:
    """The preset whose LlamaForCausalLM shapes `model` has (any vocabulary size), if one does."""
    c = getattr(model, "config", None)
    if getattr(c, "model_type", None) != "llama":
        return None
    if c.tie_word_embeddings or getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        return None
    if getattr(c, "num_key_value_heads", c.num_attention_heads) != c.num_attention_heads:
        return None
    shape = (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_hidden_layers)
    return next(
        (n for n, p in PRESETS.items() if (p.hidden, p.intermediate, p.heads, p.layers) == shape), None
    )


def _dtype_name(model: torch.nn.Module, bf16_autocast: bool) -> str | None:
    dtype = next(model.parameters()).dtype
    if dtype == torch.bfloat16:
        return "bf16-pure"
    if dtype == torch.float32:
        return "bf16-mixed" if bf16_autocast else "fp32"
    return None


def _optim_config_from_groups(method: str, optimizer: torch.optim.Optimizer | None) -> OptimConfig:
    # Without a RunConfig, the projection settings are read back from a projected group.
    o = OptimConfig(name=method)
    groups = unwrap_optimizer(optimizer).param_groups if optimizer is not None else []
    g = next((g for g in groups if g.get("project") or g.get("rank") is not None), None)
    if g is not None:
        o.rank, o.update_proj_gap = int(g["rank"]), int(g.get("update_proj_gap", o.update_proj_gap))
        o.scale, o.proj_type = float(g.get("scale", o.scale)), g.get("proj_type", o.proj_type)
    return o


def estimate_memory(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    bf16_autocast: bool = False,
    batch_size: int = 1,
    seq_len: int | None = None,
    activation_checkpointing: int = 0,
    grad_accum: int = 1,
    grad_clip: float = 0.0,
) -> memory.Estimate:
    """The analytic memory estimate for training `model` with `optimizer`, in bytes (one process).

    When the model is a LLaMA with a preset's shapes (any vocabulary size, fp32 or bf16) this is
    `effpretrain.memory.estimate`, the same numbers as ``effpretrain estimate`` and a run's
    summary.json, activations included (when `seq_len` is known). Otherwise weights, gradients and
    optimizer state are derived from the model's actual parameters and the optimizer's actual
    param groups with the same per-method formulas (`optimizers.state_bytes`); activations are not
    estimated (0, ``detail["activations"] == "unknown"``). ``detail["source"]`` says which.

    Args:
        model: the model (after any factorization).
        optimizer: its optimizer (possibly wrapped); None or an unregistered class leaves the
            optimizer state out (0, ``detail["optimizer_state"] == "unknown"``).
        bf16_autocast: fp32 weights trained under bf16 autocast (TrainingArguments(bf16=True)).
        batch_size: sequences per process per micro-step.
        seq_len: tokens per sequence; None leaves activations out.
        activation_checkpointing: checkpoint every k-th decoder layer (0: off).
        grad_accum: micro-batches per update (held gradients; in backward: the accumulators).
        grad_clip: the clipping threshold (in backward, 0 allows GaLore's low-rank accumulators).

    An optimizer from ``create_optimizer(..., update_in_backward=True)`` gets the in-backward
    gradient terms (preset models; `effpretrain.memory.estimate`).
    """
    cfg = _config_of(optimizer)
    method = _method_of(optimizer)
    preset, dtype = _preset_of(model), _dtype_name(model, bf16_autocast)
    if preset is not None and dtype is not None and method is not None:
        f = factor_config(model)
        est = memory.estimate(
            preset,
            method,
            dtype=dtype,
            vocab_size=model.config.vocab_size,
            optim_cfg=cfg.optim if cfg is not None else _optim_config_from_groups(method, optimizer),
            factor_kind=f.kind,
            factor_rank=f.rank,
            density=f.density,
            factor_targets=f.targets,
            batch_size=batch_size,
            seq_len=seq_len or 1,
            activation_checkpointing=activation_checkpointing,
            grad_accum=grad_accum,
            update_in_backward=_engine_of(optimizer) is not None,
            grad_clip=grad_clip,
        )
        est.detail["source"] = f"preset:{preset}"
        if seq_len is None:
            est = dataclasses.replace(est, activations=0, detail={**est.detail, "activations": "unknown"})
        return est

    params = list(model.parameters())
    weights = memory.tensor_bytes(params)
    for module in model.modules():  # persistent buffers such as SLTrain's sparse index are weights too
        weights += memory.tensor_bytes(
            b
            for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set
        )
    trainable = [p for p in params if p.requires_grad]
    state, detail = 0, {"source": "parameters", "method": method, "activations": "unknown"}
    if method is not None and optimizer is not None:
        for group in unwrap_optimizer(optimizer).param_groups:
            for p in group["params"]:
                state += optimizers.state_bytes(method, tuple(p.shape), group, p.dtype)
    else:
        detail["optimizer_state"] = "unknown"
    return memory.Estimate(
        weights=weights,
        grads=memory.tensor_bytes(trainable),
        optimizer_state=state,
        activations=0,
        params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in trainable),
        detail=detail,
    )


def _estimate_fields(est: memory.Estimate) -> dict[str, int]:
    fields = {"est_weights_bytes": est.weights, "est_grads_bytes": est.grads}
    if est.detail.get("optimizer_state") != "unknown":
        fields["est_optimizer_state_bytes"] = est.optimizer_state
    if est.detail.get("activations") != "unknown":
        fields["est_activations_bytes"] = est.activations
    fields["est_total_bytes"] = est.total
    return fields


def _ppl(loss: float) -> float:
    # The trainer's convention: exp of the mean token loss, capped so a diverged run logs a number.
    return math.exp(min(float(loss), 50.0))


def _in_backward_refusal(args: Any) -> str | None:
    """Why the Trainer set up by `args` cannot update parameters inside backward (None: it can)."""
    if getattr(args, "deepspeed", None):
        return "DeepSpeed partitions the gradients and runs the optimizer step itself"
    if getattr(args, "fp16", False):
        return (
            "fp16's GradScaler unscales and checks the gradients only at optimizer.step(), so the "
            "parameters would step on scaled gradients; use bf16"
        )
    if getattr(args, "world_size", 1) > 1:
        return (
            f"{args.world_size} processes: the Trainer's DDP/FSDP reduce gradients after the per-parameter "
            "hooks have stepped; one process only"
        )
    if getattr(args, "n_gpu", 0) > 1:
        return f"DataParallel over {args.n_gpu} GPUs replicates the model at every forward; use one device"
    return None


def _seq_len_of(dataloader: Any) -> int | None:
    # Pretraining rows have one length; indexing a map-style dataset draws no random numbers.
    try:
        row = dataloader.dataset[0]
        return int(len(row["input_ids"]))
    except Exception:
        return None


# ----------------------------------------------------------------------------------------------
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
    first parameter steps, and refusing c > 0 would refuse the Trainer's default (1.0).

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
        if why:
            raise ConfigError(f"create_optimizer(update_in_backward=True): {why}")
        self._inb = engine
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

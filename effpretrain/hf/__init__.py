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
and applies ``max_grad_norm`` with the engine's previous-step-norm rule. Under several processes
(torchrun, DDP) call ``prepare_trainer(trainer)`` before ``trainer.train()``: Accelerate then
prepares the model without a DDP wrapper (no reducer reducing again after the hooks have stepped,
no buckets holding a second copy of the gradients), the callback starts every rank from rank 0's
weights and each final gradient is averaged over the ranks in its own hook, one all-reduce per
parameter (`effpretrain.in_backward.AllReduceMean`, as ``dist.sharding=ddp`` of
``effpretrain train``); the order of those all-reduces is checked after every update (a graph
that differs between ranks is an error). ``max_grad_norm`` then clips with the previous step's
norm of the averaged gradients, the same number on every rank. DeepSpeed, FSDP, fp16 (GradScaler)
and DataParallel are refused.
"""

from effpretrain.hf.callback import EffPretrainCallback, prepare_trainer
from effpretrain.hf.estimate import estimate_memory
from effpretrain.hf.factory import FactorySettings, build_run_config, create_optimizer, factor_config
from effpretrain.hf.registry import _find_restarts as _find_restarts  # the tests read it
from effpretrain.models.factorized import apply_factorization

__all__ = [
    "EffPretrainCallback",
    "FactorySettings",
    "apply_factorization",
    "build_run_config",
    "create_optimizer",
    "estimate_memory",
    "factor_config",
    "prepare_trainer",
]

"""The training loop: Accelerate, gradient accumulation, clipping, events, eval, checkpoints.

Read top to bottom: `train()` builds a `Trainer` from a RunConfig (its set-up steps: processes and
launch mode, data, model, optimizer, checkpointer, resume) and runs `Trainer.fit()`, a loop of
named steps (train step, log, maybe evaluate, maybe save) and then a finish (final eval,
checkpoint, summary). One optimizer step = ``grad_accum`` micro-batches per process; the loss is
the token-weighted mean over the whole global batch (every rank, every micro-batch), so the
gradient does not depend on how the batch is split across micro-steps or processes. What differs
between one process, DDP, DDP with updates in backward and FSDP2 is the launch mode's
(`effpretrain.launch`), chosen once; the loop does not branch on it. docs/architecture.md names
the module for each stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch

import optimizers
from effpretrain import data as data_mod
from effpretrain import evaluation, flops, memory, optim_setup
from effpretrain.checkpoint import Checkpointer, find_resume
from effpretrain.checkpoint import complete_checkpoints as _complete_checkpoints
from effpretrain.compile import COMPILE_WARMUP_STEPS, check_compilable, compile_seconds
from effpretrain.config import RunConfig, dump_yaml
from effpretrain.config.checks import stochastic_rounding
from effpretrain.determinism import deterministic
from effpretrain.errors import ConfigError
from effpretrain.evaluation import EvalResult, evaluate_checkpoint
from effpretrain.in_backward import InBackward
from effpretrain.launch import check_launch, choose_launch, make_accelerator
from effpretrain.loss import token_loss_sum
from effpretrain.memory import measure, preflight
from effpretrain.models.factorized import end_warm_start_, factor_spec, warming_up
from effpretrain.models.pretrained import load_shards_, meta_model, open_pretrained
from effpretrain.optim_setup import build_optimizer_and_schedule, opt_telemetry, warm_start_steps
from effpretrain.reporting import RunClock, RunReport, build_summary
from effpretrain.run_model import build_run_model, place_model, run_hf_config, run_vocabulary
from effpretrain.run_state import EXACTNESS_KEYS, DataPosition, OptionalPart, Progress, RngState, RunFacts
from effpretrain.signals import StopSignals
from optimizers import writer
from optimizers._sharded import local as _local
from optimizers._streams import DeviceTimer
from optimizers.precision import model_matmuls

__all__ = [
    "EXACTNESS_KEYS",
    "NonFiniteError",
    "Progress",
    "Trainer",
    "check_launch",
    "due",
    "evaluate_checkpoint",
    "memory_steps",
    "train",
]

log = logging.getLogger("effpretrain")


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite steps: a training failure, reported without a traceback."""


class Trainer:
    """Owns the run's objects; `fit()` is the loop."""

    def __init__(
        self,
        cfg: RunConfig,
        out_dir: Path,
        resume: str | None = None,
        allow_config_change: bool = False,
        allow_oversubscribe: bool = False,
    ):
        self.cfg, self.out = cfg, out_dir
        self.compile_s_before = compile_seconds()  # this process's, before this run compiles
        _check_writable_dir(self.out)  # before any work: a run that cannot write is refused now
        self._set_up_processes()
        if not allow_oversubscribe:
            self._preflight()
        # A bad --resume, targets or ranks that cannot work: refused before any work or any write.
        self.resume_path = self._resume_target(resume)
        optim_setup.check_param_groups(cfg)
        # model.init: the source checked (config, files, headers) before any data or model work.
        self.init_weights = None
        if cfg.model.init:
            with self.acc.main_process_first():  # a hub id downloads once, then the others read it
                self.init_weights = open_pretrained(cfg.model.init)[0]
        self._set_up_data()
        self._set_up_model_and_optimizer(self._build_model())
        self.progress = Progress()
        self.grad_bytes = 0  # measured per rank after the first step
        self.grad_bytes_source = "every_trainable_parameter"  # what grad_bytes is (`_grad_bytes`)
        self.memory_steps = set(memory_steps(cfg))
        # One entry per measured step: the per-rank measurements (measure.measure_step).
        self.memory_records: list[list[dict[str, Any]]] = []
        self._measured: dict[str, Any] | None = None  # this step's, until it is reported
        self._saved_step: int | None = None  # the step whose checkpoint this run wrote or resumed
        self._evaluated_step: int | None = None  # the step this run last evaluated
        self.checkpointer = self._checkpointer(allow_config_change)
        if self.resume_path is not None:
            self._load(self.resume_path)
        self._end_warm_start_if_due()  # a run resumed past its switch trains the factors

    # -- set-up steps -------------------------------------------------------------------------
    def _set_up_processes(self) -> None:
        from accelerate.utils import set_seed

        self.acc = make_accelerator(self.cfg, self.out)
        # Device time inside optimizer.step() and the in-backward unit steps, this process.
        self.opt_timer = DeviceTimer(self.acc.device)
        self.launch = choose_launch(self.acc, self.cfg)
        self.rank, self.world, self.is_main = self.launch.rank, self.launch.world, self.launch.is_main
        check_launch(self.world, self.cfg)
        if self.cfg.train.compile:
            try:
                check_compilable(self.acc.device)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        warm_start_steps(self.cfg, self.world)  # refuse an impossible warm start before any work
        set_seed(self.cfg.train.seed)

    def _preflight(self) -> None:
        """Refuses, before any data or model is built, a run whose estimated per-rank peak exceeds
        this process's device memory (`preflight.check_fits`). The vocabulary is the builtin
        tokenizer's configured size, or the preset's for a named tokenizer (not loaded yet)."""
        d = self.cfg.data
        vocab = d.vocab_size if d.tokenizer == "builtin-bpe" else None
        est = memory.estimate_from_config(self.cfg, vocab, self.world, self.launch.sharding)
        preflight.check_fits(est, self.acc.device)

    def _resume_target(self, resume: str | None) -> Path | None:
        path = find_resume(self.out, resume) if resume else None
        if resume is None and _complete_checkpoints(self.out / "checkpoints"):
            raise ConfigError(
                f"{self.out} already holds checkpoints; pass --resume auto or choose another --out"
            )
        return path

    def _set_up_data(self) -> None:
        cfg, train_cfg = self.cfg, self.cfg.train
        with self.acc.main_process_first():
            self.corpus = data_mod.load_corpus(cfg.data)
            self.tok = data_mod.load_tokenizer(cfg.data, self.corpus)
        # The model's vocabulary (a pretrained embedding may be padded past its tokenizer's).
        self.tok = dataclasses.replace(
            self.tok, vocab_size=run_vocabulary(cfg, self.tok.vocab_size, self.tok.name)
        )
        self.stream = data_mod.TokenStream.from_config(self.corpus, self.tok, cfg.data, self.rank, self.world)
        self.batches = data_mod.Batches(
            self.stream,
            train_cfg.batch_size,
            train_cfg.grad_accum,
            self.rank,
            self.world,
            vocab_size=self.tok.vocab_size,
            # Streamed sources: each rank draws its own rows; one all-reduce sums the target counts.
            all_reduce_sum=lambda v: self.acc.reduce(v.to(self.acc.device), reduction="sum"),
        )
        # Read once: every evaluation runs on these rows, the same for any number of processes.
        self.val = data_mod.validation_set(
            self.corpus, self.tok, cfg.data.seq_len, cfg.data.mode, train_cfg.eval_tokens
        )

    def _build_model(self) -> torch.nn.Module:
        if self.init_weights is not None and self.launch.sharding == "fsdp2":
            return self._load_shards()
        if self.init_weights is None:
            model, self.factor_report = build_run_model(self.cfg, self.tok.vocab_size)
        else:  # the load's peak, by the tensor accounting (summary.json's init_load)
            with memory.accounting() as acc:
                model, self.factor_report = build_run_model(self.cfg, self.tok.vocab_size, self.init_weights)
            self._note_load_peak(acc)
        model = place_model(model, self.cfg, self.acc.device, self._checkpointed_layers())
        return self.launch.shard(model)  # FSDP2 before the optimizer: fully_shard replaces parameters

    def _load_shards(self) -> torch.nn.Module:
        """`model.init` under FSDP2: the model placed and sharded on the meta device, then each
        rank allocates its shards and reads only its rows (`load_shards_`); no rank holds the
        whole model (config checks refuse the settings this path lacks: surgery, INT8)."""
        assert self.init_weights is not None
        self.factor_report = None
        model = meta_model(run_hf_config(self.cfg, self.tok.vocab_size))
        model = self.launch.shard(place_model(model, self.cfg, self.acc.device, self._checkpointed_layers()))
        with memory.accounting() as acc:
            self.init_weights.report = load_shards_(model, self.init_weights, self.acc.device)
        self._note_load_peak(acc)
        return model

    def _note_load_peak(self, acc: Any) -> None:
        assert self.init_weights is not None and self.init_weights.report is not None
        self.init_weights.report.peak_bytes = acc.replay(include_existing=False)[0]

    def _checkpointed_layers(self) -> int | list[int]:
        """`train.activation_checkpointing`; for ``auto`` the estimator's plan, logged."""
        train_cfg = self.cfg.train
        if train_cfg.activation_checkpointing != "auto":
            return train_cfg.activation_checkpointing
        layers, est = memory.plan_checkpointing(
            self.cfg, self.tok.vocab_size, self.world, self.launch.sharding
        )
        log.info(
            "activation_checkpointing=auto: layers %s within %g GB (estimated peak %.3f GB)",
            layers,
            train_cfg.memory_budget_gb,
            est.peak / 1e9,
        )
        return layers

    def _set_up_model_and_optimizer(self, model: torch.nn.Module) -> None:
        # Weights stored in fewer bits than fp32 round each update once (`optimizers.writer`):
        # stochastically with noise keyed by the seed, the parameter's index and the step.
        self.rounding = writer.Rounding(stochastic_rounding(self.cfg), seed=self.cfg.train.seed)
        writer.attach(list(enumerate(self.launch.unwrap(model).parameters())), self.rounding)
        opt, self.sched = build_optimizer_and_schedule(model, self.cfg)
        self.inner_opt = opt
        self.in_backward: InBackward | None = None
        self.model, self.opt = self.launch.wrap(model, opt)
        self._set_up_in_backward()

    def _set_up_in_backward(self) -> None:
        """`train.update_in_backward`: the hooks that step each parameter inside backward, on the
        parameters that train now (again after a warm start's switch); the launch mode says what
        a hook does to a final gradient first (DDP: average it over the ranks)."""
        if not self.cfg.train.update_in_backward:
            return
        prev = self.in_backward.prev_norm if self.in_backward is not None else None
        if self.in_backward is not None:
            self.in_backward.remove()
        model = self.launch.unwrap(self.model)
        reduce = self.launch.in_backward_reduce(model)
        self.in_backward = InBackward.for_run(
            list(model.parameters()), self.inner_opt, self.cfg.train, reduce
        )
        self.in_backward.prev_norm = prev
        self.in_backward.timer = self.opt_timer

    def _checkpointer(self, allow_config_change: bool) -> Checkpointer:
        """The run's checkpoints as named parts (`effpretrain.checkpoint.states`)."""
        parts = {
            "run": RunFacts(self.cfg, self.world, self.launch.sharding, allow_config_change),
            "scheduler": self.sched,
            "in_backward": OptionalPart(lambda: self.in_backward),
            "data": DataPosition(self.stream, self.launch),
            "rng": RngState(),
            "progress": self.progress,
        }
        return Checkpointer(
            self.out / "checkpoints",
            self.launch,
            parts,
            model=lambda: self.model,
            opt=self.inner_opt,
            config_yaml=lambda: dump_yaml(self.cfg),
            keep=self.cfg.train.keep_checkpoints,
        )

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimizer step over all processes: batch x accumulation x world x seq_len."""
        train_cfg = self.cfg.train
        return train_cfg.batch_size * train_cfg.grad_accum * self.world * self.cfg.data.seq_len

    # -- the loop -----------------------------------------------------------------------------
    def fit(self, stop: StopSignals | None = None) -> dict[str, Any]:
        """Trains to `train.max_steps`, or to a signal, and returns the run's summary.

        Args:
            stop: the signal policy already installed by `train()` (start-up included); None
                installs one for this call.

        Returns:
            The summary (also written to summary.json), or ``{"stopped_by_signal": signum,
            "step": n}`` after a graceful stop on a first SIGTERM/SIGINT (checkpoint saved).

        Raises:
            NonFiniteError: `train.max_consecutive_skips` non-finite steps in a row.
            effpretrain.signals.RunInterrupted: a second signal (no checkpoint).
        """
        progress, max_steps = self.progress, self.cfg.train.max_steps
        signals = contextlib.nullcontext(stop) if stop is not None else StopSignals()
        with (
            signals as stop,
            RunReport(
                self.acc,
                self.cfg,
                self.out,
                progress.step,
                flops.run_flops_per_token(self.cfg, self.tok.vocab_size, self.world),
            ) as report,
        ):
            clock, last_val = RunClock(start_tokens=progress.tokens), None
            if self.cfg.model.init and progress.step == 0:
                last_val = self._evaluate_now(report)  # the source model's loss, before any step
            self.model.train()
            stop.enter_loop()
            while not (stopped := self._stop_agreed(stop)) and progress.step < max_steps:
                loss, gnorm, finite = self._timed_step(clock)
                self._report_memory(report)
                if not finite:
                    self._skip(report, loss, gnorm)
                    continue
                self._count_step()
                self._end_warm_start_if_due()
                self._log_step(report, clock, loss, gnorm)
                last_val = self._maybe_evaluate(report) or last_val
                self._maybe_save()
                report.advance(loss, clock.tokens_per_s(progress.tokens))
            report.close_progress()
            if stopped:
                return self._stop_on_signal(stop.requested or stop.agreed)
            return self._finish(report, clock, last_val)

    def _stop_agreed(self, stop: StopSignals) -> bool:
        """Whether to leave the loop for a signal. A stop asked of any process stops all of them
        at the same step (a signal can reach the ranks on either side of a step boundary)."""
        agreed = self.launch.agree_max(stop.requested or 0)
        if agreed and stop.requested is None:
            stop.agreed = agreed  # not `requested`: this process's own first signal stays graceful
        return agreed != 0

    def _timed_step(self, clock: RunClock) -> tuple[float, float, bool]:
        clock.start_step()
        step = self.progress.step + 1
        if step in self.memory_steps:
            out = self._measured_step(step)
        else:
            out = self._train_step()
        if not self.grad_bytes:
            self.grad_bytes = self._grad_bytes()
        clock.end_step()
        return out

    def _measured_step(self, step: int) -> tuple[float, float, bool]:
        """`_train_step` under `measure.measure_step` (hooks on for this step only)."""
        result: dict[str, Any] = {}
        self._measured = measure.measure_step(
            lambda: result.setdefault("step", self._train_step()),
            self.model,
            self.inner_opt,
            step=step,
            in_backward=self.in_backward,
        )
        return result["step"]

    def _report_memory(self, report: RunReport) -> None:
        """Writes the step's measured memory (every rank's: gathered, all ranks measure the same
        steps) beside the estimate to metrics.jsonl, and keeps it for summary.json."""
        if self._measured is None:
            return
        ranks, self._measured = self.launch.gather(self._measured), None
        self.memory_records.append(ranks)
        est = memory.estimate_from_config(self.cfg, self.tok.vocab_size, self.world, self.launch.sharding)
        rec = {"event": "memory", "step": ranks[0]["step"], "measured": ranks[0], "estimate": est.as_dict()}
        if len(ranks) > 1:
            rec["ranks"] = ranks
        report.write(rec)

    def _telemetry(self) -> dict[str, Any]:
        """The optimizer's telemetry over the run's processes (a collective under FSDP2)."""
        return self.launch.telemetry(opt_telemetry(self.inner_opt))

    def _skip(self, report: RunReport, loss: float, gnorm: float) -> None:
        """Records a non-finite step (nothing advanced) and stops after too many in a row."""
        progress = self.progress
        progress.skipped += 1
        progress.consecutive_skips += 1
        log.warning("step %d: non-finite loss/grad norm, optimizer step skipped", progress.step + 1)
        report.write({"event": "skip", "step": progress.step, "loss": loss, "grad_norm": gnorm})
        if progress.consecutive_skips >= self.cfg.train.max_consecutive_skips:
            raise NonFiniteError(
                f"{progress.consecutive_skips} consecutive non-finite steps at step {progress.step}; "
                "stopping (the last good checkpoint is kept)"
            )

    def _count_step(self) -> None:
        progress = self.progress
        progress.consecutive_skips = 0
        progress.step += 1
        progress.tokens += self.tokens_per_step

    def _end_warm_start_if_due(self) -> None:
        """The warm start's switch, once `factor.warm_start_steps` steps are done (right after that
        step, or on resuming past it): W0 frozen with its optimizer state freed, B and A trainable
        (`end_warm_start_`); the launch mode wraps the model again where its wrapper reduces only
        what required grad when it wrapped (DDP)."""
        n = self.cfg.factor.warm_start_steps
        model = self.launch.unwrap(self.model)
        if not n or self.progress.step < n or not warming_up(model):
            return
        end_warm_start_(model, self.inner_opt)
        # Measured again in the factor phase, the one the summary describes (also after a resume).
        self.grad_bytes = 0
        self.model = self.launch.rewrap(self.model)
        self._set_up_in_backward()
        log.info("step %d: warm start done, training the factors from here", self.progress.step)

    def _log_step(self, report: RunReport, clock: RunClock, loss: float, gnorm: float) -> None:
        progress, train_cfg = self.progress, self.cfg.train
        if progress.step % train_cfg.log_every and progress.step != train_cfg.max_steps:
            return
        report.write(
            {
                "step": progress.step,
                "tokens": progress.tokens,
                "loss": loss,
                "lr": self.sched.get_last_lr()[0],
                "grad_norm": gnorm,
                "tokens_per_s": self.tokens_per_step / max(clock.since_step_start(), 1e-9),
                "peak_memory_bytes": measure.process_peak_bytes(self.acc.device),
                "optimizer_state_bytes": optimizers.measured_state_bytes(self.inner_opt),
                **self._telemetry(),
                "opt/step_s": self.opt_timer.seconds(),
            }
        )

    def _maybe_evaluate(self, report: RunReport) -> EvalResult | None:
        """Evaluates when `due` (every `train.eval_every` steps and at the last); None otherwise."""
        progress = self.progress
        if not due(self.cfg.train.eval_every, progress.step, self.cfg.train.max_steps):
            return None
        return self._evaluate_now(report)

    def _evaluate_now(self, report: RunReport) -> EvalResult:
        progress = self.progress
        val = self.evaluate()
        self._evaluated_step = progress.step
        report.write({"event": "eval", "step": progress.step, "tokens": progress.tokens, **val.record()})
        report.note(f"step {progress.step}: val_loss {val.loss:.4f}  val_ppl {val.ppl:.2f}")
        return val

    def _maybe_save(self) -> None:
        """Saves when `due` (every `train.save_every` steps and at the last)."""
        if due(self.cfg.train.save_every, self.progress.step, self.cfg.train.max_steps):
            self.save()

    def _stop_on_signal(self, signum: int | None) -> dict[str, Any]:
        if self._saved_step != self.progress.step:
            # Not when this step is already on disk (just saved, or resumed from): a re-save would
            # replace the newest checkpoint, and a second signal during it could lose it.
            self.save()
        log.info("stopped by signal %s at step %d; resume with --resume auto", signum, self.progress.step)
        return {"stopped_by_signal": signum, "step": self.progress.step}

    def _finish(self, report: RunReport, clock: RunClock, last_val: EvalResult | None) -> dict[str, Any]:
        """Final evaluation and checkpoint (unless the loop's last step had them: a resume at
        `train.max_steps` has neither), summary."""
        progress = self.progress
        if last_val is None or self._evaluated_step != progress.step:
            last_val = self.evaluate()
        if self._saved_step != progress.step:
            self.save()
        summary = build_summary(
            self.cfg,
            self.acc,
            self.model,
            self.inner_opt,
            progress=progress,
            val=last_val,
            clock=clock,
            grad_bytes=self.grad_bytes,
            grad_bytes_source=self.grad_bytes_source,
            memory_records=self.memory_records,
            telemetry=self._telemetry(),
            state_ranks=self.launch.gather(optimizers.measured_state_bytes(self.inner_opt)),
            vocab_size=self.tok.vocab_size,
            sharding=self.launch.sharding,
            compile_s=compile_seconds() - self.compile_s_before if self.cfg.train.compile else 0.0,
        )
        if self.init_weights is not None and self.init_weights.report is not None:
            # Per rank: what each read and held while loading (under FSDP2, its shards only).
            summary["init_load"] = self.launch.gather(self.init_weights.report.record())
        report.finish(summary)
        return summary

    def _train_step(self) -> tuple[float, float, bool]:
        """Accumulates one global batch, finishes it (clipping, or the in-backward engine's end of
        the step), steps; returns (loss, grad_norm, finite).

        With `train.update_in_backward` the parameters were already updated inside the backward
        passes (`effpretrain.in_backward`); what is left is the wrapper's bookkeeping (restarts),
        which ``optimizer.step()`` runs on no gradients, and the schedule."""
        snap = self.stream.snapshot()
        self.rounding.step = self.progress.step + 1  # the step whose updates land now (in backward too)
        loss = self._forward_backward()
        gnorm, finite = self.launch.finish_step(self.model, self.in_backward, loss)
        if self.in_backward is not None:
            if self.in_backward.skipped:
                log.warning(
                    "step %d: %d parameters with non-finite gradients were not updated",
                    self.progress.step + 1,
                    self.in_backward.skipped,
                )
        if finite:
            with self.opt_timer:
                self.opt.step()
            self.sched.step()
        else:
            # Nothing advances on a skipped step: not the schedule, the optimizer, nor the data.
            self.stream.restore(snap)
        self.opt.zero_grad(set_to_none=True)
        return loss, gnorm, finite

    def _forward_backward(self) -> float:
        """The global batch's micro-steps (forward and backward each); its token-mean loss."""
        micro, n_targets = self.batches.next_step()
        dev, K = self.acc.device, len(micro)
        n_targets = max(n_targets, 1)  # an all-padding batch contributes zero loss, never NaN
        loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
        for k, mb in enumerate(micro):
            mb = {key: v.to(dev) for key, v in mb.items()}
            last = k == K - 1
            if self.in_backward is not None:
                self.in_backward.begin_micro(k, K)
            sync = self.launch.micro_sync(self.model, last, self.in_backward is not None)
            with sync, self.acc.autocast():
                train_cfg = self.cfg.train
                s, _ = token_loss_sum(
                    self.model,
                    mb,
                    self.cfg.data.mode == "pack",
                    loss=train_cfg.loss,
                    chunk_tokens=train_cfg.loss_chunk_tokens,
                )
                # DDP and FSDP2 average gradients over ranks: scale so the result is the global token mean.
                self.acc.backward(s * (self.world / n_targets))
            loss_sum += s.detach()
        return self.acc.reduce(loss_sum, reduction="sum").item() / n_targets

    def _grad_bytes(self) -> int:
        """Gradient bytes per rank (a sharded parameter's gradient is its local shard): every
        trainable parameter's; with `train.update_in_backward`, where no moment holds them all,
        this step's measured peak gradient bytes (accumulators and gradients in flight) if it was
        measured, else the estimator's in-backward figure; `grad_bytes_source` says which."""
        if self.in_backward is None:
            self.grad_bytes_source = "every_trainable_parameter"
            return sum(
                _local(q).numel() * q.element_size() for q in self.model.parameters() if q.requires_grad
            )
        if self._measured is not None:
            self.grad_bytes_source = "measured_peak_in_backward"
            return int(self._measured["gradients"])
        self.grad_bytes_source = "estimate_in_backward"
        return memory.estimate_from_config(
            self.cfg, self.tok.vocab_size, self.world, self.launch.sharding
        ).grads

    def evaluate(self) -> EvalResult:
        """Exact token-weighted validation loss over the fixed validation set (`train.eval_tokens`
        target tokens), its perplexity and the benchmark-convention one (`effpretrain.evaluation`),
        with batches of `train.batch_size` rows split across the processes."""
        model, lockstep = self.launch.eval_view(self.model)
        model.eval()
        try:
            return evaluation.evaluate(
                model,
                self.val,
                self.cfg.train.batch_size,
                rank=self.rank,
                world=self.world,
                device=self.acc.device,
                autocast=self.acc.autocast,
                all_reduce_sum=lambda t: self.acc.reduce(t, reduction="sum"),
                lockstep=lockstep,
                loss=self.cfg.train.loss,
                chunk_tokens=self.cfg.train.loss_chunk_tokens,
            )
        finally:
            self.model.train()

    # -- checkpoints --------------------------------------------------------------------------
    def save(self) -> Path | None:
        """Writes this step's checkpoint (`Checkpointer.save`: every process takes part; a failed
        write raises `effpretrain.checkpoint.CheckpointWriteError` on every rank)."""
        path = self.checkpointer.save(self.progress.step)
        self._saved_step = self.progress.step
        return path

    def _load(self, path: Path) -> None:
        self.checkpointer.load(path)
        self._saved_step = self.progress.step  # this step's checkpoint exists
        log.info("resumed from %s at step %d", path, self.progress.step)


def due(every: int, step: int, max_steps: int) -> bool:
    """The one cadence of the loop's periodic events (evaluation, checkpoint): every `every` steps
    (0: none on the way) and at the last step, once."""
    return step == max_steps or (every > 0 and step % every == 0)


def memory_steps(cfg: RunConfig) -> list[int]:
    """The steps whose memory a run measures: `train.memory_steps` when set (as given), else steps
    1 and 2 (the first builds the optimizer state, the second is the first to hold it from the
    start: the steady state), the first basis refresh after them for a projected method (refreshes
    fall on steps 1, T + 1, 2T + 1, ... with T = `optim.update_proj_gap`:
    optimizers/projected_adam.py) and the first restart (the step after whose update it runs:
    `restarts.every`, counted after the warm start for a kind that merges at restarts, as
    `optim_setup.wrap_restarts` sets it up); steps past `train.max_steps` are dropped.

    With `train.compile` the default steps start after the compilation warm-up
    (`effpretrain.compile.COMPILE_WARMUP_STEPS`: steps 2 and 3, no default step before them): the
    first step compiles the blocks, and on CUDA the allocator's peak of that step holds Inductor's
    and Triton's autotuning buffers. The step that builds the optimizer state is then not
    measured (the weights, gradients and state it ends with are step 2's); a basis refresh and a
    restart are measured at their own steps as without compilation."""
    train_cfg = cfg.train
    if train_cfg.memory_steps is not None:
        steps = list(train_cfg.memory_steps)
        first = 1
    else:
        first = 1 + (COMPILE_WARMUP_STEPS if train_cfg.compile else 0)
        steps = [first, first + 1]
        if optimizers.method_spec(cfg.optim.name).projects:
            steps.append(cfg.optim.update_proj_gap + 1)
        if cfg.restarts.every:
            kind = cfg.factor.kind
            merges = kind != "none" and factor_spec(kind).merges_at_restart
            steps.append((cfg.factor.warm_start_steps if merges else 0) + cfg.restarts.every)
    return sorted({s for s in steps if first <= s <= train_cfg.max_steps})


def _check_writable_dir(out: Path) -> None:
    """ConfigError unless `out` is (or can be created as) a directory this process can write."""
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    if existing is not None and (not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK)):
        raise ConfigError(f"--out {out}: {existing} is not a writable directory")


def train(
    cfg: RunConfig,
    out_dir: str | Path,
    resume: str | None = None,
    allow_config_change: bool = False,
    allow_oversubscribe: bool = False,
) -> dict[str, Any]:
    """Runs one training job to completion (or to a signal) and returns its summary.

    SIGTERM/SIGINT follow `effpretrain.signals` from the first line: during start-up they stop at
    once; in the loop the first one finishes the step and saves (the return value is then
    ``{"stopped_by_signal": signum, "step": n}``), a second stops at once. The previous handlers
    are back when this returns or raises.

    `allow_oversubscribe` skips the pre-flight memory check (`Trainer._preflight`).
    `train.deterministic` holds for the whole run and is undone when this returns or raises
    (`effpretrain.determinism`).

    Raises:
        ConfigError: bad config, data, resume target or launch; an estimated peak beyond the
            device's memory.
        NonFiniteError: too many consecutive non-finite steps.
        effpretrain.signals.RunInterrupted: stopped at once by a signal (no checkpoint written).
    """
    # Deterministic kernels (train.deterministic) before anything touches CUDA; train.tf32 governs
    # the model's fp32 products for the run; both restored on the way out.
    with StopSignals() as stop, deterministic(cfg.train.deterministic), model_matmuls(cfg.train.tf32):
        return Trainer(cfg, Path(out_dir), resume, allow_config_change, allow_oversubscribe).fit(stop)

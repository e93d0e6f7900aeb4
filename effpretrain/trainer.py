"""The training loop: Accelerate, gradient accumulation, clipping, schedule, events, eval, checkpoints.

Read top to bottom: `train()` builds everything from a RunConfig, then runs `Trainer.fit()`.
One optimizer step = ``grad_accum`` micro-batches per process; the loss is the token-weighted
mean over the whole global batch (every rank, every micro-batch), so the gradient does not
depend on how the batch is split across micro-steps or processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import optimizers
from effpretrain import checkpoint as ckpt
from effpretrain import data as data_mod
from effpretrain import fsdp, memory
from effpretrain.config import ConfigError, RunConfig, config_hash, dump_yaml, to_dict
from effpretrain.models import build_model, set_activation_checkpointing
from optimizers._sharded import local as _local

log = logging.getLogger("effpretrain")

# Config sections whose change breaks exact resume (issue: resume must refuse them).
EXACTNESS_KEYS = {
    "model": None,
    "factor": None,
    "optim": ("name", "rank", "update_proj_gap", "proj_type", "basis", "targets", "extra"),
    "data": None,
    "train": ("batch_size", "grad_accum", "seed", "precision"),
}


# ----------------------------------------------------------------------------------------------
# Schedule


def restart_ramps(cfg: RunConfig) -> bool:
    """Whether restarts re-warm the LR: after a momentum reset, or after ReLoRA's merge (whose
    factors' state is reset) - the jagged schedule."""
    from effpretrain.models import factor_spec

    r = cfg.restarts
    merges = cfg.factor.kind != "none" and factor_spec(cfg.factor.kind).merges_at_restart
    return r.every > 0 and r.recovery_steps > 0 and (r.reset_momentum or merges)


def lr_factor(step: int, cfg: RunConfig) -> float:
    """LR multiplier for optimizer step `step` (0-based): linear warmup, then cosine/linear/constant
    to `min_lr_ratio`; times the restart recovery ramp when restarts re-warm (`restart_ramps`)."""
    t = cfg.train
    warm = int(t.warmup_ratio * t.max_steps)
    if step < warm:
        f = (step + 1) / warm
    else:
        progress = min(1.0, (step - warm) / max(1, t.max_steps - warm))
        if t.schedule == "cosine":
            f = t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        elif t.schedule == "linear":
            f = 1 - (1 - t.min_lr_ratio) * progress
        else:
            f = 1.0
    if restart_ramps(cfg):
        from optimizers.restarts import recovery_factor

        f *= recovery_factor(step, cfg.restarts.every, cfg.restarts.recovery_steps)
    return f


# ----------------------------------------------------------------------------------------------
# Param groups


def build_param_groups(model: torch.nn.Module, cfg: RunConfig) -> list[dict[str, Any]]:
    """Explicit rules (PAPER.md section 1): attention/MLP linear weights are projected for
    projection methods; every other matrix gets AdamW with weight decay; vectors (norms,
    biases) get no weight decay. Frozen parameters are left out."""
    o = cfg.optim
    spec = optimizers.method_spec(o.name)
    projected_method = spec.projects
    targets = set(o.targets)
    proj, decay, no_decay = [], [], []
    for mod_name, module in model.named_modules():
        attr = mod_name.rsplit(".", 1)[-1]
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if (
                projected_method
                and isinstance(module, torch.nn.Linear)
                and attr in targets
                and pname == "weight"
            ):
                proj.append(p)
            elif p.ndim < 2:
                no_decay.append(p)
            else:
                decay.append(p)
    if projected_method and not proj:
        raise ConfigError(
            f"optim.targets={sorted(targets)} matched no linear weight to project "
            f"(method {o.name}, factor.kind={cfg.factor.kind})"
        )
    for p in proj:
        if spec.fixed_rank is None and o.rank > min(p.shape):
            raise ConfigError(
                f"optim.rank={o.rank} exceeds min(m, n)={min(p.shape)} of a projected {tuple(p.shape)} weight"
            )
    groups = []
    if proj:
        groups.append({"params": proj, "weight_decay": o.weight_decay, **memory.projection_group(o)})
    if decay:
        groups.append({"params": decay, "weight_decay": o.weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def optimizer_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """Constructor keywords: the common Adam settings, `optim.extra` (without the basis options,
    which go to projected groups) and the run length for methods that need it (the registry)."""
    o = cfg.optim
    kw: dict[str, Any] = {
        "lr": o.lr,
        "betas": (o.beta1, o.beta2),
        "eps": o.eps,
        "weight_decay": o.weight_decay,
        **o.extra,
    }
    return optimizers.method_spec(o.name).constructor_kwargs(kw, total_steps=cfg.train.max_steps)


def build_run_model(cfg: RunConfig, vocab_size: int) -> tuple[torch.nn.Module, dict[str, Any] | None]:
    """The fp32 model a run trains: the preset, seeded, plus factorization surgery if configured."""
    max_pos = cfg.model.max_position_embeddings or cfg.data.seq_len
    if cfg.data.seq_len > max_pos:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_position_embeddings={max_pos}")
    model = build_model(cfg.model.preset, vocab_size, max_pos, seed=cfg.train.seed)
    report = None
    if cfg.factor.kind != "none":
        from effpretrain.models import apply_factorization

        try:
            report = apply_factorization(
                model,
                cfg.factor.kind,
                cfg.factor.rank,
                cfg.factor.alpha,
                targets=tuple(cfg.factor.targets),
                density=cfg.factor.density,
                seed=cfg.factor.seed,
            )
        except ValueError as e:
            raise ConfigError(f"factor: {e}") from None
    return model, report


def wrap_restarts(
    opt: torch.optim.Optimizer, model: torch.nn.Module, cfg: RunConfig
) -> torch.optim.Optimizer:
    """The `restarts` section as an optimizer wrapper (shared by the trainer and the HF callback)."""
    from effpretrain.models import factor_pairs, factor_spec, relora_merge_
    from optimizers import Restarts

    r, kind = cfg.restarts, cfg.factor.kind
    spec = factor_spec(kind) if kind != "none" else None
    if spec is not None and spec.merges_at_restart:
        # ReLoRA's restart: merge B A into W0, re-init, reset only B and A's state (jagged LR in lr_factor).
        return Restarts(
            opt,
            [],
            r.every,
            refactorize=False,
            reset_momentum=False,
            hooks=[lambda: relora_merge_(model, opt)],
        )
    pairs = factor_pairs(model) if (r.refactorize and spec is not None and spec.refactorizable) else []
    if r.refactorize and not pairs and kind != "none":
        raise ConfigError(f"restarts.refactorize needs a low-rank factorization (factor.kind={kind})")
    return Restarts(opt, pairs, r.every, refactorize=bool(pairs), reset_momentum=r.reset_momentum)


def opt_telemetry(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Basis refreshes (count, seconds) and restarts, from the optimizer and any wrapper of it."""
    out: dict[str, Any] = {}
    o: Any = opt
    while o is not None:
        if hasattr(o, "refresh_count"):
            out["opt/refreshes"] = int(o.refresh_count)
            out["opt/refresh_s"] = float(getattr(o, "refresh_seconds", 0.0))
        if hasattr(o, "num_restarts"):
            out["opt/restarts"] = int(o.num_restarts)
        o = getattr(o, "optimizer", None)
    return out


# ----------------------------------------------------------------------------------------------
# Loss


def token_loss_sum(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], packed: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token cross-entropies over the batch's targets (fp32), and their count (a tensor,
    so that no device sync is forced).

    `packed` (every position real) lets SDPA take its causal fast path without a mask; None
    checks the mask, which costs a device sync on GPU."""
    mask = batch["attention_mask"]
    if packed is None:
        packed = bool(mask.all())
    attn = None if packed else mask
    logits = model(input_ids=batch["input_ids"], attention_mask=attn).logits
    # Shift the labels, not the logits: a sliced (B, T-1, V) view would cost a full copy of the logits.
    labels = F.pad(batch["labels"][:, 1:], (0, 1), value=data_mod.IGNORE_INDEX)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        labels.reshape(-1),
        ignore_index=data_mod.IGNORE_INDEX,
        reduction="sum",
    )
    return loss, (labels != data_mod.IGNORE_INDEX).sum()


# ----------------------------------------------------------------------------------------------


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


@dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    skipped: int = 0
    consecutive_skips: int = 0


class Trainer:
    """Owns the run's objects; `fit()` is the loop."""

    def __init__(
        self, cfg: RunConfig, out_dir: Path, resume: str | None = None, allow_config_change: bool = False
    ):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.cfg, self.out = cfg, out_dir
        t = cfg.train
        use_cpu = not torch.cuda.is_available()
        trackers = self._trackers()
        self.acc = Accelerator(
            cpu=use_cpu,
            mixed_precision="bf16" if t.precision == "bf16-mixed" else "no",
            log_with=trackers or None,
            project_dir=str(out_dir),
        )
        self.rank, self.world = self.acc.process_index, self.acc.num_processes
        self.is_main = self.acc.is_main_process
        check_launch(self.world, cfg)
        set_seed(t.seed)

        # Resume target first: a bad --resume must fail before any work or any write.
        self.resume_path = ckpt.find_resume(out_dir, resume) if resume else None
        if resume is None and ckpt.complete_checkpoints(out_dir / "checkpoints"):
            raise ConfigError(
                f"{out_dir} already holds checkpoints; pass --resume auto or choose another --out"
            )

        # Data
        with self.acc.main_process_first():
            self.corpus = data_mod.load_corpus(cfg.data)
            self.tok = data_mod.load_tokenizer(cfg.data, self.corpus)
        self.stream = data_mod.TokenStream(
            self.corpus, self.tok, cfg.data.seq_len, cfg.data.mode, cfg.data.shuffle_seed
        )
        self.batches = data_mod.Batches(
            self.stream, t.batch_size, t.grad_accum, self.rank, self.world, vocab_size=self.tok.vocab_size
        )
        n_val = t.eval_batches * t.batch_size * self.world
        self.val = data_mod.validation_rows(self.corpus, self.tok, cfg.data.seq_len, cfg.data.mode, n_val)

        # Model
        model, self.factor_report = build_run_model(cfg, self.tok.vocab_size)
        set_activation_checkpointing(model, t.activation_checkpointing)
        if t.precision == "bf16-pure":
            model = model.to(torch.bfloat16)
        model = model.to(self.acc.device)
        # FSDP2: shard before the optimizer is built, since fully_shard replaces the parameters.
        self.fsdp = self.world > 1 and cfg.dist.sharding == "fsdp2"
        if self.fsdp:
            model = fsdp.apply_fsdp2(model)

        # Optimizer (+ restart events) and schedule
        groups = build_param_groups(model, cfg)
        try:
            opt = optimizers.build_optimizer(cfg.optim.name, groups, **optimizer_kwargs(cfg))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"optim: {e}") from None
        if cfg.restarts.every > 0:
            opt = wrap_restarts(opt, model, cfg)
        self.inner_opt = opt
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
        if self.fsdp:
            # Not through acc.prepare: without Accelerate's FSDP plugin it would wrap in DDP.
            self.model, self.opt = model, opt
        else:
            self.model, self.opt = self.acc.prepare(model, opt)
        if (
            self.world > 1
            and not self.fsdp
            and not isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        ):
            raise ConfigError(
                f"{self.world} processes but the model is not wrapped in DDP (got {type(self.model).__name__})"
            )
        self.progress = Progress()
        self.opt_seconds = 0.0  # wall time inside optimizer.step() (events included), this process
        if self.resume_path is not None:
            self._load(self.resume_path, allow_config_change)

    # -- set-up helpers -----------------------------------------------------------------------
    def _trackers(self) -> list[str]:
        import importlib.util

        for name in self.cfg.train.trackers:
            if importlib.util.find_spec(name) is None:
                raise ConfigError(
                    f"train.trackers: {name} is not installed (pip install 'effpretrain[track]')"
                )
        return list(self.cfg.train.trackers)

    def _sharding(self) -> str:
        return self.cfg.dist.sharding if self.world > 1 else "none"

    # -- checkpoints --------------------------------------------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        p = self.progress
        st = {
            "step": p.step,
            "tokens": p.tokens,
            "skipped": p.skipped,
            "data": self.stream.state_dict(),
            "scheduler": self.sched.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "world_size": self.world,
            "sharding": self._sharding(),
            "config": to_dict(self.cfg),
        }
        if torch.cuda.is_available():
            st["rng_cuda"] = torch.cuda.get_rng_state()
        return st

    def save(self) -> Path | None:
        self.acc.wait_for_everyone()
        path = None
        trainer_state = self._trainer_state()
        root = self.out / "checkpoints"
        if self.fsdp:
            # Every rank writes its own shards into rank 0's temporary folder (DCP); rank 0 then
            # adds trainer.pt (with the optimizer's non-tensor skeleton) and commits the folder.
            import torch.distributed as dist

            box = [str(ckpt.temp_folder(root, self.progress.step)) if self.is_main else None]
            dist.broadcast_object_list(box, src=0)
            tmp = Path(box[0])
            trainer_state["optimizer_skeleton"] = fsdp.save_sharded(tmp / "dcp", self.model, self.inner_opt)
            self.acc.wait_for_everyone()
            if self.is_main:
                path = ckpt.save_checkpoint(
                    root,
                    self.progress.step,
                    None,
                    None,
                    trainer_state,
                    dump_yaml(self.cfg),
                    keep=self.cfg.train.keep_checkpoints,
                    tmp=tmp,
                )
        elif self.is_main:
            path = ckpt.save_checkpoint(
                root,
                self.progress.step,
                self.acc.unwrap_model(self.model).state_dict(),
                self.inner_opt.state_dict(),
                trainer_state,
                dump_yaml(self.cfg),
                keep=self.cfg.train.keep_checkpoints,
            )
        if path is not None:
            log.info("saved checkpoint %s", path)
        self.acc.wait_for_everyone()
        return path

    def _check_compatible(self, saved: dict[str, Any], allow: bool) -> None:
        now = to_dict(self.cfg)
        diffs = []
        for section, keys in EXACTNESS_KEYS.items():
            a, b = saved.get(section, {}), now[section]
            for k in keys or b.keys():
                if a.get(k) != b.get(k):
                    diffs.append(f"{section}.{k}: {a.get(k)!r} -> {b.get(k)!r}")
        if diffs and not allow:
            raise ConfigError(
                "resume config differs in what exact resume depends on ("
                + "; ".join(diffs[:4])
                + "); pass --allow-config-change to resume anyway"
            )

    def _load(self, path: Path, allow_config_change: bool) -> None:
        state = ckpt.load_checkpoint(path)
        tr = state["trainer"]
        self._check_compatible(tr.get("config", {}), allow_config_change)
        if tr.get("world_size", 1) != self.world:
            raise ConfigError(
                f"checkpoint {path} was written by {tr.get('world_size')} processes, this run has {self.world}; "
                "resume with the same number of processes"
            )
        saved_sharding = tr.get("sharding", "ddp" if self.world > 1 else "none")
        if "fsdp2" in (saved_sharding, self._sharding()) and saved_sharding != self._sharding():
            # An FSDP2 checkpoint is sharded (dcp/), the others are whole files: not interchangeable.
            raise ConfigError(
                f"checkpoint {path} was written with dist.sharding={saved_sharding}, this run uses "
                f"{self._sharding()}; resume with the same dist.sharding"
            )
        model = self.acc.unwrap_model(self.model)
        if self.fsdp:
            from torch.distributed.checkpoint.api import CheckpointException

            # Each rank reads its own shards of the model and of the sharded optimizer state.
            try:
                fsdp.load_sharded(path / "dcp", model, self.inner_opt, tr["optimizer_skeleton"])
            except (ValueError, KeyError, RuntimeError, CheckpointException) as e:
                # (CheckpointException is a BaseException: DCP's wrapper of any rank's read error.)
                raise ConfigError(
                    f"checkpoint {path}: sharded state unreadable or does not match ({fsdp.dcp_error(e)})"
                ) from None
        else:
            missing, unexpected = model.load_state_dict(state["model"], strict=False)
            # Non-persistent buffers (rotary inv_freq) are rebuilt, not saved.
            if unexpected or [k for k in missing if k in dict(model.named_parameters())]:
                raise ConfigError(
                    f"checkpoint {path} does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
                )
            try:
                self.inner_opt.load_state_dict(state["optimizer"])
            except (ValueError, KeyError, RuntimeError) as e:
                raise ConfigError(
                    f"checkpoint {path}: optimizer state does not match ({e})".splitlines()[0]
                ) from None
        self.sched.load_state_dict(tr["scheduler"])
        self.stream.load_state_dict(tr["data"])
        torch.set_rng_state(tr["rng_cpu"])
        if "rng_cuda" in tr and torch.cuda.is_available():
            torch.cuda.set_rng_state(tr["rng_cuda"])
        self.progress = Progress(
            step=int(tr["step"]), tokens=int(tr["tokens"]), skipped=int(tr.get("skipped", 0))
        )
        log.info("resumed from %s at step %d", path, self.progress.step)

    # -- eval ---------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Exact token-weighted validation loss over the fixed held-out rows, and exp of it."""
        self.model.eval()
        B, dev = self.cfg.train.batch_size, self.acc.device
        n = self.val["input_ids"].size(0)
        total = torch.zeros(2, dtype=torch.float64, device=dev)
        for lo in range(self.rank * B, n, B * self.world):
            batch = {k: v[lo : lo + B].to(dev) for k, v in self.val.items()}
            with self.acc.autocast():
                s, c = token_loss_sum(self.model, batch)
            total += torch.stack([s.detach().double(), c.double()])
        total = self.acc.reduce(total, reduction="sum")
        self.model.train()
        loss = (total[0] / total[1]).item()
        return loss, math.exp(min(loss, 50.0))

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg, t, p = self.cfg, self.cfg.train, self.progress
        self.out.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            (self.out / "config.yaml").write_text(dump_yaml(cfg))
        if self.acc.trackers:
            self.acc.init_trackers(cfg.method or "effpretrain", config=_flat(to_dict(cfg)))
        metrics_path = self.out / "metrics.jsonl"
        mfile = open(metrics_path, "a") if self.is_main else None
        stop = {"signal": None}

        def on_signal(signum, _frame):  # finish the step, save, exit 0
            stop["signal"] = signum

        old_handlers = {}
        for s in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not in the main thread
                old_handlers[s] = signal.signal(s, on_signal)

        pbar = None
        if self.is_main:
            from tqdm.auto import tqdm

            pbar = tqdm(
                total=t.max_steps,
                initial=p.step,
                desc=cfg.method,
                dynamic_ncols=True,
                file=sys.stderr,
                mininterval=0.5 if sys.stderr.isatty() else 10.0,
            )
        tokens_per_step = t.batch_size * t.grad_accum * self.world * cfg.data.seq_len
        train_time, start_wall = 0.0, time.time()
        start_tokens = p.tokens  # throughput counts only what this process trained (resume-safe)
        last_val: tuple[float, float] | None = None
        grad_bytes = 0
        self.model.train()
        try:
            while p.step < t.max_steps and stop["signal"] is None:
                t0 = time.perf_counter()
                loss, gnorm, finite = self._train_step()
                if not grad_bytes:
                    grad_bytes = self._grad_bytes()
                train_time += time.perf_counter() - t0
                if not finite:
                    p.skipped += 1
                    p.consecutive_skips += 1
                    log.warning("step %d: non-finite loss/grad norm, optimizer step skipped", p.step + 1)
                    self._write(mfile, {"event": "skip", "step": p.step, "loss": loss, "grad_norm": gnorm})
                    if p.consecutive_skips >= t.max_consecutive_skips:
                        raise NonFiniteError(
                            f"{p.consecutive_skips} consecutive non-finite steps at step {p.step}; "
                            "stopping (the last good checkpoint is kept)"
                        )
                    continue
                p.consecutive_skips = 0
                p.step += 1
                p.tokens += tokens_per_step
                tps = (p.tokens - start_tokens) / max(train_time, 1e-9)
                if p.step % t.log_every == 0 or p.step == t.max_steps:
                    rec = {
                        "step": p.step,
                        "tokens": p.tokens,
                        "loss": loss,
                        "lr": self.sched.get_last_lr()[0],
                        "grad_norm": gnorm,
                        "tokens_per_s": tokens_per_step / max(time.perf_counter() - t0, 1e-9),
                        "peak_memory_bytes": memory.peak_memory_bytes(self.acc.device),
                        "optimizer_state_bytes": optimizers.measured_state_bytes(self.inner_opt),
                        **opt_telemetry(self.inner_opt),
                        "opt/step_s": self.opt_seconds,
                    }
                    self._write(mfile, rec)
                if t.eval_every and (p.step % t.eval_every == 0 or p.step == t.max_steps):
                    last_val = self.evaluate()
                    self._write(
                        mfile,
                        {
                            "event": "eval",
                            "step": p.step,
                            "tokens": p.tokens,
                            "val_loss": last_val[0],
                            "val_ppl": last_val[1],
                        },
                    )
                    if self.is_main:
                        tqdm_write(
                            pbar, f"step {p.step}: val_loss {last_val[0]:.4f}  val_ppl {last_val[1]:.2f}"
                        )
                if t.save_every and p.step % t.save_every == 0 and p.step < t.max_steps:
                    self.save()
                if pbar is not None:
                    pbar.update(1)
                    pbar.set_postfix(
                        loss=f"{loss:.3f}",
                        ppl=f"{math.exp(min(loss, 50)):.1f}",
                        tok_s=f"{tps:,.0f}",
                        mem=f"{memory.peak_memory_bytes(self.acc.device) / 2**30:.2f}G",
                    )
        finally:
            if pbar is not None:
                pbar.close()
            for s, h in old_handlers.items():
                signal.signal(s, h)
        if stop["signal"] is not None:
            self.save()
            log.info("stopped by signal %d at step %d; resume with --resume auto", stop["signal"], p.step)
            if mfile:
                mfile.close()
            return {"stopped_by_signal": stop["signal"], "step": p.step}
        if last_val is None or (t.eval_every and p.step % t.eval_every and p.step):
            last_val = self.evaluate()
        self.save()
        summary = self._summary(
            last_val, train_time, time.time() - start_wall, grad_bytes, p.tokens - start_tokens
        )
        if self.is_main:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
            if t.plot:
                plot_run(metrics_path, self.out / "curves.png")
        if mfile:
            mfile.close()
        if self.acc.trackers:
            self.acc.end_training()
        return summary

    def _train_step(self) -> tuple[float, float, bool]:
        """Accumulates one global batch, clips, steps; returns (loss, grad_norm, finite)."""
        snap = self.stream.snapshot()
        micro, n_targets = self.batches.next_step()
        dev, K = self.acc.device, len(micro)
        n_targets = max(n_targets, 1)  # an all-padding batch contributes zero loss, never NaN
        loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
        for k, mb in enumerate(micro):
            mb = {key: v.to(dev) for key, v in mb.items()}
            if self.fsdp:
                # Reduce-scatter only on the last micro-step; earlier ones accumulate unsharded grads.
                self.model.set_requires_gradient_sync(k == K - 1)
                sync = contextlib.nullcontext()
            else:
                sync = contextlib.nullcontext() if k == K - 1 else self.acc.no_sync(self.model)
            with sync, self.acc.autocast():
                s, _ = token_loss_sum(self.model, mb, packed=self.cfg.data.mode == "pack")
                # DDP and FSDP2 average gradients over ranks: scale so the result is the global token mean.
                self.acc.backward(s * (self.world / n_targets))
            loss_sum += s.detach()
        loss = self.acc.reduce(loss_sum, reduction="sum").item() / n_targets
        # One norm for every launch mode (fp64 partial sums): one process, DDP and FSDP2 clip alike.
        gnorm = fsdp.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        finite = math.isfinite(loss) and math.isfinite(gnorm)
        if finite:
            t0 = time.perf_counter()
            self.opt.step()
            self.opt_seconds += time.perf_counter() - t0
            self.sched.step()
        else:
            # Nothing advances on a skipped step: not the schedule, the optimizer, nor the data.
            self.stream.restore(snap)
        self.opt.zero_grad(set_to_none=True)
        return loss, gnorm, finite

    def _grad_bytes(self) -> int:
        # Per rank: a sharded parameter's gradient is its local shard.
        return sum(_local(q).numel() * q.element_size() for q in self.model.parameters() if q.requires_grad)

    def _write(self, fh, rec: dict[str, Any]) -> None:
        if fh is not None:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
        if self.acc.trackers and "step" in rec:
            self.acc.log(
                {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"},
                step=rec["step"],
            )

    def _summary(
        self, val, train_time: float, wall: float, grad_bytes: int, new_tokens: int
    ) -> dict[str, Any]:
        import transformers

        model = self.acc.unwrap_model(self.model)
        params = sum(q.numel() for q in model.parameters())
        trainable = sum(q.numel() for q in model.parameters() if q.requires_grad)
        weight_bytes = sum(_local(v).numel() * v.element_size() for v in model.state_dict().values())
        est = memory.estimate_from_config(self.cfg, self.tok.vocab_size, self.world, self._sharding())
        measured_state = optimizers.measured_state_bytes(self.inner_opt)
        p = self.progress
        return {
            "method": self.cfg.method,
            "optimizer": self.cfg.optim.name,
            "factor": self.cfg.factor.kind,
            "model": self.cfg.model.preset,
            "params": params,
            "trainable_params": trainable,
            "steps": p.step,
            "tokens": p.tokens,
            "skipped_steps": p.skipped,
            "final_val_loss": val[0],
            "final_val_ppl": val[1],
            "tokens_per_s": new_tokens / max(train_time, 1e-9),
            "wall_s": wall,
            "peak_memory_bytes": memory.peak_memory_bytes(self.acc.device),
            "optimizer_state_bytes": measured_state,
            "weight_bytes": weight_bytes,
            "grad_bytes": grad_bytes,
            "estimated": est.as_dict(),
            "estimate_matches_measured": {
                "optimizer_state": est.optimizer_state == measured_state,
                "weights": est.weights == weight_bytes,
            },
            "device": _device_name(self.acc.device),
            "world_size": self.world,
            "sharding": self._sharding(),
            "precision": self.cfg.train.precision,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "git_commit": git_commit(),
            "config_hash": config_hash(self.cfg),
            **opt_telemetry(self.inner_opt),
        }


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


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite steps: a training failure, reported without a traceback."""


def tqdm_write(pbar, msg: str) -> None:
    if pbar is not None:
        pbar.write(msg, file=sys.stdout)
    else:
        print(msg, flush=True)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def plot_run(metrics_path: Path, out_png: Path) -> None:
    """Training loss and validation perplexity against step, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = [], []
    for line in metrics_path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "eval":
            val.append((rec["step"], rec["val_ppl"]))
        elif "loss" in rec and "event" not in rec:
            train.append((rec["step"], rec["loss"]))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    if train:
        a.plot(*zip(*train))
    a.set(xlabel="step", ylabel="train loss", title="training loss")
    if val:
        b.plot(*zip(*val), marker="o")
        b.set_yscale("log")
    b.set(xlabel="step", ylabel="val perplexity", title="validation perplexity")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def train(
    cfg: RunConfig, out_dir: str | Path, resume: str | None = None, allow_config_change: bool = False
) -> dict[str, Any]:
    """Runs one training job to completion (or to a signal) and returns its summary."""
    return Trainer(cfg, Path(out_dir), resume, allow_config_change).fit()

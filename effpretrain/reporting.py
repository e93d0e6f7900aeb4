"""What a run reports: metrics.jsonl, Accelerate trackers, the progress bar, summary.json, curves.

`RunReport` owns everything a run writes besides its checkpoints, for the length of a `with`
block: it is opened before the loop and always closed after it, whether the run finished,
stopped on a signal or raised (repeated non-finite steps, an interrupt, any error).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch

import optimizers
from effpretrain import flops, memory
from effpretrain.checkpoint.weights import without_aliases
from effpretrain.compile import compiled_blocks
from effpretrain.config import RunConfig, config_hash, dump_yaml, to_dict
from effpretrain.evaluation import EvalResult
from effpretrain.memory import measure
from effpretrain.memory.measure import MEASURED_KEYS
from effpretrain.models.factorized import warming_up
from effpretrain.models.llama import model_label
from effpretrain.optim_setup import opt_telemetry
from optimizers._sharded import local as _local


class RunReport:
    """The run's metrics.jsonl (main process only), trackers and progress bar, as one context.

    Entering writes config.yaml, starts the trackers and opens metrics.jsonl for appending (a
    resumed run continues the same file); leaving closes the bar and the file and ends the
    trackers, on every path out of the block.

    Args:
        acc: the run's `accelerate.Accelerator`.
        cfg: the run's config (written to config.yaml and to the trackers).
        out: the run directory.
        start_step: the step the loop starts at (0, or the resumed step), for the progress bar.
    """

    def __init__(
        self, acc: Any, cfg: RunConfig, out: Path, start_step: int, flops_per_token: float | None = None
    ):
        self.acc, self.cfg, self.out, self.start_step = acc, cfg, out, start_step
        self.flops_per_token = flops_per_token
        self.peak, _, _ = flops.run_peak_flops(cfg, acc.device)
        self.metrics_path = out / "metrics.jsonl"
        self.file: IO[str] | None = None
        self._bar: Any = None

    def __enter__(self) -> RunReport:
        cfg, main = self.cfg, self.acc.is_main_process
        self.out.mkdir(parents=True, exist_ok=True)
        if main:
            (self.out / "config.yaml").write_text(dump_yaml(cfg))
        if self.acc.trackers:
            self.acc.init_trackers(cfg.method or "effpretrain", config=flat_config(to_dict(cfg)))
        if main:
            self.file = open(self.metrics_path, "a")
        if main and sys.stderr.isatty():
            # Only on a terminal: in a log file or a pipe the bar's carriage-return redraws pile up
            # on one line that the log lines then continue; there, metrics.jsonl (flushed at every
            # record) shows the progress and stderr keeps one line per event.
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=cfg.train.max_steps,
                initial=self.start_step,
                desc=cfg.method,
                dynamic_ncols=True,
                file=sys.stderr,
                mininterval=0.5,
            )
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.close_progress()
            if self.file is not None:
                self.file.close()
        finally:
            if self.acc.trackers:
                if exc_type is None:
                    self.acc.end_training()
                else:
                    # Only close the trackers: end_training would also tear down the process group
                    # while other ranks may still be on their way out.
                    for tracker in self.acc.trackers:
                        tracker.finish()

    def write(self, rec: dict[str, Any]) -> None:
        """Appends one record to metrics.jsonl (flushed: readable while the run goes on) and sends
        its numeric fields to the trackers at the record's step."""
        if self.file is not None:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
        if self.acc.trackers and "step" in rec:
            self.acc.log(
                {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"},
                step=rec["step"],
            )

    def note(self, msg: str) -> None:
        """Prints a line on the main process without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(msg, file=sys.stdout)
        elif self.acc.is_main_process:
            print(msg, flush=True)

    def advance(self, loss: float, tokens_per_s: float) -> None:
        """Moves the progress bar by one step and shows the step's loss, throughput, MFU (where the
        device's peak is known) and memory."""
        if self._bar is None:
            return
        self._bar.update(1)
        shown = {
            "loss": f"{loss:.3f}",
            "ppl": f"{math.exp(min(loss, 50)):.1f}",
            "tok_s": f"{tokens_per_s:,.0f}",
        }
        if self.flops_per_token is not None:
            util = flops.mfu(self.flops_per_token * tokens_per_s, self.peak, self.acc.num_processes)
            if util is not None:
                shown["mfu"] = f"{util:.1%}"
        shown["mem"] = f"{measure.process_peak_bytes(self.acc.device) / 2**30:.2f}G"
        self._bar.set_postfix(shown)

    def close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def finish(self, summary: dict[str, Any]) -> None:
        """Writes summary.json and, with `train.plot`, curves.png (main process)."""
        if self.acc.is_main_process:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
            if self.cfg.train.plot:
                plot_run(self.metrics_path, self.out / "curves.png")


@dataclass
class RunClock:
    """This process's time in the run: throughput counts only the steps it trained (resume-safe).

    Attributes:
        start_tokens: tokens already trained when this process started (a resumed run's).
        start_wall: wall-clock start (time.time()).
        train_s: seconds spent inside training steps so far.
        step_start: perf_counter() at the start of the current step.
    """

    start_tokens: int
    start_wall: float = field(default_factory=time.time)
    train_s: float = 0.0
    step_start: float = 0.0

    def start_step(self) -> None:
        self.step_start = time.perf_counter()

    def end_step(self) -> None:
        self.train_s += time.perf_counter() - self.step_start

    def since_step_start(self) -> float:
        return time.perf_counter() - self.step_start

    def tokens_per_s(self, tokens: int) -> float:
        """Tokens trained by this process per second of training step: (tokens - start) / train_s."""
        return (tokens - self.start_tokens) / max(self.train_s, 1e-9)


def build_summary(
    cfg: RunConfig,
    acc: Any,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    *,
    progress: Any,
    val: EvalResult,
    clock: RunClock,
    grad_bytes: int,
    vocab_size: int,
    sharding: str,
    grad_bytes_source: str = "every_trainable_parameter",
    memory_records: list[list[dict[str, Any]]] | None = None,
    telemetry: dict[str, Any] | None = None,
    state_ranks: list[int] | None = None,
    compile_s: float = 0.0,
) -> dict[str, Any]:
    """summary.json: the run's result, measured memory beside the estimate, and its provenance.

    Args:
        model: the (possibly wrapped) trained model; opt: the optimizer below Accelerate's wrapper.
        progress: the run's step, tokens and skipped steps.
        val: the final evaluation: its exact loss and perplexity (the headline), the target tokens
            and rows it covered, and the benchmark-convention perplexity (labelled as such).
        grad_bytes: gradient bytes per rank, as `grad_bytes_source` says:
            ``every_trainable_parameter`` (the gradients a normal step holds at its optimizer
            step), or with ``train.update_in_backward`` ``measured_peak_in_backward`` (a measured
            step's most gradient bytes alive at once: accumulators and gradients in flight) or
            ``estimate_in_backward`` (the estimator's figure, when no first step was measured).
        sharding: "none", "ddp" or "fsdp2" as run.
        memory_records: per measured step, every rank's `effpretrain.memory.measure.measure_step` result
            (``memory_measured``, see `measured_memory`).
        telemetry: the optimizer's telemetry (over every rank); None reads this rank's.
        state_ranks: every rank's measured optimizer-state bytes, in rank order (None: one rank).
            ``optimizer_state_bytes`` is this rank's; the estimate is compared rank by rank.
        compile_s: seconds this process spent compiling for the run (`train.compile`).

    ``compiled_blocks`` is read off the model: its decoder blocks that `train.compile` compiled.
    """
    model = acc.unwrap_model(model)
    tokens_per_s = clock.tokens_per_s(progress.tokens)
    return {
        **_result_fields(cfg, model, progress, val, vocab_size),
        "tokens_per_s": tokens_per_s,
        **speed_figures(cfg, acc, vocab_size, tokens_per_s, compile_s),
        # Read off the trained model: how many decoder blocks ran compiled (0 for an eager run).
        "compiled_blocks": compiled_blocks(model),
        "wall_s": time.time() - clock.start_wall,
        **_memory_fields(cfg, acc, model, opt, vocab_size, sharding, state_ranks, memory_records),
        "grad_bytes": grad_bytes,
        "grad_bytes_source": grad_bytes_source,
        **_provenance_fields(cfg, acc, sharding),
        **(opt_telemetry(opt) if telemetry is None else telemetry),
    }


def _result_fields(
    cfg: RunConfig, model: torch.nn.Module, progress: Any, val: EvalResult, vocab: int
) -> dict:
    """What the run was and what it reached: method, model, sizes, steps, the final evaluation."""
    return {
        "method": cfg.method,
        "optimizer": cfg.optim.name,
        "factor": cfg.factor.kind,
        "model": model_label(cfg.model),
        "vocab_size": vocab,
        "params": sum(q.numel() for q in model.parameters()),
        "trainable_params": sum(q.numel() for q in model.parameters() if q.requires_grad),
        "steps": progress.step,
        "tokens": progress.tokens,
        "skipped_steps": progress.skipped,
        "final_val_loss": val.loss,
        "final_val_ppl": val.ppl,
        "final_val_ppl_benchmark_convention": val.ppl_benchmark_convention,
        "val_tokens": val.tokens,
        "val_sequences": val.sequences,
        "val_batches": val.batches,
    }


def _memory_fields(
    cfg: RunConfig,
    acc: Any,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    vocab_size: int,
    sharding: str,
    state_ranks: list[int] | None,
    memory_records: list[list[dict[str, Any]]] | None,
) -> dict[str, Any]:
    """Measured memory beside the estimate: the process peak, weights and optimizer state (every
    rank's, compared rank by rank), the measured steps by category, and the estimate."""
    # A tied matrix (the head that is the embedding) is one tensor under two keys: counted once.
    weights = without_aliases(model.state_dict())
    weight_bytes = sum(_local(v).numel() * v.element_size() for v in weights.values())
    est = memory.estimate_from_config(cfg, vocab_size, acc.num_processes, sharding)
    measured_state = optimizers.measured_state_bytes(opt)
    # A run with a warm start ends in its factorized phase (unless it never left the warm start).
    phase = est.detail.get("phases", {}).get("warm_start" if warming_up(model) else "factorized")
    est_state = phase["optimizer_state"] if phase else est.optimizer_state
    state_ranks = state_ranks or [measured_state]
    est_ranks = est.detail.get("optimizer_state_per_rank") if phase is None else None
    if est_ranks is None or len(est_ranks) != len(state_ranks):  # unsharded: every rank holds all
        est_ranks = [est_state] * len(state_ranks)
    return {
        "peak_memory_bytes": measure.process_peak_bytes(acc.device),
        "optimizer_state_bytes": measured_state,
        "weight_bytes": weight_bytes,
        "memory_measured": measured_memory(memory_records or []),
        "estimated": est.as_dict(),
        "optimizer_state_bytes_per_rank": state_ranks,
        "estimate_matches_measured": {
            "optimizer_state": est_ranks == state_ranks,
            "weights": est.weights == weight_bytes,
            **_in_backward_gradient_check(est, memory_records),
        },
    }


def _provenance_fields(cfg: RunConfig, acc: Any, sharding: str) -> dict[str, Any]:
    """Where and how it ran: device, processes, sharding, precision, versions, commit, config hash."""
    import transformers

    return {
        "device": device_name(acc.device),
        "world_size": acc.num_processes,
        "sharding": sharding,
        "precision": cfg.train.precision,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": git_commit(),
        "config_hash": config_hash(cfg),
    }


def speed_figures(
    cfg: RunConfig, acc: Any, vocab_size: int, tokens_per_s: float, compile_s: float = 0.0
) -> dict[str, Any]:
    """summary.json's speed beside the throughput: ``flops_per_token`` (`flops.run_flops_per_token`),
    ``model_flops_per_s`` (that x the whole job's tokens/s), ``mfu`` (over every process's device
    peak; null on CPU, an unknown device or a MIG slice), ``peak_flops``, ``peak_flops_dtype`` (the
    dtype of the model's products whose peak it is: bf16, tf32 or fp32, `flops.peak_dtype`) and
    ``peak_flops_source``, and
    ``compile_s`` (`train.compile`: the run's compilation time in this process: the training
    graphs', which the throughput includes, and the evaluation's; 0 eager)."""
    per_token = flops.run_flops_per_token(cfg, vocab_size, acc.num_processes)
    peak, source, dtype = flops.run_peak_flops(cfg, acc.device)
    achieved = per_token * tokens_per_s
    return {
        "flops_per_token": per_token,
        "model_flops_per_s": achieved,
        "mfu": flops.mfu(achieved, peak, acc.num_processes),
        "peak_flops": peak,
        "peak_flops_dtype": dtype,
        "peak_flops_source": source,
        "compile_s": compile_s,
    }


def _in_backward_gradient_check(
    est: memory.Estimate, records: list[list[dict[str, Any]]] | None
) -> dict[str, bool]:
    """With ``train.update_in_backward`` and measured steps: ``gradients_within_estimate``,
    whether every rank's measured peak gradient bytes stay within the estimator's figure (at a
    refresh step's, the larger, since the measured steps may include one). Empty otherwise."""
    if not est.detail.get("update_in_backward") or not records:
        return {}
    bound = est.detail["grads_at_refresh"]
    return {"gradients_within_estimate": all(m["gradients"] <= bound for step in records for m in step)}


def measured_memory(records: list[list[dict[str, Any]]]) -> dict[str, Any] | None:
    """summary.json's ``memory_measured``: from the measured steps (each a list of every rank's
    measurement), rank 0's ``max`` (per category, the largest over its measured steps) and
    ``steps`` (its measurements, in step order), and ``ranks``: the same two for every rank. None
    when no step was measured (`train.memory_steps: []`)."""
    if not records:
        return None

    def one(steps: list[dict[str, Any]]) -> dict[str, Any]:
        top = max(steps, key=lambda m: m["peak"])
        best = {k: max(m[k] for m in steps) for k in MEASURED_KEYS}
        return {
            "max": {**best, "step_at_peak": top["step"], "phase_at_peak": top["phase_at_peak"]},
            "steps": steps,
        }

    ranks = [one([step[r] for step in records]) for r in range(len(records[0]))]
    return {**ranks[0], "ranks": [{"rank": r, **x} for r, x in enumerate(ranks)]}


def git_commit() -> str:
    """The short commit of the source tree effpretrain runs from, or "unknown"."""
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


def provenance() -> dict[str, Any]:
    """Where a benchmark result came from: commit, machine, torch version and UTC date."""
    import datetime as dt

    return {
        "commit": git_commit(),
        "machine": cpu_description(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def cpu_description() -> str:
    """CPU model name and logical core count, without touching any accelerator (benchmark
    results record it beside the commit)."""
    import platform

    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cores"


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's with its core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def flat_config(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as dotted keys with tracker-friendly values (numbers, str, bool)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
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

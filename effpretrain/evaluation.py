"""Validation: the exact token-weighted loss on a fixed token-count set, split across processes,
and the benchmark's own estimator beside it.

The set (`effpretrain.data.validation_set`) is the same rows for any number of processes. It is
cut into batches of `batch_size` rows in order, batch j = rows [jB, (j+1)B) (the last may be
short), and batch j is evaluated by rank j mod W. Every rank sums, in fp64, its batches' loss
sums s_j, target counts c_j, batch means s_j / c_j and batch count; one all-reduce adds them.
Hence the exact loss

    L = sum_j s_j / sum_j c_j,    ppl = exp(L),

and the benchmark-convention loss

    L_bench = (sum_j s_j / c_j) / (N + 1)    over the N batches,    ppl_bench = exp(L_bench),

do not depend on W (only the order of an fp64 sum does). L_bench is what ``evaluate_model`` in
OptimAI-Lab/Memory_Efficient_Pretraining (torchrun_main_DDP.py) computes in one process: it sums
the per-batch mean losses and divides by a batch counter that starts at 1, so by N + 1, then
reports exp of that (on W processes it averages the W per-rank values, each divided by its own
n_r + 1). With batch means near L it reads low by the factor exp(-L / (N + 1)); see the README.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from effpretrain import checkpoint as ckpt
from effpretrain import data as data_mod
from effpretrain.config import apply_overrides, from_dict, validate
from effpretrain.data import ValidationSet
from effpretrain.launch import check_launch, make_accelerator
from effpretrain.loss import DEFAULT_CHUNK_TOKENS, token_loss_sum
from effpretrain.run_model import build_run_model, place_model, run_vocabulary

__all__ = ["EvalResult", "evaluate", "evaluate_checkpoint", "from_totals"]

#: exp of a loss is capped here (a diverged run's loss would overflow float).
MAX_LOG_PPL = 50.0


@dataclass(frozen=True)
class EvalResult:
    """One evaluation.

    Attributes:
        loss: the exact token-weighted mean loss L over the set (the headline).
        ppl: exp(L).
        tokens: target (loss-bearing) tokens evaluated.
        sequences: rows evaluated.
        batches: N, the batches of `batch_size` rows the set was cut into.
        loss_benchmark_convention: (sum of batch means) / (N + 1), the benchmark's estimator.
        ppl_benchmark_convention: exp(loss_benchmark_convention).
    """

    loss: float
    ppl: float
    tokens: int
    sequences: int
    batches: int
    loss_benchmark_convention: float
    ppl_benchmark_convention: float

    def record(self) -> dict[str, Any]:
        """The fields of an eval record in metrics.jsonl."""
        return {
            "val_loss": self.loss,
            "val_ppl": self.ppl,
            "val_tokens": self.tokens,
            "val_ppl_benchmark_convention": self.ppl_benchmark_convention,
        }


def _exp(loss: float) -> float:
    return math.exp(min(loss, MAX_LOG_PPL))


def from_totals(loss_sum: float, tokens: int, mean_sum: float, batches: int, sequences: int) -> EvalResult:
    """The evaluation from its summed parts.

    Args:
        loss_sum: sum_j s_j, the summed next-token cross-entropy over every target.
        tokens: sum_j c_j, the targets.
        mean_sum: sum_j s_j / c_j, the summed per-batch mean losses.
        batches: N.
        sequences: rows evaluated.

    Returns:
        L = loss_sum / tokens and L_bench = mean_sum / (N + 1), with their exps.
    """
    loss = loss_sum / tokens
    bench = mean_sum / (batches + 1)
    return EvalResult(loss, _exp(loss), tokens, sequences, batches, bench, _exp(bench))


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    val: ValidationSet,
    batch_size: int,
    *,
    rank: int,
    world: int,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager],
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
    lockstep: bool = False,
    loss: str = "standard",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> EvalResult:
    """Evaluates `model` on this rank's batches of `val` and combines all ranks (module docstring).

    Args:
        model: the model to run (eval mode is the caller's); not a DDP wrapper, whose forward
            may broadcast buffers and so would need every rank to run as many batches.
        batch_size: B, rows per batch (also the benchmark-convention estimator's batch).
        rank, world: this process and the number of processes.
        autocast: the precision context of the forward.
        all_reduce_sum: sums a tensor over the processes (identity in one process).
        lockstep: every rank runs the same number of forwards (FSDP2: each forward gathers
            shards collectively); a rank without a batch left repeats batch 0 and drops it.
        loss, chunk_tokens: `train.loss` and `train.loss_chunk_tokens`; under no-grad the chunked
            kinds compute the loss alone, a chunk at a time, never the (rows x vocabulary) logits.
    """
    n = len(val)
    n_batches = -(-n // batch_size)
    stop = -(-n_batches // world) * world if lockstep else n_batches
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # sum s, sum c, sum s/c, N
    for j in range(rank, stop, world):
        lo = j * batch_size if j < n_batches else 0
        batch = {k: v.to(device) for k, v in val.rows(lo, min(lo + batch_size, n)).items()}
        with autocast():
            s, c = token_loss_sum(model, batch, loss=loss, chunk_tokens=chunk_tokens)
        if j < n_batches:
            s, c = s.detach().double(), c.double()
            totals += torch.stack([s, c, s / c, torch.ones_like(s)])
    loss_sum, tokens, mean_sum, batches = all_reduce_sum(totals).tolist()
    return from_totals(loss_sum, round(tokens), mean_sum, round(batches), n)


def evaluate_checkpoint(checkpoint: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Evaluates a checkpoint's model on the validation set of its own config (`effpretrain eval`).

    Builds only what evaluation needs (the processes, the validation set, the model with the
    checkpoint's weights), not a trainer. Any number of processes (one, or a DDP launch such as
    ``torchrun --nproc_per_node N``), for a checkpoint written by any number of processes: every
    process reads the whole weights (FSDP2's sharded ones too) into a fresh model, so evaluation
    needs no sharding. The validation set is `train.eval_tokens` target tokens (the config's, or
    ``--set train.eval_tokens=N``), the same rows and batches whatever the process count, so the
    result is the same up to the order of an fp64 sum. Nothing in the run folder is written.

    Returns:
        checkpoint, step, world_size, and the eval record: val_loss, val_ppl (exact), val_tokens,
        val_ppl_benchmark_convention; val_sequences and val_batches.
    """
    import tempfile

    path = ckpt.resolve_checkpoint(checkpoint, "eval")
    state = ckpt.load_checkpoint(path)
    cfg = _saved_config(state["trainer"]["config"], overrides or [], path)
    weights = ckpt.read_model_state(path, state)
    with tempfile.TemporaryDirectory() as scratch:  # the run folder is not touched
        acc, val, model = _evaluation_set_up(cfg, Path(scratch))
        ckpt.load_model_weights(model, weights, path)
        model.eval()
        result = evaluate(
            model,
            val,
            cfg.train.batch_size,
            rank=acc.process_index,
            world=acc.num_processes,
            device=acc.device,
            autocast=acc.autocast,
            all_reduce_sum=lambda t: acc.reduce(t, reduction="sum"),
            loss=cfg.train.loss,
            chunk_tokens=cfg.train.loss_chunk_tokens,
        )
    return {
        "checkpoint": str(path),
        "step": int(state["trainer"]["step"]),
        "world_size": acc.num_processes,
        **result.record(),
        "val_sequences": result.sequences,
        "val_batches": result.batches,
    }


def _saved_config(saved: dict[str, Any], overrides: list[str], path: Path) -> Any:
    """The checkpoint's resolved config with this command's overrides. The evaluation's size is
    this command's setting, not part of the trained model: a checkpoint written before
    train.eval_tokens existed still records train.eval_batches, which is dropped."""

    saved = dict(saved)
    if isinstance(saved.get("train"), dict):
        saved["train"] = {k: v for k, v in saved["train"].items() if k != "eval_batches"}
    return validate(apply_overrides(from_dict(saved, str(path)), overrides), str(path))


def _evaluation_set_up(cfg: Any, scratch: Path) -> tuple[Any, ValidationSet, torch.nn.Module]:
    """The processes (checked as a training launch is), the validation set and the placed model."""
    from accelerate.utils import set_seed

    acc = make_accelerator(cfg, scratch, announce=False)
    check_launch(acc.num_processes, cfg)
    set_seed(cfg.train.seed)
    with acc.main_process_first():
        corpus = data_mod.load_corpus(cfg.data)
        tok = data_mod.load_tokenizer(cfg.data, corpus)
    val = data_mod.validation_set(corpus, tok, cfg.data.seq_len, cfg.data.mode, cfg.train.eval_tokens)
    model, _ = build_run_model(cfg, run_vocabulary(cfg, tok.vocab_size, tok.name))
    return acc, val, place_model(model, cfg, acc.device, 0)

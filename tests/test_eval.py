"""Evaluation claims: the validation set is a token count, the same rows for any batch size and
any number of processes; the exact loss and the benchmark-convention one are the formulas the
docs state, checked on a hand-built case; one checkpoint evaluated by 1 and by 2 processes
(torchrun, gloo) gives the same token count and perplexity."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from _common import ROOT, child_env
from distributed_helpers import torchrun

from effpretrain import data, evaluation
from effpretrain.config import DataConfig, load_config
from effpretrain.trainer import train

LN2 = math.log(2)

# A hand tokenizer: "0 1 2" -> [0, 1, 2]; EOS is 3.
HAND_TOK = data.Tokenizer("hand", 4, 3, 0, lambda texts: [[int(t) for t in x.split()] for x in texts])
# Truncate rows at seq_len 4 (EOS appended, then cut) and their targets (every token but the first):
#   "0 0 0"     -> [0 0 0 3]  targets 0 0 3  (3)
#   "1"         -> [1 3]      targets 3      (1)
#   "2 2"       -> [2 2 3]    targets 2 3    (2)
#   "1 1 1 1 1" -> [1 1 1 1]  targets 1 1 1  (3)
#   "0"         -> [0 3]      targets 3      (1)
# cumulative target counts 3, 4, 6, 9, 10.
HAND_DOCS = ["0 0 0", "1", "2 2", "1 1 1 1 1", "0"]


class FixedDistribution(torch.nn.Module):
    """A "model" predicting p = (1/2, 1/4, 1/8, 1/8) at every position, whatever the input: the
    loss of target y is -log p_y, i.e. ln 2, 2 ln 2, 3 ln 2, 3 ln 2 for y = 0, 1, 2, 3."""

    def __init__(self):
        super().__init__()
        self.log_p = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))
        self.forwards = 0

    def forward(self, input_ids, attention_mask=None):
        self.forwards += 1
        return SimpleNamespace(logits=self.log_p.expand(*input_ids.shape, 4))


def hand_set(eval_tokens: int, mode: str = "truncate") -> data.ValidationSet:
    corpus = data.Corpus(["unused"], list(HAND_DOCS), "hand")
    return data.validation_set(corpus, HAND_TOK, 4, mode, eval_tokens)


@pytest.mark.parametrize(
    "eval_tokens, rows, tokens",
    [(1, 1, 3), (3, 1, 3), (4, 2, 4), (5, 3, 6), (6, 3, 6), (7, 4, 9), (10, 5, 10)],
)
def test_eval_tokens_takes_rows_up_to_and_including_the_one_that_reaches_the_count(eval_tokens, rows, tokens):
    val = hand_set(eval_tokens)
    assert len(val) == rows and val.tokens == tokens
    assert val.lengths.tolist() == [4, 2, 3, 4, 2][:rows]
    batch = val.rows(0, rows)
    assert data.count_targets(batch["labels"]) == tokens
    assert batch["input_ids"][0].tolist() == [0, 0, 0, 3]


def test_a_small_split_gives_all_its_rows_and_pack_cuts_full_rows(caplog):
    with caplog.at_level("WARNING", logger="effpretrain"):
        val = hand_set(100)
    assert (len(val), val.tokens) == (5, 10)
    assert "fewer than train.eval_tokens=100" in caplog.text
    # pack: "0 0 0 3 1 3 2 2 3 1 1 1 1 1 3 0 3" cut into rows of 4, 3 targets each.
    packed = hand_set(7, "pack")
    assert (len(packed), packed.tokens) == (3, 9)
    assert packed.rows(0, 3)["input_ids"].tolist() == [[0, 0, 0, 3], [1, 3, 2, 2], [3, 1, 1, 1]]


def test_the_streamed_split_gives_the_same_set_as_the_same_documents_in_memory(tmp_path):
    """The hub path is the real `datasets` streaming reader (a local folder: no network here)."""
    folder = tmp_path / "ds"
    folder.mkdir()
    docs = [" ".join(str((i + k) % 3) for k in range(i % 7 + 1)) for i in range(100)]
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    hub = data.load_corpus(DataConfig(source="hub", name=str(folder), split="train", val_every=10))
    memory = data.Corpus(["unused"], [d for d in docs if data.held_out(d, 10)], "memory")
    a = data.validation_set(hub, HAND_TOK, 4, "truncate", 12)
    b = data.validation_set(memory, HAND_TOK, 4, "truncate", 12)
    assert a.tokens == b.tokens >= 12 and torch.equal(a.input_ids, b.input_ids)


def _evaluate(val, batch_size, world=1, lockstep=False):
    """Each rank of a simulated `world` evaluated in turn; their totals summed as the all-reduce would."""
    parts, models = [], []
    for rank in range(world):
        models.append(FixedDistribution())
        evaluation.evaluate(
            models[-1],
            val,
            batch_size,
            rank=rank,
            world=world,
            device=torch.device("cpu"),
            autocast=nullcontext,
            # Keeps this rank's totals; its own result (from placeholder totals) is not used.
            all_reduce_sum=lambda t: parts.append(t.clone()) or torch.ones_like(t),
            lockstep=lockstep,
        )
    loss_sum, tokens, mean_sum, batches = torch.stack(parts).sum(0).tolist()
    result = evaluation.from_totals(loss_sum, round(tokens), mean_sum, round(batches), len(val))
    return result, [m.forwards for m in models]


def test_exact_and_benchmark_convention_losses_by_hand():
    """Rows 1-4 (eval_tokens 7) carry losses 5, 3, 6, 6 (x ln 2) over 3, 1, 2, 3 targets."""
    val = hand_set(7)
    exact = 20 / 9 * LN2
    # Batches of 2: (5 + 3) / 4 = 2 and (6 + 6) / 5 = 2.4 (x ln 2); the benchmark divides their
    # sum by N + 1 = 3.
    r, _ = _evaluate(val, 2)
    assert (r.tokens, r.sequences, r.batches) == (9, 4, 2)
    assert r.loss == pytest.approx(exact, rel=1e-6) and r.ppl == pytest.approx(math.exp(exact), rel=1e-6)
    assert r.loss_benchmark_convention == pytest.approx((2 + 2.4) / 3 * LN2, rel=1e-6)
    assert r.ppl_benchmark_convention == pytest.approx(math.exp((2 + 2.4) / 3 * LN2), rel=1e-6)
    # Batches of 3: (5 + 3 + 6) / 6 = 7/3 and 6 / 3 = 2; the exact loss does not move.
    r3, _ = _evaluate(val, 3)
    assert r3.loss == pytest.approx(exact, rel=1e-6) and r3.batches == 2
    assert r3.loss_benchmark_convention == pytest.approx((7 / 3 + 2) / 3 * LN2, rel=1e-6)


def test_from_totals_is_the_documented_formula():
    r = evaluation.from_totals(loss_sum=7.0, tokens=4, mean_sum=5.0, batches=2, sequences=3)
    assert (r.loss, r.loss_benchmark_convention) == (7 / 4, 5 / 3)
    assert r.record() == {
        "val_loss": 1.75,
        "val_ppl": math.exp(1.75),
        "val_tokens": 4,
        "val_ppl_benchmark_convention": math.exp(5 / 3),
    }


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("lockstep", [False, True])
def test_any_split_across_ranks_gives_one_process_result(world, lockstep):
    val = hand_set(10)  # 5 rows, batches of 2: 3 batches, so some ranks get none or fewer
    one, _ = _evaluate(val, 2)
    many, forwards = _evaluate(val, 2, world, lockstep)
    assert (many.tokens, many.batches) == (one.tokens, one.batches) == (10, 3)
    assert many.loss == pytest.approx(one.loss, rel=1e-12)
    assert many.loss_benchmark_convention == pytest.approx(one.loss_benchmark_convention, rel=1e-12)
    # Lockstep (FSDP2): every rank runs as many forwards as the busiest one.
    assert forwards == (
        [-(-3 // world)] * world if lockstep else [len(range(r, 3, world)) for r in range(world)]
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-step tiny AdamW run's final checkpoint."""
    out = tmp_path_factory.mktemp("eval") / "run"
    base = ["data.seq_len=32", "data.vocab_size=512", "train.batch_size=4", "train.plot=false"]
    run = ["train.max_steps=2", "train.eval_every=0", "train.eval_tokens=64"]
    train(load_config(ROOT / "recipes" / "tiny" / "adamw.yaml", base + run), out)
    return out / "checkpoints" / "step-2"


@pytest.mark.multiprocess
def test_one_checkpoint_evaluated_by_one_and_by_two_processes_agrees(checkpoint):
    """Acceptance (issue 14): the same token count and perplexity to 1e-6 from 1 process and from
    2 (torchrun, gloo), with 10 rows in 3 batches of 4, split unevenly (2 batches and 1)."""
    ckpt = checkpoint
    args = ["-m", "effpretrain", "eval", str(ckpt), "--set", "train.eval_tokens=300"]
    env = child_env()
    for k in ("WORLD_SIZE", "MASTER_ADDR", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    launchers = [[sys.executable], torchrun(2)]
    procs = [
        subprocess.Popen(
            [*launcher, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for launcher in launchers
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert len(lines) == 1, out  # one result line, from rank 0 only
        results.append(json.loads(lines[0]))
    one, two = results
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["val_tokens"] == two["val_tokens"] == 310 and one["val_batches"] == two["val_batches"] == 3
    for key in ("val_loss", "val_ppl", "val_ppl_benchmark_convention"):
        assert abs(two[key] - one[key]) <= 1e-6 * abs(one[key]), (key, one[key], two[key])
    assert one["val_ppl_benchmark_convention"] < one["val_ppl"]
    print(json.dumps({"one": one, "two": two}))


@pytest.mark.run
def test_a_checkpoint_that_records_eval_batches_still_evaluates(checkpoint, tmp_path):
    """Checkpoints written before train.eval_tokens record train.eval_batches in their config: the
    evaluation's size is the eval command's (default or --set), so that key is not an error here
    (a recipe carrying it is: tests/test_config.py)."""
    import shutil

    from effpretrain.trainer import evaluate_checkpoint

    old = tmp_path / "step-2"
    shutil.copytree(checkpoint, old)
    state = torch.load(old / "trainer.pt", weights_only=True)
    state["config"]["train"].pop("eval_tokens")
    state["config"]["train"]["eval_batches"] = 8
    torch.save(state, old / "trainer.pt")
    result = evaluate_checkpoint(old, ["train.eval_tokens=64"])
    assert (result["step"], result["val_tokens"], result["world_size"]) == (2, 93, 1)
    # Bitwise: the same weights and rows through the same evaluation code.
    assert result["val_loss"] == evaluate_checkpoint(checkpoint, ["train.eval_tokens=64"])["val_loss"]

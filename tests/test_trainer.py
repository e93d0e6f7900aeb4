"""Trainer claims: end-to-end runs per tiny recipe, exact resume, memory estimate == measured."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _common import ROOT
from safetensors.torch import load_file

from effpretrain.config import load_config
from effpretrain.optim_setup import lr_factor
from effpretrain.trainer import train

pytestmark = pytest.mark.run

TINY_RECIPES = sorted((ROOT / "recipes" / "tiny").glob("*.yaml"))


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    last = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    return load_file(str(last / "model.safetensors"))


# `make test-fast` trains one recipe per family: full-rank, projected, 8-bit, block-wise Adam,
# whole-matrix, and each kind of factorization.
FAST_FAMILIES = {
    "adamw",
    "galore",
    "galore_8bit",
    "adam_mini",
    "muon",
    "lowrank_restarts",
    "sltrain",
    "cola_m",
    "loro",
}


@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(p, id=p.stem, marks=[pytest.mark.fast] if p.stem in FAST_FAMILIES else [])
        for p in TINY_RECIPES
    ],
)
def test_tiny_recipe_trains_and_memory_matches(recipe, tmp_path, tiny_overrides):
    over = tiny_overrides + ["train.max_steps=6", "train.eval_every=3"]
    cfg = load_config(recipe, over)
    if cfg.optim.update_proj_gap > 3:
        cfg.optim.update_proj_gap = 3  # so the short run crosses a basis refresh
    summary = train(cfg, tmp_path / "run")
    assert summary["steps"] == 6 and summary["tokens"] == 6 * 4 * 32
    assert math.isfinite(summary["final_val_loss"])
    assert summary["optimizer_state_bytes"] == summary["estimated"]["optimizer_state"]
    assert summary["weight_bytes"] == summary["estimated"]["weights"]
    assert summary["grad_bytes"] == summary["estimated"]["grads"]
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in [
        "method",
        "model",
        "params",
        "trainable_params",
        "steps",
        "tokens",
        "final_val_loss",
        "final_val_ppl",
        "final_val_ppl_benchmark_convention",
        "val_tokens",
        "tokens_per_s",
        "wall_s",
        "peak_memory_bytes",
        "optimizer_state_bytes",
        "weight_bytes",
        "grad_bytes",
        "estimated",
        "device",
        "world_size",
        "torch",
        "transformers",
        "git_commit",
        "config_hash",
    ]:
        assert key in on_disk, key
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e.get("event") == "eval"]
    assert [e["step"] for e in evals] == [3, 6]
    # train.eval_tokens=256 at seq_len 32: 9 rows of 31 targets (the 9th reaches 256).
    assert all(e["val_tokens"] == 279 == on_disk["val_tokens"] for e in evals)
    assert evals[-1]["val_ppl"] == on_disk["final_val_ppl"]
    assert on_disk["final_val_ppl_benchmark_convention"] < on_disk["final_val_ppl"]
    logs = [e for e in events if "event" not in e]
    assert logs and all(
        k in logs[0] for k in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_bytes")
    )


@pytest.mark.fast
def test_split_run_equals_straight_run(tmp_path, tiny_overrides):
    """Acceptance 3: 40 steps straight vs 20 + resume to 40: bitwise-equal weights, same val_loss.
    Bitwise: the resumed run executes the same kernels in the same order as the straight one."""
    over = tiny_overrides + ["train.max_steps=40", "train.save_every=20", "train.eval_every=20"]
    recipe = ROOT / "recipes" / "tiny" / "adamw.yaml"
    straight = train(load_config(recipe, over), tmp_path / "straight")
    assert (tmp_path / "straight" / "checkpoints" / "step-20").is_dir()
    # Resume the straight run's step-20 checkpoint into a fresh run directory.
    resumed = train(
        load_config(recipe, over),
        tmp_path / "resumed",
        resume=str(tmp_path / "straight" / "checkpoints" / "step-20"),
    )
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["final_val_loss"] == straight["final_val_loss"]
    assert resumed["steps"] == straight["steps"] == 40


def test_grad_accum_matches_bigger_batch(tmp_path, tiny_overrides):
    """The loss is the global token mean: 2 x batch 4 accumulates to the gradient of batch 8."""
    base = tiny_overrides + ["train.max_steps=3", "train.eval_every=0", "optim.name=adamw"]
    recipe = ROOT / "recipes" / "tiny" / "adamw.yaml"
    train(load_config(recipe, base + ["train.batch_size=8"]), tmp_path / "big")
    train(load_config(recipe, base + ["train.batch_size=4", "train.grad_accum=2"]), tmp_path / "acc")
    a, b = final_weights(tmp_path / "big"), final_weights(tmp_path / "acc")
    # Relative to each tensor's norm: AdamW's first steps are nearly sign(g) * lr, so an element
    # whose gradient is near zero moves by a visible amount on a last-bit difference of the sums
    # (which CPU kernels decide). A lost or doubled micro-batch moves the weights by orders of
    # magnitude more.
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).norm() / a[k].norm()) for k in a) <= 1e-5

    # AdamW cannot see a constant scale of the gradient (a sum instead of the mean); the logged
    # gradient norm can.
    def norms(run):
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["grad_norm"] for r in recs if "grad_norm" in r}

    big, acc = norms(tmp_path / "big"), norms(tmp_path / "acc")
    assert big and big.keys() == acc.keys()
    assert all(acc[k] == pytest.approx(big[k], rel=1e-5) for k in big)


def test_schedule_warmup_cosine_floor():
    cfg = load_config(None, ["train.max_steps=100", "train.warmup_ratio=0.1", "train.min_lr_ratio=0.1"])
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(55, cfg) == pytest.approx(0.55)
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    cfg.train.schedule = "linear"
    assert lr_factor(55, cfg) == pytest.approx(0.55)
    cfg.train.schedule = "constant"
    assert lr_factor(80, cfg) == 1.0


def test_activation_checkpointing_same_gradients(tiny_overrides):
    from effpretrain.loss import token_loss_sum
    from effpretrain.models import build_model, set_activation_checkpointing

    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    grads = []
    for every in (0, 1, 2):
        m = build_model("tiny", 512, 32, seed=0)
        m.train()
        assert set_activation_checkpointing(m, every) == (0 if every == 0 else len(range(0, 4, every)))
        s, _ = token_loss_sum(m, batch)
        s.backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and torch.allclose(grads[0], grads[2], atol=1e-6)


@pytest.mark.fast
def test_last_step_off_the_eval_cadence_is_evaluated_once(tmp_path, tiny_overrides, monkeypatch):
    """max_steps 7 with eval_every 3: evaluations at steps 3, 6 and 7, each once (the last step
    was evaluated twice before: by the loop and again by the final evaluation)."""
    from effpretrain.trainer import Trainer

    calls, real = [], Trainer.evaluate

    def counting(self):
        calls.append(self.progress.step)
        return real(self)

    monkeypatch.setattr(Trainer, "evaluate", counting)
    over = tiny_overrides + ["train.max_steps=7", "train.eval_every=3", "train.save_every=3"]
    train(load_config(ROOT / "recipes" / "tiny" / "adamw.yaml", over), tmp_path / "run")
    assert calls == [3, 6, 7]
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "eval"] == [3, 6, 7]
    # The same cadence saves: steps 3, 6 and the last, once each (the newest two are kept).
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-6", "step-7"]

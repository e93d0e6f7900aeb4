"""effpretrain.hf: the optimizer factory and callback inside a real transformers Trainer (CPU).

Claims: create_optimizer builds exactly the trainer's groups and schedule; galore and Low-Rank +
restarts train under the Trainer; restart events fire right after the configured optimizer
updates (seen in the optimizer state: step counters and moments zeroed, factor pairs balanced,
LR ramp), with gradient accumulation, whether the Restarts wrapper or the callback fires them,
and never twice; logs carry memory and perplexity; a run resumed from a Trainer checkpoint
repeats the uninterrupted run's losses; the README example runs as written. With
create_optimizer(update_in_backward=True), under the Trainer's own gradient accumulation (short
last update of an epoch included), the weights equal the normal Trainer run's (bitwise where the
same kernels run), no gradient is alive at the optimizer step, the logged grad_norm is the real one
and the logged LR the schedule's; max_grad_norm clips by the previous step's norm, which survives a
checkpoint; DeepSpeed, FSDP, fp16 and a missing callback are refused; `prepare_trainer` keeps
Accelerate's preparation (bf16 autocast, compilation) without a wrapper (several processes:
tests/test_hf_ddp.py).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from _common import ROOT, child_env
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import optimizers
from effpretrain import hf, memory, optim_setup
from effpretrain.errors import ConfigError
from effpretrain.models import build_model
from effpretrain.models.factorized import factor_pairs
from optimizers.momentum_reset import unwrap_optimizer
from optimizers.restarts import Restarts, recovery_factor

EXAMPLE = ROOT / "examples" / "hf_trainer.py"
SEQ, ROWS, BATCH = 32, 64, 4


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny matmuls: one thread is faster than two, and much faster on a shared, busy machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", autouse=True)
def example_run(request, tmp_path_factory):
    """Starts the README example (examples/hf_trainer.py, 4 steps) in a subprocess when the module
    starts, so that its interpreter start-up and imports overlap the other tests."""
    if not any(item.name == "test_readme_example_runs_as_written" for item in request.session.items):
        yield None
        return
    out_dir = tmp_path_factory.mktemp("example")
    env = child_env(CUDA_VISIBLE_DEVICES="")
    with open(out_dir / "stdout", "w") as so, open(out_dir / "stderr", "w") as se:
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "4"], cwd=out_dir, env=env, stdout=so, stderr=se
        )
    yield proc, out_dir
    proc.kill()
    proc.wait()


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        use_cache=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model


def lowrank_model(seed: int = 0) -> LlamaForCausalLM:
    model = tiny_model(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        hf.apply_factorization(model, "lowrank", rank=8, alpha=8.0)
    return model


def rows() -> list[dict[str, torch.Tensor]]:
    """Counting sequences (x, x+1, ...) mod 256 from random starts: learnable in a few steps."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 256, (ROWS, 1), generator=g)
    ids = (starts + torch.arange(SEQ)) % 256
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


class Probe(TrainerCallback):
    """Records, per optimizer update, the LR it used and the state right after it (and any restart)."""

    def __init__(self, param: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.param, self.pair = param, pair
        self.lr: dict[int, float] = {}
        self.step: dict[int, int] = {}
        self.exp_avg_norm: dict[int, float] = {}
        self.balanced: dict[int, bool] = {}

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
        self.lr[state.global_step + 1] = optimizer.param_groups[0]["lr"]

    def on_step_end(self, args, state, control, optimizer=None, **kw):
        st = unwrap_optimizer(optimizer).state[self.param]
        n = state.global_step
        self.step[n] = int(st["step"])
        self.exp_avg_norm[n] = float(st["exp_avg"].norm())
        if self.pair is not None:
            B, A = (t.detach().double() for t in self.pair)
            btb, aat = B.T @ B, A @ A.T
            off = btb - torch.diag(torch.diagonal(btb))
            scale = float(btb.abs().max())
            # fp32 refactorization leaves ~1e-6 relative imbalance; one Adam step at even 0.1% of
            # the LR leaves more than 5e-6 on these shapes.
            self.balanced[n] = max(float((btb - aat).abs().max()), float(off.abs().max())) < 3e-6 * scale


def make_trainer(
    out,
    model,
    *,
    max_steps,
    opt=None,
    callbacks=(),
    ga=1,
    save_steps=0,
    eval_rows=0,
    lr=1e-2,
    max_grad_norm=1.0,
    torch_compile=False,
    bf16=False,
):
    args = TrainingArguments(
        torch_compile=torch_compile,
        bf16=bf16,
        output_dir=str(out),
        use_cpu=True,
        report_to=[],
        max_steps=max_steps,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=16,
        gradient_accumulation_steps=ga,
        logging_steps=1,
        disable_tqdm=True,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        seed=0,
        learning_rate=lr,
        lr_scheduler_type="linear",
        warmup_steps=0,
        max_grad_norm=max_grad_norm,
    )
    data = rows()
    return Trainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=data[:eval_rows] if eval_rows else None,
        optimizers=opt if opt is not None else (None, None),
        callbacks=list(callbacks),
    )


def losses(trainer: Trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def q_proj_B(model):
    return model.model.layers[0].self_attn.q_proj.B


def q_proj_pair(model):
    layer = model.model.layers[0].self_attn.q_proj
    return layer.B, layer.A


# ----------------------------------------------------------------------------------------------
# The factory


def test_create_optimizer_uses_the_trainers_groups_and_schedule():
    model = tiny_model()
    opt, sched = hf.create_optimizer(
        model, "galore", num_training_steps=40, lr=3e-3, rank=8, weight_decay=0.1
    )
    cfg = hf.build_run_config(model, "galore", num_training_steps=40, lr=3e-3, rank=8, weight_decay=0.1)
    ref = optim_setup.build_param_groups(model, cfg)
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [
        [id(p) for p in g["params"]] for g in ref
    ]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.1, 0.0]
    assert opt.param_groups[0]["rank"] == 8 and opt.param_groups[0]["project"]
    assert type(opt).__name__ == "GaLoreAdamW"
    for s in range(41):
        assert sched.lr_lambdas[0](s) == optim_setup.lr_factor(s, cfg)
    assert (
        hf.apply_factorization
        is __import__("effpretrain.models.factorized", fromlist=["x"]).apply_factorization
    )


def test_create_optimizer_rejects_unknown_method_naming_the_choices():
    with pytest.raises(ValueError, match=r"adamw.*galore"):
        hf.create_optimizer(tiny_model(), "sgd_fancy", num_training_steps=10, lr=1e-3)


def test_restarts_give_the_wrapper_over_the_models_factor_pairs():
    model = lowrank_model()
    opt, _ = hf.create_optimizer(model, "adamw", num_training_steps=10, lr=1e-3, restarts_every=5)
    assert isinstance(opt, Restarts) and opt.every == 5 and opt.refactorize and opt.reset_momentum
    assert [tuple(map(id, p)) for p in opt.factor_pairs()] == [tuple(map(id, p)) for p in factor_pairs(model)]
    plain, _ = hf.create_optimizer(lowrank_model(), "adamw", num_training_steps=10, lr=1e-3)
    assert not isinstance(plain, Restarts)


# ----------------------------------------------------------------------------------------------
# Training, logs, events


@pytest.mark.run
@pytest.mark.fast
def test_galore_trains_and_logs_memory_and_perplexity(tmp_path):
    model = tiny_model()
    opt = hf.create_optimizer(model, "galore", num_training_steps=20, lr=1e-2, rank=8, update_proj_gap=10)
    cb = hf.EffPretrainCallback()
    tr = make_trainer(tmp_path, model, max_steps=20, opt=opt, callbacks=[cb], eval_rows=16)
    tr.train()
    loss = losses(tr)
    assert sum(loss[s] for s in (18, 19, 20)) < sum(loss[s] for s in (1, 2, 3)) - 0.3
    train_logs = [h for h in tr.state.log_history if "loss" in h]
    for h in train_logs:
        assert h["ppl"] == pytest.approx(math.exp(h["loss"]))
        assert h["optimizer_state_bytes"] > 0 and h["peak_memory_bytes"] > 0
        assert h["opt/refreshes"] >= 1
    # The analytic estimate (from the model's shape: a Llama, though no preset's) is the exact
    # state size the optimizer holds.
    first = train_logs[0]
    assert cb.estimate.detail["source"] == "model:LlamaForCausalLM 2 x 64"
    assert first["est_optimizer_state_bytes"] == first["optimizer_state_bytes"]
    assert first["est_weights_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    summary = tr.state.log_history[-1]
    assert "train_loss" in summary and summary["train_ppl"] == pytest.approx(math.exp(summary["train_loss"]))
    assert "est_total_bytes" in summary
    metrics = tr.evaluate()
    assert metrics["eval_ppl"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert tr.state.log_history[-1]["eval_ppl"] == metrics["eval_ppl"]


EVERY, RECOVERY, STEPS = 5, 3, 15


@pytest.fixture(scope="module")
def wrapper_run(tmp_path_factory):
    """Low-Rank + restarts from create_optimizer (the Restarts wrapper), gradient accumulation 2."""
    model = lowrank_model()
    opt = hf.create_optimizer(
        model, "adamw", num_training_steps=STEPS, lr=1e-2, restarts_every=EVERY, recovery_steps=RECOVERY
    )
    cb = hf.EffPretrainCallback(restarts_every=EVERY)  # same period: must not fire a second time
    probe = Probe(q_proj_B(model), q_proj_pair(model))
    tr = make_trainer(
        tmp_path_factory.mktemp("wrapper"), model, max_steps=STEPS, opt=opt, callbacks=[cb, probe], ga=2
    )
    tr.train()
    cfg = hf.build_run_config(
        model, "adamw", num_training_steps=STEPS, lr=1e-2, restarts_every=EVERY, recovery_steps=RECOVERY
    )
    return tr, cb, probe, cfg


def _check_events(probe: Probe, cfg, every: int, steps: int) -> None:
    boundaries = [n for n in range(1, steps + 1) if n % every == 0]
    # Right after update k T the Adam state is fresh (step 0, zero moments), and only then.
    assert probe.step == {n: n % every for n in range(1, steps + 1)}
    assert [n for n, v in probe.exp_avg_norm.items() if v == 0.0] == boundaries
    # ... and the factor pair was re-split into its balanced form (B^T B = A A^T diagonal).
    assert [n for n, b in probe.balanced.items() if b] == boundaries
    # The LR of update n is lr * lr_factor(n - 1): the ramp restarts after each boundary.
    for n, lr in probe.lr.items():
        assert lr == pytest.approx(cfg.optim.lr * optim_setup.lr_factor(n - 1, cfg), rel=1e-9, abs=1e-15)
    assert probe.lr[every + 1] < 1e-3 * probe.lr[every]


@pytest.mark.run
def test_lowrank_restarts_train_and_fire_exactly_at_the_boundaries(wrapper_run):
    tr, cb, probe, cfg = wrapper_run
    loss = losses(tr)
    assert sum(loss[s] for s in (STEPS - 2, STEPS - 1, STEPS)) < sum(loss[s] for s in (1, 2, 3)) - 0.3
    _check_events(probe, cfg, EVERY, STEPS)
    wrapper = hf._find_restarts(tr.optimizer)
    assert wrapper.num_steps == STEPS and wrapper.num_restarts == STEPS // EVERY
    assert cb.num_restarts == 0  # the wrapper fired them, the callback did not
    assert tr.state.log_history[-1]["opt/restarts"] == STEPS // EVERY


@pytest.mark.run
def test_callback_fires_the_same_events_as_the_wrapper(wrapper_run, tmp_path):
    ref, _, _, cfg = wrapper_run
    model = lowrank_model()
    opt = hf.create_optimizer(model, "adamw", num_training_steps=STEPS, lr=1e-2)  # no restarts in it
    cb = hf.EffPretrainCallback(restarts_every=EVERY, recovery_steps=RECOVERY)
    probe = Probe(q_proj_B(model), q_proj_pair(model))
    tr = make_trainer(tmp_path, model, max_steps=STEPS, opt=opt, callbacks=[cb, probe], ga=2)
    tr.train()
    _check_events(probe, cfg, EVERY, STEPS)
    assert cb.num_updates == STEPS and cb.num_restarts == STEPS // EVERY
    a, b = losses(ref), losses(tr)
    assert a.keys() == b.keys()
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-6, abs=1e-6)
    # The logged LR is the one used, ramp included.
    for h in tr.state.log_history:
        if "learning_rate" in h:
            assert h["learning_rate"] == pytest.approx(probe.lr[h["step"]])


@pytest.mark.run
def test_callback_restarts_the_trainers_own_optimizer(tmp_path):
    model = tiny_model()
    cb = hf.EffPretrainCallback(restarts_every=3, recovery_steps=2)
    probe = Probe(model.model.layers[0].self_attn.q_proj.weight)
    tr = make_trainer(tmp_path, model, max_steps=7, callbacks=[cb, probe], ga=2)
    tr.train()
    assert type(unwrap_optimizer(tr.optimizer)).__name__ == "AdamW"
    assert probe.step == {n: n % 3 for n in range(1, 8)}
    assert [n for n, v in probe.exp_avg_norm.items() if v == 0.0] == [3, 6]
    # lr_scheduler_type="linear" from lr: the ramp multiplies the Trainer's own schedule.
    for n in (4, 5):
        sched = 1e-2 * (1 - (n - 1) / 7)
        assert probe.lr[n] == pytest.approx(sched * recovery_factor(n - 1, 3, 2))
    assert probe.lr[6] == pytest.approx(1e-2 * (1 - 5 / 7))


@pytest.mark.run
def test_callback_refuses_a_second_restart_period(tmp_path):
    model = lowrank_model()
    opt = hf.create_optimizer(model, "adamw", num_training_steps=4, lr=1e-2, restarts_every=2)
    tr = make_trainer(
        tmp_path, model, max_steps=4, opt=opt, callbacks=[hf.EffPretrainCallback(restarts_every=3)]
    )
    with pytest.raises(ValueError, match="restarts every 2"):
        tr.train()


# ----------------------------------------------------------------------------------------------
# Resume through the Trainer's own checkpoints


# Split at update 4 of 8: restarts every 3 (one before the split, one after), the LR ramp of R = 2
# still running at the split; GaLore refreshes its bases every 3 updates (at 1, 4, 7).
N, SPLIT = 8, 4


def _resume_case(case: str, seed: int = 0):
    if case == "galore":
        model = tiny_model(seed)
        opt = hf.create_optimizer(model, "galore", num_training_steps=N, lr=1e-2, rank=8, update_proj_gap=3)
        return model, opt, [hf.EffPretrainCallback()]
    model = lowrank_model(seed)
    if case == "lowrank_restarts":
        opt = hf.create_optimizer(
            model, "adamw", num_training_steps=N, lr=1e-2, restarts_every=3, recovery_steps=2
        )
        return model, opt, [hf.EffPretrainCallback()]
    opt = hf.create_optimizer(model, "adamw", num_training_steps=N, lr=1e-2)
    return model, opt, [hf.EffPretrainCallback(restarts_every=3, recovery_steps=2)]


@pytest.mark.parametrize("case", ["galore", "lowrank_restarts", "callback_restarts"])
@pytest.mark.run
def test_resume_from_trainer_checkpoint_repeats_the_straight_run(case, tmp_path):
    model, opt, cbs = _resume_case(case)
    straight = make_trainer(
        tmp_path / "a", model, max_steps=N, opt=opt, callbacks=cbs, ga=2, save_steps=SPLIT
    )
    straight.train()
    ckpt = tmp_path / "a" / f"checkpoint-{SPLIT}"
    assert (ckpt / "optimizer.pt").is_file() and (ckpt / "scheduler.pt").is_file()
    if case == "callback_restarts":  # the ramp was scaling the LR when the checkpoint was written
        assert '"scheduled_lrs": [' in (ckpt / "trainer_state.json").read_text()

    # A fresh process would build a different init: the checkpoint must overwrite all of it.
    model, opt, cbs = _resume_case(case, seed=1)
    resumed = make_trainer(tmp_path / "b", model, max_steps=N, opt=opt, callbacks=cbs, ga=2, save_steps=SPLIT)
    resumed.train(resume_from_checkpoint=str(ckpt))
    # The history holds steps 1..SPLIT from the checkpoint's trainer_state.json, the rest from this run.
    a, b = losses(straight), {s: v for s, v in losses(resumed).items() if s > SPLIT}
    assert sorted(b) == list(range(SPLIT + 1, N + 1))
    # Bitwise (weights, optimizer state, schedule, data order restored): the resumed run executes
    # the same kernels in the same order as the straight one.
    assert b == {s: a[s] for s in b}
    # The LambdaLR was restored with the checkpoint (same position in the schedule).
    assert resumed.lr_scheduler.last_epoch == straight.lr_scheduler.last_epoch == N
    wrapper = hf._find_restarts(resumed.optimizer)
    if wrapper is not None:
        assert (wrapper.num_steps, wrapper.num_restarts) == (N, 2)
    if case == "callback_restarts":
        assert (cbs[0].num_updates, cbs[0].num_restarts) == (N, 2)


# ----------------------------------------------------------------------------------------------
# Memory estimate for a preset-shaped model


@pytest.mark.parametrize("method", ["adamw", "galore", "adam_mini"])
def test_estimate_for_a_preset_model_is_effpretrains_and_matches_measured(method):
    model = build_model("tiny", vocab_size=256, max_positions=SEQ)
    opt, _ = hf.create_optimizer(model, method, num_training_steps=4, lr=1e-3, rank=16)
    est = hf.estimate_memory(model, opt, batch_size=BATCH, seq_len=SEQ)
    assert est.detail["source"] == "preset:tiny"
    cfg = hf.build_run_config(model, method, num_training_steps=4, lr=1e-3, rank=16)
    cfg.train.batch_size, cfg.data.seq_len = BATCH, SEQ
    # Under the HF Trainer the model computes its own (standard) loss and no effpretrain stream
    # holds a shuffle buffer: the run config that matches it says so.
    cfg.train.loss, cfg.data.shuffle_buffer = "standard", 0
    assert est.as_dict() == {**memory.estimate_from_config(cfg, 256).as_dict(), "source": "preset:tiny"}
    x = torch.randint(0, 256, (2, SEQ))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    assert est.optimizer_state == optimizers.measured_state_bytes(opt)
    assert est.weights == sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.activations > 0


def test_estimate_knows_updates_in_backward():
    """An optimizer from create_optimizer(update_in_backward=True) is estimated with the
    in-backward gradient terms (accumulators + gradients in flight), as the trainer's config is."""
    model = build_model("tiny", vocab_size=256, max_positions=SEQ)
    kw = {"num_training_steps": 4, "lr": 1e-3, "rank": 16}
    normal = hf.estimate_memory(
        model, hf.create_optimizer(model, "galore", **kw)[0], batch_size=BATCH, seq_len=SEQ
    )
    opt, _ = hf.create_optimizer(model, "galore", update_in_backward=True, **kw)
    est = hf.estimate_memory(model, opt, batch_size=BATCH, seq_len=SEQ, grad_accum=2, grad_clip=0.0)
    cfg = hf.build_run_config(model, "galore", update_in_backward=True, **kw)
    cfg.train.batch_size, cfg.data.seq_len, cfg.train.grad_accum, cfg.train.grad_clip = BATCH, SEQ, 2, 0.0
    cfg.train.loss, cfg.data.shuffle_buffer = "standard", 0
    assert est.as_dict() == {**memory.estimate_from_config(cfg, 256).as_dict(), "source": "preset:tiny"}
    assert est.detail["update_in_backward"] and "update_in_backward" not in normal.detail
    one = hf.estimate_memory(model, opt, batch_size=BATCH, seq_len=SEQ)
    assert one.grads < normal.grads  # K = 1: only the gradients in flight


# ----------------------------------------------------------------------------------------------
# The README example


@pytest.mark.run
def test_readme_example_runs_as_written(example_run):
    proc, out_dir = example_run
    try:
        proc.wait(timeout=300)
    finally:
        proc.kill()
    stdout, stderr = (out_dir / "stdout").read_text(), (out_dir / "stderr").read_text()
    assert proc.returncode == 0, stderr[-3000:]
    m = re.search(r"eval_loss ([\d.]+) +eval_ppl ([\d.]+)", stdout)
    assert m, stdout[-2000:]
    assert float(m.group(2)) == pytest.approx(math.exp(float(m.group(1))), rel=1e-2)
    assert (out_dir / "runs" / "hf-lowrank").is_dir()


def test_docs_show_the_example_verbatim():
    page = (ROOT / "docs" / "hf.md").read_text()
    assert "examples/hf_trainer.py" in page, "docs/hf.md does not name the example"
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert EXAMPLE.read_text() in blocks, (
        "docs/hf.md's Trainer example must be examples/hf_trainer.py verbatim"
    )


# ----------------------------------------------------------------------------------------------
# update_in_backward under the Trainer


class GradProbe(TrainerCallback):
    """Whether any gradient is alive when the Trainer is about to step."""

    def __init__(self, model):
        self.model = model
        self.alive: list[bool] = []

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.alive.append(any(p.grad is not None for p in self.model.parameters()))


class PrevNormClip(TrainerCallback):
    """Reference for the documented in-backward clipping rule on the normal path: step t's gradients
    times min(1, c / (||G_{t-1}|| + 1e-6)), the first step unclipped; ||G|| in fp64, rounded to fp32."""

    def __init__(self, model, max_norm):
        self.model, self.max_norm, self.prev = model, max_norm, None

    def on_pre_optimizer_step(self, args, state, control, **kw):
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = float(torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt().float())
        if self.prev is not None:
            coef = torch.clamp(self.max_norm / (torch.tensor(self.prev) + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
        self.prev = norm


def _inb_case(case: str, steps: int, inb: bool):
    if case == "lowrank_restarts":
        model = lowrank_model()
        opt = hf.create_optimizer(
            model, "adamw", num_training_steps=steps, lr=1e-2, restarts_every=2, update_in_backward=inb
        )
    elif case == "galore":
        model = tiny_model()
        opt = hf.create_optimizer(
            model,
            "galore",
            num_training_steps=steps,
            lr=1e-2,
            rank=8,
            update_proj_gap=3,
            update_in_backward=inb,
        )
    else:
        model = tiny_model()
        opt = hf.create_optimizer(model, case, num_training_steps=steps, lr=1e-2, update_in_backward=inb)
    return model, opt


def _logged(tr: Trainer, key: str) -> dict[int, float]:
    return {h["step"]: h[key] for h in tr.state.log_history if "loss" in h}


def _inb_pair(tmp_path, case, ga, steps, max_grad_norm=0.0, ref_callbacks=lambda model: []):
    runs = []
    for inb in (False, True):
        model, opt = _inb_case(case, steps, inb)
        probe = GradProbe(model)
        cbs = [hf.EffPretrainCallback(), probe, *([] if inb else ref_callbacks(model))]
        tr = make_trainer(
            tmp_path / str(inb),
            model,
            max_steps=steps,
            opt=opt,
            callbacks=cbs,
            ga=ga,
            max_grad_norm=max_grad_norm if inb else 0.0,
        )
        tr.train()
        runs.append((model, tr, probe))
    return runs


# (method, gradient accumulation, updates): 16 micro-batches an epoch, so accumulation 3 over 7
# updates has a short sixth update (one micro-batch) at the epoch's end.
@pytest.mark.parametrize(
    "case,ga,steps", [("adamw", 2, 6), ("adamw", 3, 7), ("lowrank_restarts", 2, 6), ("galore", 2, 6)]
)
@pytest.mark.run
def test_update_in_backward_equals_the_trainers_own_steps(case, ga, steps, tmp_path):
    (ref, normal, ref_probe), (model, tr, probe) = _inb_pair(tmp_path, case, ga, steps)
    assert ref_probe.alive == [True] * steps and probe.alive == [False] * steps  # freed in backward
    for p, q in zip(ref.parameters(), model.parameters()):
        if case == "galore":  # sums projected micro-gradients: proj(back(R) + G_K) = R + proj(G_K) + rounding
            assert torch.allclose(q, p, rtol=1e-5, atol=1e-5 * float(p.detach().abs().max()))
        else:
            # Bitwise: acc + G_k is autograd's own accumulation order, and stepping one parameter
            # at a time runs the same kernels (torch's foreach AdamW loops over per-tensor
            # kernels on CPU).
            assert torch.equal(q, p)
    assert _logged(tr, "learning_rate") == _logged(normal, "learning_rate")  # the schedule's, exactly
    norms, ref_norms = _logged(tr, "grad_norm"), _logged(normal, "grad_norm")
    assert sorted(norms) == list(range(1, steps + 1)) and all(v > 0 for v in norms.values())
    # The Trainer's norm is fp32 norm-of-norms, the engine's an fp64 sum of squares: rounding apart.
    # GaLore's low-rank accumulators give the norm of back(R) + G_K between refreshes (steps 1, 4 refresh).
    same = [1, 4] if case == "galore" else list(norms)
    assert [norms[s] for s in same] == pytest.approx([ref_norms[s] for s in same], rel=1e-6)
    if case == "lowrank_restarts":
        wrapper = hf._find_restarts(tr.optimizer)
        assert (wrapper.num_steps, wrapper.num_restarts) == (steps, steps // 2)  # once per update
    if ga == 3:
        epochs = {h["step"]: h["epoch"] for h in tr.state.log_history if "loss" in h}
        assert (epochs[5], epochs[6]) == (15 / 16, 1.0)  # update 6 was one micro-batch


@pytest.mark.parametrize("case", ["galore", "adamw-in-backward"])
@pytest.mark.run
def test_compiled_models_train_as_eager_ones(case, tmp_path):
    """`compile_blocks` before the Trainer (regional, effpretrain's) and the Trainer's own
    ``torch_compile=True`` (Accelerate compiles the whole model) both train with the factory's
    optimizer and the callback, updates in backward included, as the eager model does."""
    from effpretrain.compile import compile_blocks

    method, inb = case.split("-")[0], case.endswith("in-backward")
    runs = {}
    for mode in ("eager", "blocks", "trainer"):
        model = tiny_model()
        if mode == "blocks":
            compile_blocks(model)
        opt = hf.create_optimizer(
            model, method, num_training_steps=4, lr=1e-2, rank=8, update_in_backward=inb
        )
        tr = make_trainer(
            tmp_path / mode,
            model,
            max_steps=4,
            opt=opt,
            callbacks=[hf.EffPretrainCallback()],
            torch_compile=mode == "trainer",
        )
        if mode == "trainer" and inb:  # prepared without a DDP wrapper, as under several processes
            hf.prepare_trainer(tr)
        tr.train()
        runs[mode] = losses(tr)
        if mode == "trainer":  # the Trainer (or prepare_trainer) compiled the whole model
            assert type(tr.model_wrapped).__name__ == "OptimizedModule"
    assert sorted(runs["eager"]) == [1, 2, 3, 4]
    for mode in ("blocks", "trainer"):
        assert runs[mode] == pytest.approx(runs["eager"], rel=1e-5)


@pytest.mark.run
def test_update_in_backward_clips_with_the_previous_steps_norm(tmp_path):
    c = 1.5  # the tiny model's norms grow from 1.3 to 2.9 over 6 updates: steps 3.. are clipped
    (ref, normal, _), (model, tr, _) = _inb_pair(
        tmp_path, "adamw", 2, 6, max_grad_norm=c, ref_callbacks=lambda m: [PrevNormClip(m, c)]
    )
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    assert _logged(tr, "grad_norm") == pytest.approx(_logged(normal, "grad_norm"), rel=1e-6)
    assert sum(v > c for v in _logged(tr, "grad_norm").values()) >= 3
    # ... and clipping changed the run: without it the weights end elsewhere.
    plain, opt = _inb_case("adamw", 6, False)
    make_trainer(tmp_path / "plain", plain, max_steps=6, opt=opt, ga=2, max_grad_norm=0.0).train()
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(plain.parameters(), model.parameters()))
    assert moved > 1e-4


@pytest.mark.run
def test_update_in_backward_resumes_exactly_with_clipping(tmp_path):
    def trainer(out, seed):
        model = tiny_model(seed)
        opt = hf.create_optimizer(model, "adamw", num_training_steps=N, lr=1e-2, update_in_backward=True)
        cb = hf.EffPretrainCallback()
        return make_trainer(out, model, max_steps=N, opt=opt, callbacks=[cb], ga=2, save_steps=SPLIT)

    straight = trainer(tmp_path / "a", 0)
    straight.train()
    ckpt = tmp_path / "a" / f"checkpoint-{SPLIT}"
    saved = json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved["EffPretrainCallback"]["attributes"]["in_backward_prev_norm"] == pytest.approx(
        _logged(straight, "grad_norm")[SPLIT]
    )
    resumed = trainer(tmp_path / "b", 1)
    resumed.train(resume_from_checkpoint=str(ckpt))
    a, b = losses(straight), {s: v for s, v in losses(resumed).items() if s > SPLIT}
    assert sorted(b) == list(range(SPLIT + 1, N + 1)) and b == {s: a[s] for s in b}
    assert _logged(resumed, "grad_norm")[N] == _logged(straight, "grad_norm")[N]


@pytest.mark.run
def test_prepare_trainer_keeps_accelerates_preparation_without_a_wrapper(tmp_path):
    """`prepare_trainer` (what several processes need) has Accelerate place the model and wrap its
    forward in bf16 autocast, as the Trainer's own preparation does, and the Trainer then trains
    the model itself; it refuses what the callback refuses, and leaves other optimizers alone."""
    model = tiny_model()
    opt = hf.create_optimizer(model, "adamw", num_training_steps=2, lr=1e-2, update_in_backward=True)
    tr = make_trainer(
        tmp_path / "a", model, max_steps=2, opt=opt, callbacks=[hf.EffPretrainCallback()], bf16=True
    )
    hf.prepare_trainer(tr)
    assert model._is_accelerate_prepared and hasattr(model, "_original_forward")  # autocast
    with torch.no_grad():
        logits = model(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits
    assert logits.dtype == torch.float32  # Accelerate's convert_outputs_to_fp32 around bf16 autocast
    tr.train()
    assert tr.model_wrapped is model and len(losses(tr)) == 2
    other = tiny_model()
    plain = make_trainer(
        tmp_path / "b",
        other,
        max_steps=2,
        opt=hf.create_optimizer(other, "adamw", num_training_steps=2, lr=1e-2),
    )
    hf.prepare_trainer(plain)  # not an in-backward optimizer: nothing to do
    assert not getattr(other, "_is_accelerate_prepared", False)
    third = tiny_model()
    opt = hf.create_optimizer(third, "adamw", num_training_steps=2, lr=1e-2, update_in_backward=True)
    refused = make_trainer(tmp_path / "c", third, max_steps=2, opt=opt, callbacks=[hf.EffPretrainCallback()])
    refused.args.fp16 = True
    with pytest.raises(ConfigError, match="fp16's GradScaler"):
        hf.prepare_trainer(refused)


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"fp16": True}, "fp16's GradScaler unscales"),
        ({"deepspeed": "ds_config.json"}, "DeepSpeed partitions the gradients"),
        ({"fsdp": "full_shard"}, "FSDP reduce-scatters the gradients"),
        ({}, "needs EffPretrainCallback"),
    ],
)
@pytest.mark.run
def test_update_in_backward_refuses_what_the_trainer_makes_impossible(setting, message, tmp_path):
    """Several processes are not refused (`prepare_trainer`, tests/test_hf_ddp.py)."""
    model = tiny_model()
    opt = hf.create_optimizer(model, "adamw", num_training_steps=2, lr=1e-2, update_in_backward=True)
    cbs = [hf.EffPretrainCallback()] if setting else []
    tr = make_trainer(tmp_path, model, max_steps=2, opt=opt, callbacks=cbs)
    before = [p.detach().clone() for p in model.parameters()]
    for key, value in setting.items():  # what the callback reads when training starts
        setattr(tr.args, key, value)
    with pytest.raises((ConfigError, RuntimeError), match=message):
        tr.train()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # nothing stepped

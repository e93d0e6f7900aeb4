"""ReLoRA's full-rank warm start (`factor.warm_start_steps`): the two phases, the switch between
them, the schedule, the memory estimate, exact resume across the switch and DDP parity.

The reference run: tiny ReLoRA, warm start N = 3, merges every T = 3 (so after steps 6 and 9 of
a 10-step run: N + k T), LR re-ramp R = 2, a checkpoint after every step.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from _common import ROOT, assert_resumed_from
from distributed_helpers import rel_diff, run_worker_pair
from safetensors.torch import load_file

from effpretrain import cli
from effpretrain.checkpoint import load_checkpoint
from effpretrain.config import load_config
from effpretrain.errors import ConfigError
from effpretrain.memory import estimate_from_config
from effpretrain.models import FACTOR_KINDS, FactorSpec, ReLoRALinear
from effpretrain.models.factorized import (
    begin_warm_start_,
    end_warm_start_,
    warm_start_layers,
    warm_start_params,
)
from effpretrain.optim_setup import build_param_groups, lr_factor, warm_start_steps
from effpretrain.run_model import build_run_model
from effpretrain.trainer import Trainer, train
from optimizers import Restarts

RECIPE = ROOT / "recipes" / "tiny" / "relora.yaml"
N, T, R, STEPS = 3, 3, 2, 10
OVER = [
    "data.seq_len=32",
    "data.vocab_size=512",
    "train.batch_size=4",
    "train.eval_tokens=128",
    "train.log_every=1",
    "train.plot=false",
    "train.eval_every=0",
    f"train.max_steps={STEPS}",
    "factor.rank=8",
    f"factor.warm_start_steps={N}",
    f"restarts.every={T}",
    f"restarts.recovery_steps={R}",
]
SAVED = OVER + ["train.save_every=1", f"train.keep_checkpoints={STEPS}"]


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step}" / "model.safetensors"))


def layer_names(sd: dict[str, torch.Tensor]) -> list[str]:
    """The ReLoRA layers' module names (those with a W0 `weight` beside factors `B` and `A`)."""
    return sorted(k[: -len(".B")] for k in sd if k.endswith(".B"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference run, a checkpoint after every step."""
    out = tmp_path_factory.mktemp("warm") / "run"
    summary = train(load_config(RECIPE, SAVED), out)
    return out, summary


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["none", *(k for k, s in FACTOR_KINDS.items() if not s.warm_starts)])
def test_kinds_without_a_warm_start_are_refused(kind):
    cfg = load_config(None, [f"factor.kind={kind}", "factor.warm_start_steps=5"])
    with pytest.raises(
        ConfigError, match="factor.warm_start_steps=5 needs a factor.kind that warm-starts"
    ) as e:
        warm_start_steps(cfg)
    assert "\n" not in str(e.value)
    assert warm_start_steps(load_config(None, [f"factor.kind={kind}"])) == 0


def test_cli_refuses_a_warm_start_of_lora_with_exit_2(tmp_path, capsys):
    recipe = ROOT / "recipes" / "tiny" / "lora.yaml"
    args = ["train", str(recipe), "--out", str(tmp_path / "run"), "--set", "factor.warm_start_steps=2"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "factor.warm_start_steps=2" in err[0] and "lora" in err[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fsdp2_on_several_processes_is_refused_and_ddp_is_not():
    cfg = load_config(RECIPE, ["factor.warm_start_steps=4", "dist.sharding=fsdp2"])
    with pytest.raises(ConfigError, match="not supported with dist.sharding=fsdp2 on 2 processes"):
        warm_start_steps(cfg, world_size=2)
    assert warm_start_steps(cfg, world_size=1) == 4  # one process never shards
    cfg.dist.sharding = "ddp"
    assert warm_start_steps(cfg, world_size=2) == 4


def test_a_warm_start_as_long_as_the_run_is_allowed_with_a_warning(caplog):
    cfg = load_config(RECIPE, ["factor.warm_start_steps=300", "train.max_steps=300"])
    with caplog.at_level("WARNING", logger="effpretrain"):
        assert warm_start_steps(cfg) == 300
    assert "the factors never train" in caplog.text


def test_registry_row_warm_starts_only_with_a_frozen_dense_weight():
    assert FACTOR_KINDS["relora"].warm_starts and FACTOR_KINDS["relora"].frozen_dense
    with pytest.raises(ValueError, match="warm_starts needs frozen_dense"):
        FactorSpec("bad", ReLoRALinear, warm_starts=True)


def test_param_groups_are_the_same_in_both_phases():
    """One group list for both phases, so either phase's optimizer state loads: B and A in the
    decay group while frozen, the W0 in a last plain group with the run's weight decay."""
    cfg = load_config(RECIPE, OVER + ["optim.weight_decay=0.1"])
    model, _ = build_run_model(cfg, 512)
    w0s = warm_start_params(model)
    assert len(w0s) == 4 * 7 and all(not w.requires_grad for w in w0s)

    def ids(groups):
        return [([id(p) for p in g["params"]], g["weight_decay"]) for g in groups]

    before = ids(build_param_groups(model, cfg))
    assert begin_warm_start_(model) == len(w0s)
    warm = ids(build_param_groups(model, cfg))
    assert end_warm_start_(model) == len(w0s)
    assert before == warm == ids(build_param_groups(model, cfg))
    assert warm[-1] == ([id(w) for w in w0s], 0.1)
    flat = [i for g, _ in warm for i in g]
    assert len(flat) == len(set(flat)) == len(list(model.parameters()))
    cfg.factor.warm_start_steps = 0  # without a warm start the W0 stay out, as before
    assert len([i for g, _ in ids(build_param_groups(model, cfg)) for i in g]) == len(flat) - len(w0s)


# -- the schedule -----------------------------------------------------------------------------


def test_restarts_start_shifts_the_cycle():
    p = torch.nn.Parameter(torch.ones(2))
    fired: list[int] = []
    opt = Restarts(torch.optim.SGD([p], lr=0.1), [], 3, False, False, start=4)
    opt.hooks.append(lambda: fired.append(opt.num_steps))
    for _ in range(13):
        p.grad = torch.ones(2)
        opt.step()
    assert fired == [7, 10, 13]  # after updates start + k every, none during the first `start`
    assert opt.state_dict()["restarts"] == {"step": 13, "count": 3}
    with pytest.raises(ValueError, match="start must be an int >= 0"):
        Restarts(torch.optim.SGD([p], lr=0.1), [], 3, start=-1)


def test_lr_ramps_after_the_switch_and_after_each_merge():
    """Constant schedule: 1 during the warm start; the switch and each merge (after steps N + k T)
    are followed by the recovery ramp floor, floor + (1 - floor) / R, then 1."""
    base = ["train.schedule=constant", "train.warmup_ratio=0", "train.max_steps=100"]
    cfg = load_config(RECIPE, base + [f"factor.warm_start_steps={N}", f"restarts.every={T}"])
    cfg.restarts.recovery_steps = R
    ramp = [1e-3, 1e-3 + (1 - 1e-3) / R, 1.0]
    got = [lr_factor(s, cfg) for s in range(N + 2 * T + 1)]
    assert got == pytest.approx([1.0] * N + ramp + ramp + ramp[:1], rel=1e-12)
    cfg.restarts.every = 0  # no merges: the switch alone re-ramps
    assert [lr_factor(s, cfg) for s in range(N + 4)] == pytest.approx([1.0] * N + ramp + [1.0])
    cfg.restarts.recovery_steps = 0  # no ramp at all
    assert {lr_factor(s, cfg) for s in range(10)} == {1.0}
    # The global schedule is the run's: the warm start changes only the ramp.
    cos = load_config(RECIPE, ["train.max_steps=100", f"factor.warm_start_steps={N}", "restarts.every=0"])
    plain = load_config(RECIPE, ["train.max_steps=100", "restarts.every=0"])
    outside = [*range(N), *range(N + cos.restarts.recovery_steps, 100)]  # all but the ramp
    assert [lr_factor(s, cos) for s in outside] == [lr_factor(s, plain) for s in outside]
    assert lr_factor(N, cos) == pytest.approx(1e-3 * lr_factor(N, plain))


@pytest.mark.run
def test_logged_lr_follows_lr_factor(straight):
    run, _ = straight
    cfg = load_config(RECIPE, SAVED)
    logs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = {e["step"]: e["lr"] for e in logs if "lr" in e}
    # The LR logged at step k is the one set for update k + 1.
    assert lrs == pytest.approx({k: cfg.optim.lr * lr_factor(k, cfg) for k in range(1, STEPS + 1)})
    restarts = {e["step"]: e["opt/restarts"] for e in logs if "lr" in e}
    assert restarts == {k: (k >= N + T) + (k >= N + 2 * T) for k in range(1, STEPS + 1)}


# -- the two phases, as the checkpoints show them ---------------------------------------------


@pytest.mark.run
@pytest.mark.fast
def test_warm_start_trains_w0_then_the_factors(straight, tmp_path):
    run, _ = straight
    # The initial weights: a trainer set up as the run's was (same seed and RNG use), not stepped.
    t = Trainer(load_config(RECIPE, SAVED), tmp_path / "init")
    init = t.acc.unwrap_model(t.model).state_dict()
    sd = {k: weights(run, k) for k in range(1, STEPS + 1)}
    sd[0] = {k: init[k] for k in sd[1]}
    assert all(sd[k].keys() == sd[1].keys() for k in sd)  # same state_dict keys in both phases
    names = layer_names(sd[1])
    assert len(names) == 4 * 7
    eq = torch.equal
    for name in names:
        w, b, a = (f"{name}.{x}" for x in ("weight", "B", "A"))
        # Steps 1..N: W0 moves every step, the factors stay at their init (B = 0).
        assert all(not eq(sd[k][w], sd[k - 1][w]) for k in range(1, N + 1)), name
        assert all(eq(sd[k][a], sd[0][a]) and not sd[k][b].any() for k in range(N + 1)), name
        # After the switch W0 is frozen until the first merge, after step N + T.
        assert all(eq(sd[k][w], sd[N][w]) for k in range(N, N + T)), name
        assert all(sd[k][b].any() for k in range(N + 1, N + T)), name
        # (A's first gradient is s B^T G x^T = 0, with B = 0: A moves from the second factor step.)
        assert eq(sd[N + 1][a], sd[N][a]) and not eq(sd[N + 2][a], sd[N + 1][a]), name
        assert not eq(sd[N + T][w], sd[N + T - 1][w]) and not sd[N + T][b].any(), name
    emb = "model.embed_tokens.weight"
    assert all(not eq(sd[k][emb], sd[k - 1][emb]) for k in range(1, STEPS + 1))


@pytest.mark.run
def test_switch_frees_w0_state_and_gives_the_factors_fresh_state(straight):
    run, _ = straight
    cfg = load_config(RECIPE, SAVED)
    model, _ = build_run_model(cfg, 512)
    groups = build_param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    index = [names[id(p)] for g in groups for p in g["params"]]  # the optimizer's param order

    def stepped(k: int) -> set[str]:
        opt = load_checkpoint(run / "checkpoints" / f"step-{k}")["optimizer"]
        return {index[i] for i in opt["state"]}

    w0 = {names[id(w)] for w in warm_start_params(model)}
    factors = {names[id(p)] for layer in warm_start_layers(model) for p in layer.factor_pair()}
    assert len(w0) == 4 * 7 and len(factors) == 2 * 4 * 7
    for k in range(1, N):
        assert w0 <= stepped(k) and not factors & stepped(k)
    # At step N the checkpoint is written after the switch: no W0 state, and none yet for B, A.
    assert not (w0 | factors) & stepped(N)
    for k in range(N + 1, STEPS + 1):
        assert factors <= stepped(k) and not w0 & stepped(k)


# -- memory -----------------------------------------------------------------------------------


@pytest.mark.run
def test_estimate_reports_both_phases_and_the_warm_start_peak(straight):
    """The warm start trains W0 (m n gradient and AdamW state per target): the estimate's peak; the
    factorized phase is the run without a warm start. The measured optimizer state matches each
    phase's estimate on the steps of that phase (logged after each step); the summary's measured
    gradient bytes are the phase the run ends in (measured again after the switch, so a run
    resumed past it reports the same)."""
    run, summary = straight
    est = summary["estimated"]
    cfg = load_config(RECIPE, SAVED)
    plain = load_config(RECIPE, SAVED + ["factor.warm_start_steps=0"])
    factorized = estimate_from_config(plain, 512)
    assert est["phase"] == "warm_start" and set(est["phases"]) == {"warm_start", "factorized"}
    for key in ("weights", "grads", "optimizer_state", "total", "trainable_params"):
        assert est["phases"]["factorized"][key] == getattr(factorized, key), key
        assert est["phases"]["warm_start"][key] == est[key], key
    warm = est["phases"]["warm_start"]
    model, _ = build_run_model(cfg, 512)
    w0 = sum(w.numel() for w in warm_start_params(model))
    factors = sum(p.numel() for layer in warm_start_layers(model) for p in layer.factor_pair())
    assert warm["trainable_params"] == factorized.trainable_params - factors + w0
    assert warm["total"] > factorized.total and warm["weights"] == factorized.weights
    assert summary["grad_bytes"] == factorized.grads < warm["grads"]
    assert summary["estimate_matches_measured"] == {"optimizer_state": True, "weights": True}
    logs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    state = {e["step"]: e["optimizer_state_bytes"] for e in logs if "lr" in e}
    assert all(state[k] == warm["optimizer_state"] for k in range(1, N))
    assert all(state[k] == factorized.optimizer_state for k in range(N + 1, STEPS + 1))
    assert state[N] < factorized.optimizer_state  # W0's state freed, the factors' not made yet
    assert estimate_from_config(cfg, 512).as_dict() == {k: v for k, v in est.items()}


# -- exact resume -----------------------------------------------------------------------------


@pytest.mark.parametrize("at", [N - 1, N, N + 1], ids=["before-switch", "at-switch", "after-switch"])
@pytest.mark.run
def test_resume_across_the_switch_is_exact(straight, tmp_path, at):
    run, summary = straight
    resumed = train(
        load_config(RECIPE, SAVED), tmp_path / "run", resume=str(run / "checkpoints" / f"step-{at}")
    )
    a, b = weights(run, STEPS), weights(tmp_path / "run", STEPS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same operations, in order
    assert resumed["final_val_loss"] == summary["final_val_loss"]
    assert_resumed_from(run, tmp_path / "run", at)
    assert resumed["optimizer_state_bytes"] == summary["optimizer_state_bytes"]


# -- DDP --------------------------------------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import torch
    from effpretrain.config import load_config
    from effpretrain.trainer import Trainer

    root, out, mode, over = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    recipe = root / "recipes" / "tiny" / "relora.yaml"

    def run(name, extra, resume=None):
        t = Trainer(load_config(recipe, over + extra), out / name, resume)
        t.fit()
        sd = t.acc.unwrap_model(t.model).state_dict()
        torch.save({k: v.clone() for k, v in sd.items()}, out / name / f"rank{t.rank}.pt")
        return t

    if mode == "one":
        # The same global batch of 4 rows as 2 micro-batches of 2 (one per rank in the DDP run).
        run("1p", ["train.batch_size=2", "train.grad_accum=2"])
        sys.exit(0)
    t = run("2p", ["train.batch_size=2", "train.save_every=4", "train.keep_checkpoints=5"])
    assert isinstance(t.model, torch.nn.parallel.DistributedDataParallel)
    run("2p-split", ["train.batch_size=2", "train.save_every=4", "train.keep_checkpoints=5"], str(out / "2p" / "checkpoints" / "step-4"))
    """
)


@pytest.mark.multiprocess
def test_ddp_across_the_switch_keeps_ranks_identical_and_equals_one_process(tmp_path):
    """2 processes (gloo, torchrun) against one process at the same global batch, through the
    switch (after step 3) and two merges (after steps 6 and 9); and a 2-process run resumed from
    step 4, past the switch, which re-wraps DDP on start-up. (Without the re-wrap at the switch DDP
    would still wait for W0's gradients and would reduce none of B's and A's: the step after the
    switch fails.)"""
    run_worker_pair(WORKER, tmp_path, OVER)
    load = lambda name, r: torch.load(tmp_path / name / f"rank{r}.pt", weights_only=True)  # noqa: E731
    r0, r1, one = load("2p", 0), load("2p", 1), load("1p", 0)
    names = layer_names(r0)
    assert names and all(r0[f"{n}.B"].any() for n in names)  # the factors trained after the last merge
    # The ranks bitwise (each applies the same step to the same all-reduced gradients); one
    # process to the parity tolerance of test_distributed.py (other operations than DDP's).
    assert all(torch.equal(r0[k], r1[k]) for k in r0)
    assert rel_diff(r0, one) <= 1e-5
    split0, split1 = load("2p-split", 0), load("2p-split", 1)
    # Bitwise: the resumed run executes the same kernels in the same order as the straight one.
    assert all(torch.equal(r0[k], split0[k]) and torch.equal(r0[k], split1[k]) for k in r0)
    s2 = json.loads((tmp_path / "2p" / "summary.json").read_text())
    s1 = json.loads((tmp_path / "1p" / "summary.json").read_text())
    assert (
        s2["world_size"] == 2
        and abs(s2["final_val_loss"] - s1["final_val_loss"]) <= 1e-5 * s1["final_val_loss"]
    )

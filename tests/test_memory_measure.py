"""Measured memory by category (effpretrain.memory.measure): exact on a toy model, equal to the
estimator's weights, gradients and optimizer state on every tiny recipe, recorded by the trainer
on the chosen steps only, and refused up front when a run cannot fit (pre-flight)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from _common import ROOT, child_env
from distributed_helpers import run_worker_pair

import optimizers
from effpretrain import memory
from effpretrain.config import load_config
from effpretrain.loss import token_loss_sum
from effpretrain.memory.measure import CATEGORIES, measure_step
from effpretrain.memory.preflight import device_memory_limit
from effpretrain.models.factorized import warming_up
from effpretrain.optim_setup import build_optimizer_and_schedule
from effpretrain.run_model import build_run_model
from effpretrain.trainer import memory_steps, train

TINY_RECIPES = sorted((ROOT / "recipes" / "tiny").glob("*.yaml"))

B, D_IN, D_HID, D_OUT = 16, 64, 128, 32


def _toy(foreach: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, D_HID), torch.nn.ReLU(), torch.nn.Linear(D_HID, D_OUT))
    opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
    x = torch.randn(B, D_IN)
    return model, opt, x


def _toy_step(model, opt, x, extra: list | None = None):
    def run():
        loss = model(x).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if extra is not None:
            extra.append(torch.empty(extra[0] if extra else 0))

    return run


def test_toy_linear_stack_every_category_exact():
    """Weights and gradients: sum numel * 4; AdamW state: 2x that plus a 4-byte step per tensor;
    saved for backward: x (first Linear), the ReLU output (ReLU and the second Linear share it)
    and the second Linear's output (square's input)."""
    model, opt, x = _toy()
    n = sum(p.numel() for p in model.parameters())
    for step in (1, 2):  # step 1 creates the optimizer state, step 2 finds it
        m = measure_step(_toy_step(model, opt, x), model, opt, step=step)
        assert m["weights"] == 4 * n
        assert m["gradients"] == 4 * n
        assert m["optimizer_state"] == 8 * n + 4 * 4 == optimizers.measured_state_bytes(opt)
        assert m["activations"] == 4 * (B * D_IN + B * D_HID + B * D_OUT)
        assert m["step"] == step and m["device"] == "cpu"
        # The peak holds at least what is alive during the optimizer step, and the parts add up.
        assert m["peak"] >= 16 * n + 16
        assert sum(m["at_peak"].values()) + m["temporaries"] == m["peak"]


def test_a_transient_allocation_is_the_peak_in_its_phase():
    """A 4 MB buffer allocated after zero_grad and released at once: the peak's phase is
    zero_grad and the buffer is a temporary (nothing else is that large)."""
    model, opt, x = _toy()
    big = 1 << 20
    m = measure_step(_toy_step(model, opt, x, extra=[big]), model, opt)
    assert m["phase_at_peak"] == "zero_grad"
    assert m["temporaries"] >= 4 * big
    assert m["at_peak"]["gradients"] == 0  # set_to_none released them before
    # Without it the step's peak is far lower: the buffer is measured, not an artefact.
    model2, opt2, x2 = _toy()
    assert measure_step(_toy_step(model2, opt2, x2), model2, opt2)["peak"] < m["peak"] - 3 * big


def test_no_hook_is_left_installed():
    model, opt, x = _toy()
    measure_step(_toy_step(model, opt, x), model, opt)
    assert "step" not in opt.__dict__ and "zero_grad" not in opt.__dict__
    assert not model._forward_pre_hooks
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def _tiny_overrides() -> list[str]:
    return ["data.seq_len=32", "data.vocab_size=512", "train.batch_size=4", "train.plot=false"]


def _batch(vocab: int, rows: int = 4, seq: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


@pytest.mark.parametrize("recipe", TINY_RECIPES, ids=[p.stem for p in TINY_RECIPES])
def test_tiny_recipe_measured_equals_estimate(recipe):
    """Acceptance 1 (measured side): weights, gradients and optimizer state measured from the
    tensors equal the estimator's exactly, for every tiny recipe (fp32, CPU)."""
    cfg = load_config(recipe, _tiny_overrides())
    vocab = cfg.data.vocab_size
    torch.manual_seed(0)
    model, _ = build_run_model(cfg, vocab)
    opt, _ = build_optimizer_and_schedule(model, cfg)
    batch = _batch(vocab)

    def run():
        s, _ = token_loss_sum(model, batch, packed=True)
        s.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    m = measure_step(run, model, opt, step=1)
    est = memory.estimate_from_config(cfg, vocab)
    phase = est.detail.get("phases", {}).get("warm_start" if warming_up(model) else "factorized")
    want = phase or {"weights": est.weights, "grads": est.grads, "optimizer_state": est.optimizer_state}
    assert m["weights"] == want["weights"]
    assert m["gradients"] == want["grads"]
    # adamw_8bit's parameters share one pair of quantile maps (qmap1, qmap2): held once, and counted
    # once by the measurement, the estimator (MethodSpec.shared_state_bytes) and measured_state_bytes.
    assert m["optimizer_state"] == want["optimizer_state"] == optimizers.measured_state_bytes(opt)
    assert m["activations"] > 0 and m["peak"] >= sum(m["at_peak"].values())


def test_default_memory_steps_follow_the_registries():
    over = _tiny_overrides() + ["train.max_steps=300"]
    assert memory_steps(load_config(ROOT / "recipes/tiny/adamw.yaml", over)) == [1, 2]
    galore = load_config(ROOT / "recipes/tiny/galore.yaml", over)
    assert memory_steps(galore) == [1, 2, galore.optim.update_proj_gap + 1]
    restarts = load_config(ROOT / "recipes/tiny/lowrank_restarts.yaml", over)
    assert memory_steps(restarts) == [1, 2, restarts.restarts.every]
    short = load_config(ROOT / "recipes/tiny/galore.yaml", _tiny_overrides() + ["train.max_steps=10"])
    assert memory_steps(short) == [1, 2]  # the refresh falls after the run
    one = load_config(ROOT / "recipes/tiny/adamw.yaml", _tiny_overrides() + ["train.max_steps=1"])
    assert memory_steps(one) == [1]
    assert memory_steps(load_config(None, over + ["train.memory_steps=[]"])) == []
    assert memory_steps(load_config(None, over + ["train.memory_steps=[5,2]"])) == [2, 5]


def test_compiled_runs_measure_after_the_compiling_step(monkeypatch):
    """With `train.compile` step 1 compiles the blocks (and on CUDA autotunes Triton's kernels,
    whose buffers the allocator's peak would count): the default measured steps start at step 2,
    a restart that falls on step 1 included; `measure_run` takes that step unmeasured first.
    Explicit steps are measured as given."""
    from effpretrain.compile import COMPILE_WARMUP_STEPS
    from effpretrain.memory import measure

    over = _tiny_overrides() + ["train.max_steps=300", "train.compile=true"]
    assert COMPILE_WARMUP_STEPS == 1
    assert memory_steps(load_config(ROOT / "recipes/tiny/adamw.yaml", over)) == [2, 3]
    galore = load_config(ROOT / "recipes/tiny/galore.yaml", over)
    assert memory_steps(galore) == [2, 3, galore.optim.update_proj_gap + 1]
    early = load_config(ROOT / "recipes/tiny/lowrank_restarts.yaml", over + ["restarts.every=1"])
    assert memory_steps(early) == [2, 3]
    assert memory_steps(load_config(None, over + ["train.memory_steps=[1,2]"])) == [1, 2]

    # measure_run: the compiling step runs first, unmeasured (compilation itself is not the
    # point here, so the blocks stay eager).
    monkeypatch.setattr("effpretrain.run_model.compile_blocks", lambda model: None)
    calls, measured = [], []
    real = measure.make_train_step

    def counting(*a, **kw):
        step = real(*a, **kw)
        return lambda: (calls.append(1), step())[1]

    def spy(run_step, model, opt, step=0, in_backward=None):
        measured.append((step, len(calls)))
        run_step()
        return {"step": step}

    monkeypatch.setattr(measure, "make_train_step", counting)
    monkeypatch.setattr(measure, "measure_step", spy)
    cfg = load_config(ROOT / "recipes/tiny/adamw.yaml", _tiny_overrides() + ["train.compile=true"])
    measure.measure_run(cfg, 512, steps=2)
    assert measured == [(1, 1), (2, 2)]  # steps 1 and 2 (0-based), each after the step before it ran
    cfg.train.compile = False
    measured.clear(), calls.clear()
    measure.measure_run(cfg, 512, steps=2)
    assert measured == [(0, 0), (1, 1)]


@pytest.mark.run
@pytest.mark.fast
def test_trainer_records_measured_steps_only(tmp_path):
    over = _tiny_overrides() + [
        "train.max_steps=4",
        "train.eval_every=0",
        "train.eval_tokens=256",
        "train.memory_steps=[2,4]",
    ]
    cfg = load_config(ROOT / "recipes/tiny/adamw.yaml", over)
    summary = train(cfg, tmp_path / "run")
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    mem = [e for e in events if e.get("event") == "memory"]
    assert [e["step"] for e in mem] == [2, 4]
    est = summary["estimated"]
    for e in mem:
        assert e["estimate"]["optimizer_state"] == est["optimizer_state"]
        assert e["measured"]["optimizer_state"] == est["optimizer_state"]
        assert e["measured"]["weights"] == est["weights"] and e["measured"]["gradients"] == est["grads"]
    mm = json.loads((tmp_path / "run" / "summary.json").read_text())["memory_measured"]
    assert [s["step"] for s in mm["steps"]] == [2, 4]
    assert mm["max"]["peak"] == max(s["peak"] for s in mm["steps"])
    assert set(CATEGORIES) <= set(mm["max"])
    assert len(mm["ranks"]) == 1 and mm["ranks"][0]["steps"] == mm["steps"]


DDP_WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from effpretrain.config import load_config
    from effpretrain.memory.measure import measure_step
    from effpretrain.trainer import train

    root, out, mode, common = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    recipe = root / "recipes" / "tiny" / "adamw.yaml"
    if mode == "one":  # the same micro-batches of 2 rows, one after the other
        train(load_config(recipe, common + ["train.batch_size=2", "train.grad_accum=2"]), out / "1p")
        sys.exit(0)
    train(load_config(recipe, common + ["train.batch_size=2"]), out / "2p")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rows = {}
    for view in (True, False):  # a plain DDP both ways: the measurement sees bucket copies
        torch.manual_seed(0)
        # Four equal layers: one layer's gradient, the most that is transiently outside the
        # buckets (autograd's result before DDP copies it in), is a quarter of the whole.
        net = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
        ddp = torch.nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=view)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x = torch.randn(4, 256)

        def run():
            ddp(x).square().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        run()  # step 1 rebuilds the buckets in the order gradients arrive
        rows[str(view)] = measure_step(run, ddp, opt, step=2)
    if dist.get_rank() == 0:
        (out / "toy.json").write_text(json.dumps(rows))
    """
)


@pytest.mark.multiprocess
def test_ddp_gradients_are_bucket_views_no_second_copy(tmp_path):
    """Acceptance 3: under 2-process DDP (gloo) a rank's measured gradient memory is one full
    gradient (the buckets are the gradients), and its peak has no extra full-gradient term over one
    process running the same micro-batches; a plain DDP without gradient_as_bucket_view shows the
    measurement does see that second copy."""
    common = [
        "data.seq_len=32",
        "data.vocab_size=512",
        "train.eval_tokens=256",
        "train.max_steps=2",
        "train.eval_every=0",
        "train.plot=false",
        "train.memory_steps=[2]",
    ]
    run_worker_pair(DDP_WORKER, tmp_path, common)
    one = json.loads((tmp_path / "1p" / "summary.json").read_text())
    two = json.loads((tmp_path / "2p" / "summary.json").read_text())
    grads = one["estimated"]["grads"]
    ranks = two["memory_measured"]["ranks"]
    assert len(ranks) == 2 and two["world_size"] == 2
    for r in ranks:
        m = r["steps"][0]
        assert m["step"] == 2
        assert m["gradients"] == grads == two["estimated"]["grads"]
        assert m["peak"] <= one["memory_measured"]["max"]["peak"] + grads // 4
    toy = json.loads((tmp_path / "toy.json").read_text())
    toy_grads = 4 * 4 * (256 * 256 + 256)
    assert toy["True"]["gradients"] == toy["False"]["gradients"] == toy_grads
    assert toy["True"]["temporaries"] < toy_grads // 2
    assert toy["False"]["temporaries"] >= toy_grads


@pytest.mark.run
def test_preflight_refuses_llama_1b_adamw_fp32_batch_64_within_seconds(tmp_path):
    """Acceptance 5: its estimated peak (tens of GB per process) exceeds this machine's memory; the
    run exits 2 in one line naming the estimate, before any data or model is built."""
    import resource

    from effpretrain import memory

    cfg = load_config(ROOT / "recipes/llama_1b/adamw.yaml", ["train.precision=fp32", "train.batch_size=64"])
    est = memory.estimate_from_config(cfg, None)
    peak = getattr(est, "peak", est.total)
    limit, _ = device_memory_limit(torch.device("cpu"))
    assert peak > limit  # the premise on this machine
    env = child_env(threads=None)
    args = ["recipes/llama_1b/adamw.yaml", "--out", str(tmp_path / "run")]
    args += ["--set", "train.precision=fp32", "--set", "train.batch_size=64"]
    # CPU seconds of the child (imports, the meta-device estimate): wall time on a shared machine
    # says more about the other processes than about this check.
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-m", "effpretrain", "train", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    took = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert f"estimated peak memory {peak / 1e9:.2f} GB" in lines[0]
    # (available RAM moves between two reads: the figure itself is not compared)
    assert re.search(r"exceeds available RAM, [0-9.]+ GB \(biggest term: activations ", lines[0])
    assert "--allow-oversubscribe" in lines[0]
    assert took < 20, took
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.run
def test_allow_oversubscribe_skips_the_preflight(tmp_path, monkeypatch):
    from effpretrain.errors import ConfigError
    from effpretrain.memory import preflight

    monkeypatch.setattr(preflight, "device_memory_limit", lambda device: (1000, "a 1 kB test limit"))
    over = _tiny_overrides() + ["train.max_steps=1", "train.eval_every=0", "train.eval_tokens=256"]
    cfg = load_config(ROOT / "recipes/tiny/adamw.yaml", over)
    with pytest.raises(ConfigError, match=r"exceeds a 1 kB test limit, 0.00 GB \(biggest term: "):
        train(cfg, tmp_path / "refused")
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
    summary = train(cfg, tmp_path / "run", allow_oversubscribe=True)
    assert summary["steps"] == 1


@pytest.mark.run
def test_measuring_a_step_leaves_training_bitwise_unchanged(tmp_path):
    """Bitwise: the measurement only observes (tensor accounting), so both runs execute the same
    kernels in the same order."""
    from safetensors.torch import load_file

    over = _tiny_overrides() + ["train.max_steps=3", "train.eval_every=0", "train.eval_tokens=256"]
    for name, steps in (("measured", "[1,2,3]"), ("plain", "[]")):
        train(
            load_config(ROOT / "recipes/tiny/galore.yaml", over + [f"train.memory_steps={steps}"]),
            tmp_path / name,
        )
    a, b = (
        load_file(str(tmp_path / n / "checkpoints" / "step-3" / "model.safetensors"))
        for n in ("measured", "plain")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "plain" / "summary.json").read_text())["memory_measured"] is None


def _stepped_grad_norms(cfg, vocab: int) -> list[float]:
    """`measure_run`'s steps, and the global norm of the gradients each optimizer step received
    (a global step pre-hook sees them after any clipping)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from effpretrain import grad_norm
    from effpretrain.memory.measure import measure_run

    norms = []

    def seen(opt, args, kwargs):
        norms.append(grad_norm.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.0))

    handle = register_optimizer_step_pre_hook(seen)
    try:
        measure_run(cfg, vocab, steps=1)
    finally:
        handle.remove()
    return norms


def test_measured_step_clips_at_the_runs_grad_clip():
    """`measure_run` steps as the run does: with ``train.grad_clip: 0`` (the paper recipes') the
    optimizer steps on the unclipped gradients, whose norm is the reference step's (above 1, so a
    fixed clip at 1 would show); with a threshold below that norm, on gradients of exactly that
    norm. The reference is the same seeded model and batch, forward and backward by hand. The
    measured step runs the same operations under the accounting's dispatch mode, which changes no
    arithmetic; a tolerance of 1e-6 all the same, as the norms are compared across two builds."""
    from effpretrain import grad_norm
    from effpretrain.run_model import synthetic_batch

    over = ["data.seq_len=16", "data.vocab_size=512", "train.batch_size=1", "data.shuffle_buffer=0"]
    cfg = load_config(ROOT / "recipes/tiny/adamw.yaml", [*over, "train.grad_clip=0"])
    model, _ = build_run_model(cfg, 512)
    s, n = token_loss_sum(model, synthetic_batch(cfg, 512, seed=0), packed=True, loss=cfg.train.loss)
    (s / n).backward()
    norm = grad_norm.clip_grad_norm_(model.parameters(), 0.0)
    assert norm > 1.0
    assert _stepped_grad_norms(cfg, 512) == [pytest.approx(norm, rel=1e-6)]
    clipped = load_config(ROOT / "recipes/tiny/adamw.yaml", [*over, f"train.grad_clip={norm / 4}"])
    assert _stepped_grad_norms(clipped, 512) == [pytest.approx(norm / 4, rel=1e-5)]


# ----------------------------------------------------------------------------------------------
# train.update_in_backward (issue 17): the engine's accumulators and in-flight gradients.


def test_in_backward_toy_gradients_are_one_unit_at_a_time():
    """K = 1 on the toy stack: each parameter steps in its hook and its gradient is freed, so the
    most gradient bytes alive at once is the largest tensor's (the 128 x 64 weight), far below
    every gradient; the steps inside backward stay in the backward phase; the watch on the
    engine's methods is removed afterwards."""
    from effpretrain.in_backward import InBackward

    model, opt, x = _toy(foreach=True)
    inb = InBackward(model.parameters(), opt)

    def run():
        inb.begin_micro(0, 1)
        model(x).square().sum().backward()
        inb.finish()
        opt.step()  # as the trainer: the wrapper's step after backward, on no gradients
        opt.zero_grad(set_to_none=True)

    state = [p.detach().clone() for p in model.parameters()]
    for step in (1, 2):
        m = measure_step(run, model, opt, step=step, in_backward=inb)
        assert m["gradients"] == 4 * D_IN * D_HID < 4 * sum(p.numel() for p in model.parameters())
        assert m["phase_at_peak"] in ("forward", "backward")
    assert not any(torch.equal(a, b) for a, b in zip(state, model.parameters()))  # every tensor stepped
    assert "_accumulate" not in inb.__dict__ and "_final_grad" not in inb.__dict__
    assert "step" not in opt.__dict__
    inb.remove()


@pytest.mark.parametrize("recipe", ["adamw", "galore"])
@pytest.mark.parametrize("k", [1, 4])
def test_in_backward_measured_gradients_within_the_estimate(recipe, k):
    """Issue 17 acceptance 2 on the tiny preset (fp32, CPU): the measured peak gradient bytes of an
    in-backward step are within the estimator's figure, and equal to it (the rule is exact here):
    step 1 between GaLore's refreshes (low-rank accumulators for K = 4), step 0 a refresh step
    (full accumulators: the estimator's refresh figure). The measured peak is within 10% below
    the estimated one, and below the normal path's peak at K = 1."""
    from effpretrain.memory.measure import measure_run

    over = [
        "data.seq_len=32",
        "train.batch_size=1",
        f"train.grad_accum={k}",
        "train.loss=standard",
        "data.shuffle_buffer=0",
        "train.grad_clip=0",  # clipping off: GaLore's low-rank accumulators are on
    ]
    cfg = load_config(ROOT / "recipes" / "tiny" / f"{recipe}.yaml", [*over, "train.update_in_backward=true"])
    V = cfg.data.vocab_size
    est = memory.estimate_from_config(cfg, V)
    refresh, steady = measure_run(cfg, V, steps=2)
    assert steady["gradients"] == est.grads
    assert refresh["gradients"] == est.detail["grads_at_refresh"]
    assert (
        0.9 * est.detail["peak_between_refreshes"] <= steady["peak"] <= est.detail["peak_between_refreshes"]
    )
    if k == 1:
        normal = measure_run(load_config(ROOT / "recipes" / "tiny" / f"{recipe}.yaml", over), V, steps=2)[1]
        assert est.grads < normal["gradients"] and steady["peak"] < normal["peak"]
    if recipe == "galore" and k == 4:
        assert est.grads < est.detail["grads_at_refresh"]


def test_first_micro_refresh_keeps_low_rank_accumulators_at_a_refresh():
    """``train.in_backward_refresh=first_micro``: the refresh step's measured gradient bytes equal
    the steady step's and the estimate's, which counts low-rank accumulators at a refresh too."""
    from effpretrain.memory.measure import measure_run

    over = [
        "data.seq_len=32",
        "train.batch_size=1",
        "train.grad_accum=4",
        "train.loss=standard",
        "data.shuffle_buffer=0",
        "train.grad_clip=0",
        "train.update_in_backward=true",
    ]
    recipe = ROOT / "recipes" / "tiny" / "galore.yaml"
    cfg = load_config(recipe, [*over, "train.in_backward_refresh=first_micro"])
    V = cfg.data.vocab_size
    est, accumulated = (
        memory.estimate_from_config(cfg, V),
        memory.estimate_from_config(load_config(recipe, over), V),
    )
    refresh, steady = measure_run(cfg, V, steps=2)
    assert refresh["gradients"] == steady["gradients"] == est.grads == est.detail["grads_at_refresh"]
    assert est.detail["grads_at_refresh"] < accumulated.detail["grads_at_refresh"]


@pytest.mark.run
def test_trainer_reports_in_backward_gradient_bytes(tmp_path):
    """summary.json in this mode: ``grad_bytes`` is the first step's measured peak gradient bytes
    (labelled), the estimator's in-backward figure here (one unit in flight), not every trainable
    parameter's gradient."""
    over = _tiny_overrides() + [
        "train.max_steps=2",
        "train.eval_every=0",
        "train.eval_tokens=256",
        "train.update_in_backward=true",
    ]
    summary = train(load_config(ROOT / "recipes/tiny/adamw.yaml", over), tmp_path / "run")
    first = summary["memory_measured"]["steps"][0]
    assert first["step"] == 1
    assert summary["grad_bytes_source"] == "measured_peak_in_backward"
    assert summary["grad_bytes"] == first["gradients"] == summary["estimated"]["grads"]
    assert summary["grad_bytes"] < 4 * summary["trainable_params"]
    assert summary["estimate_matches_measured"]["gradients_within_estimate"] is True


def test_a_storage_resized_to_zero_is_released_and_resized_back_is_allocated():
    """FSDP2 frees an unsharded weight by resizing its storage to 0 bytes (the tensor, and what
    autograd saved of it, live on): the registry counts that as the release, and the resize back
    to full size as a new allocation, through the same FSDP2 functions the measured step wraps."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    from effpretrain.memory.accounting import StorageLog, watch_fsdp2_resizes

    reg = StorageLog()
    w = torch.ones(256)  # 1 KiB, "saved for backward" by a forward
    reg.id_of(w.untyped_storage(), allocated=True)
    reg.saved(w.untyped_storage(), allocated=True)
    assert reg.saved_live == 1024
    wrapped = watch_fsdp2_resizes(reg)
    try:
        assert {name for _, name, _ in wrapped} == {"alloc_storage", "free_storage"}
        _fsdp_param.free_storage(w)
        assert w.untyped_storage().nbytes() == 0 and reg.saved_live == 0
        assert reg.log[-1][1] == -1024  # released
        _fsdp_param.alloc_storage(w)
        assert reg.log[-1][1] == 1024 and w.untyped_storage()._cdata in reg.ids  # allocated again
    finally:
        for module, name, old in wrapped:
            setattr(module, name, old)
    reg.close()


# -- CUDA bookkeeping, checked on the CPU with the allocator's and the device's facts injected ------


@pytest.mark.parametrize("spelling", ["cuda", "cuda:0", torch.device("cuda", 0), torch.device("cuda")])
def test_every_spelling_of_a_cuda_device_is_one_floor_key(spelling):
    """A measured step saves its peak floor under its parameters' device (``cuda:0``), the trainer
    reads it under Accelerate's (``cuda``): both spellings, and torch.device("cuda", 0), are one
    key; a bare ``cuda`` means the current device (0 without CUDA, injectable here)."""
    from effpretrain.memory.measure import device_key

    assert device_key(spelling) == "cuda:0"
    assert device_key(spelling, current_index=lambda: 0) == "cuda:0"
    bare = torch.device(spelling).index is None
    assert device_key(spelling, current_index=lambda: 3) == ("cuda:3" if bare else "cuda:0")
    assert device_key("cuda:1") == "cuda:1" and device_key(torch.device("cpu")) == "cpu"


class _FakeAllocator:
    """torch.cuda's peak statistics for one device, on the CPU: what a CUDA run's allocator would
    report (its peak since the last reset)."""

    def __init__(self) -> None:
        self.peak = 0

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak = 0


@pytest.mark.parametrize("read_as", ["cuda", "cuda:0", torch.device("cuda", 0)])
@pytest.mark.parametrize("saved_as", ["cuda:0", "cuda"])
def test_the_peak_floor_saved_across_a_reset_is_read_under_any_spelling(saved_as, read_as, monkeypatch):
    """A 5 GB spike before a measured step's per-phase resets (step 1, a refresh) is gone from
    ``max_memory_allocated`` afterwards; the floor the step saved under its device (the
    parameters' cuda:0, or a bare cuda) puts it back in `process_peak_bytes` read under another
    spelling (Accelerate's cuda on one GPU)."""
    from effpretrain.memory import measure

    fake = _FakeAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(measure, "_CUDA_PEAK_FLOOR", {})
    fake.peak = 5 * 10**9
    phases = measure._CudaPhases(torch.device(saved_as), lambda: dict.fromkeys(CATEGORIES, 0))
    fake.peak = 10**6  # the measured phase's own peak, after the reset
    phases.boundary("forward")
    assert fake.peak == 0  # reset again at the boundary
    assert measure.process_peak_bytes(torch.device(read_as)) == 5 * 10**9


def test_gpu_preflight_limit_is_free_memory_less_the_stated_reserve():
    """The limit on a GPU is what is free now (after the CUDA context and other processes), less
    the reserve for cuBLAS/cuDNN workspaces and lazily loaded kernels, NCCL's buffers with several
    processes, and 5% for fragmentation, not the device's total memory."""
    from effpretrain.memory import preflight

    GB = 10**9
    limit, what = preflight.cuda_memory_limit(free=40 * GB, total=80 * GB, processes=1)
    assert limit == int(40 * GB - preflight.CUDA_RESERVE_BYTES - 0.05 * 40 * GB)
    assert "free GPU memory 40.00 of 80.00 GB" in what and "fragmentation" in what
    two, what2 = preflight.cuda_memory_limit(free=40 * GB, total=80 * GB, processes=2)
    assert two == limit - preflight.NCCL_RESERVE_BYTES and "NCCL" in what2
    assert preflight.cuda_memory_limit(free=10**8, total=80 * GB)[0] == 0  # never negative


@pytest.mark.parametrize(("world", "reserve"), [("1", 0), ("2", 1)])
def test_gpu_preflight_refusal_boundary_moves_with_free_memory(world, reserve, monkeypatch):
    """The device facts injected (torch.cuda.mem_get_info: 30 GB free of 80 GB, another process
    holding the rest): an estimate just under the limit runs, one byte over is refused, and a
    50 GB estimate, under the 80 GB total that the check used to compare with, is refused."""
    from types import SimpleNamespace

    from effpretrain.errors import ConfigError
    from effpretrain.memory import preflight

    GB = 10**9
    seen = []
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: seen.append(device) or (30 * GB, 80 * GB)
    )
    monkeypatch.setenv("WORLD_SIZE", world)
    limit = int(
        30 * GB - preflight.CUDA_RESERVE_BYTES - reserve * preflight.NCCL_RESERVE_BYTES - 0.05 * 30 * GB
    )
    dev = torch.device("cuda", 0)

    def est(peak: int):
        return SimpleNamespace(peak=peak, total=peak, detail={"peak_terms": {"activations": peak}})

    preflight.check_fits(est(limit), dev)
    assert seen == [dev]  # the run's own device
    for peak in (limit + 1, 50 * GB):
        with pytest.raises(ConfigError, match=r"exceeds free GPU memory 30\.00 of 80\.00 GB less"):
            preflight.check_fits(est(peak), dev)

"""`train.update_in_backward` in one process (issue 17): parity with the normal path, the
documented clipping rule against a reference, the logged gradient norm and LR, exact resume, and
the engine's low-rank accumulators and step units.

The runs are the tiny preset in fp32, K = 4 micro-batches per update, 20 updates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from _common import ROOT, TINY, assert_resumed_from, in_backward_kind
from distributed_helpers import registry_recipes

import optimizers
from effpretrain import grad_norm
from effpretrain.config import load_config
from effpretrain.errors import ConfigError
from effpretrain.in_backward import InBackward, clip_coefficient, step_units
from effpretrain.optim_setup import lr_factor
from effpretrain.trainer import train
from optimizers import FACTOR_PAIRS_KEY, GaLoreAdamW

STEPS, K = 20, 4
# One update = 4 micro-batches of 2 x 32 tokens.
BASE = [
    f"train.max_steps={STEPS}",
    f"train.grad_accum={K}",
    "train.batch_size=2",
    "data.seq_len=32",
    "train.eval_every=0",
    "train.eval_tokens=128",
    "train.log_every=1",
    "train.memory_steps=[]",
    "train.plot=false",
]
# The parity cases are read from the registries (`_parity_cases`): every optimizer method and every
# factorization kind. A recipe whose restarts are on (`restarts.every`) restarts at 7 and 14 of the
# 20 updates. The projected methods keep their tiny recipes' refresh period (50): a refresh after
# step 1 would compute its basis from weights that differ in the last bits (1e-7) and the tiny
# model's near-degenerate singular values rotate it (measured: 7e-8 after 6 updates -> 1.4e-3
# after the refresh at 7, randomized or exact SVD alike), so the parity claim is made between
# refreshes; the refresh step's own path (a full accumulator) is checked below on a
# well-conditioned matrix and by exact resume.
RESTART_EVERY = "restarts.every=7"


def _has_restarts(stem: str) -> bool:
    recipe = yaml.safe_load((TINY / f"{stem}.yaml").read_text())
    return bool((recipe.get("restarts") or {}).get("every"))


def _expect(method: str) -> str:
    """What parity holds for a registered method: ``bitwise`` where the same kernels run on the
    same sums (full accumulators: acc + G_k is the sum autograd's own accumulation forms, in the
    same order, and each parameter's step runs the same per-tensor kernels); for the ``low_rank`` kind, which sums the projected
    micro-gradients P^T G_k where the normal path projects their sum, ``close`` (1e-5) with fp32
    moments and ``order`` with moments kept per block (`fsdp2_whole_state`: 8-bit blocks round a
    last-bit difference to a whole code step): closer to the normal path than reordering the same sum moves it."""
    if in_backward_kind(method) != "low_rank":
        return "bitwise"
    return "order" if optimizers.method_spec(method).fsdp2_whole_state else "close"


def _parity_cases() -> list:
    """Every registry row's tiny recipe (`registry_recipes`): each optimizer method, and each
    factorization kind (trained with AdamW: bitwise)."""
    cases = [
        (stem, _expect(stem) if stem in optimizers.METHODS else "bitwise") for stem in registry_recipes()
    ]
    return [pytest.param(stem, expect, id=stem) for stem, expect in cases]


def run(tmp: Path, method: str, name: str, *extra: str, resume: str | None = None) -> tuple[dict, Path]:
    over = BASE + ([RESTART_EVERY] if _has_restarts(method) else []) + list(extra)
    cfg = load_config(ROOT / "recipes" / "tiny" / f"{method}.yaml", over)
    out = tmp / name
    return train(cfg, out, resume=resume), out


def weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    last = max((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return load_file(str(last / "model.safetensors"))


def logs(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" not in r and "loss" in r]


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference over the floating-point tensors; the others (SLTrain's
    sparse index) must be equal."""
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a if not a[k].is_floating_point())
    return max(
        float((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-30)) for k in a if a[k].is_floating_point()
    )


@pytest.fixture(scope="module")
def normal_runs(tmp_path_factory):
    """The normal path's runs (clipping off), computed once per recipe on first use."""
    tmp, done = tmp_path_factory.mktemp("normal"), {}

    def get(stem: str, *extra: str) -> Path:
        key = (stem, *extra)
        if key not in done:
            done[key] = run(tmp, stem, "-".join(key), "train.grad_clip=0", *extra)[1]
        return done[key]

    return get


@pytest.mark.parametrize(("method", "expect"), _parity_cases())
@pytest.mark.run
def test_parity_with_normal_path(method, expect, normal_runs, tmp_path):
    """Acceptance 1 (one process, clipping off): the same weights after 20 updates of K = 4."""
    _, out = run(tmp_path, method, "inb", "train.grad_clip=0", "train.update_in_backward=true")
    a, b = weights(normal_runs(method)), weights(out)
    diff = max_rel(a, b)
    print(f"{method} ({expect}): max relative weight difference to the normal path {diff:.1e}")
    if expect == "bitwise":
        assert all(torch.equal(a[k], b[k]) for k in a), diff
    elif expect == "close":
        assert diff <= 1e-5
    else:  # the normal path itself, its global batch summed as K = 2 x 4 rows instead of 4 x 2
        spread = max_rel(a, weights(normal_runs(method, "train.grad_accum=2", "train.batch_size=4")))
        print(f"  reordering the normal path's sum moves it {spread:.1e}")
        assert diff <= 0.5 * spread


@pytest.mark.run
def test_grad_norm_and_lr_are_logged_as_the_normal_path(normal_runs, tmp_path):
    """Acceptance 3: adamw, clipping off: each step's logged grad_norm is non-zero and equals the
    normal path's (same fp64 sum in model order); the logged LR is the schedule's."""
    _, out = run(tmp_path, "adamw", "inb", "train.grad_clip=0", "train.update_in_backward=true")
    ref, got = logs(normal_runs("adamw")), logs(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert all(r["grad_norm"] > 0 for r in got)
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in ref]
    cfg = load_config(ROOT / "recipes" / "tiny" / "adamw.yaml", BASE)
    # The LR logged after update t is the one the schedule set for update t + 1.
    want = [cfg.optim.lr * lr_factor(r["step"], cfg) for r in got]
    assert [r["lr"] for r in got] == pytest.approx(want, rel=1e-12)
    assert [r["lr"] for r in got] == [r["lr"] for r in ref]


class PreviousNormClip:
    """The documented clipping rule written independently of the engine, on the normal path:
    after the whole global batch's backward, multiply every gradient by
    min(1, c / (||G_{t-1}|| + 1e-6)) (fp32, torch's rule) using the PREVIOUS step's global norm;
    the first step is unclipped. Returns this step's (unclipped) norm, as the trainer logs."""

    def __init__(self) -> None:
        self.prev: float | None = None
        self.norm = grad_norm.clip_grad_norm_  # the unpatched norm (max_norm 0: no clipping)

    def __call__(self, params, max_norm: float) -> float:
        params = [p for p in params if p.grad is not None]
        norm = self.norm(params, 0.0)
        if self.prev is not None:
            coef = float(
                torch.clamp(max_norm / (torch.tensor(self.prev, dtype=torch.float32) + 1e-6), max=1.0)
            )
            for p in params:
                p.grad.mul_(coef)
        self.prev = norm
        return norm


@pytest.mark.parametrize(
    "method, accum",
    # galore at K = 1: with K > 1 its low-rank accumulated matrices contribute the norm of the
    # gradient their step consumed (back(R) + G_K, documented), which no normal-path reference has.
    [("adamw", K), ("galore", 1)],
)
@pytest.mark.run
def test_clipping_equals_reference_rule(method, accum, tmp_path, monkeypatch):
    """Acceptance 1, clipping on (0.05 bites every step here): update_in_backward equals the
    reference implementation of the previous-norm rule on the normal path, bitwise: both take the
    same fp64 sum of squares in model order, the same fp32 coefficient, and multiply the same
    summed gradients (full accumulators with clipping on) before the same per-tensor steps."""
    over = ("train.grad_clip=0.05", f"train.grad_accum={accum}", f"train.batch_size={2 * K // accum}")
    _, out = run(tmp_path, method, "inb", *over, "train.update_in_backward=true")
    with monkeypatch.context() as m:
        m.setattr(grad_norm, "clip_grad_norm_", PreviousNormClip())
        _, ref_out = run(tmp_path, method, "ref", *over)
    _, plain = run(tmp_path, method, "plain", *over)  # today's exact clipping: a different run
    a, b = weights(ref_out), weights(out)
    assert sum(r["grad_norm"] > 0.05 for r in logs(out)) >= STEPS // 2  # the clip is active
    assert all(torch.equal(a[k], b[k]) for k in a), max_rel(a, b)
    assert max_rel(weights(plain), b) > 1e-4  # the rule is not exact clipping: the test can tell


@pytest.mark.parametrize("method", ["galore", "lowrank_restarts"])
@pytest.mark.run
def test_exact_resume(method, tmp_path):
    """Acceptance 4: 20 updates straight vs 10 + resume: the resumed run starts at step 11 with the
    straight run's loss there and ends bitwise equal (clipping on, so the saved previous norm
    matters; lowrank_restarts restarts at 7 and 14, galore refreshes at 7, 13, 19). Bitwise: the
    same operations in the same order once the state is restored."""
    over = ("train.grad_clip=0.05", "train.update_in_backward=true", "train.save_every=10")
    if method == "galore":
        over += ("optim.update_proj_gap=6",)  # refreshes at 1, 7, 13 and 19 (13 and 19 after resuming)
    _, straight = run(tmp_path, method, "straight", *over)
    ckpt = straight / "checkpoints" / "step-10"
    assert ckpt.is_dir()
    _, resumed = run(tmp_path, method, "resumed", *over, resume=str(ckpt))
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a), max_rel(a, b)
    assert_resumed_from(straight, resumed, 10)


@pytest.mark.run
def test_mode_change_on_resume_is_refused(tmp_path):
    _, out = run(tmp_path, "adamw", "a", "train.max_steps=2", "train.save_every=1")
    with pytest.raises(ConfigError, match="update_in_backward"):
        run(
            tmp_path,
            "adamw",
            "b",
            "train.update_in_backward=true",
            resume=str(out / "checkpoints" / "step-1"),
        )


# ---------------------------------------------------------------------------- the engine


def _galore_pair(seed: int = 0):
    torch.manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(16, 24))
    b = torch.nn.Parameter(torch.randn(24))
    opt = GaLoreAdamW(
        [{"params": [w], "rank": 4, "update_proj_gap": 3, "basis": "svd"}, {"params": [b]}], lr=1e-2
    )
    return w, b, opt


def _micro_backward(w, b, x):
    ((x @ w) + b).square().mean().backward()


# The engine tests below compare the in-backward step with the normal one to a tolerance, not
# bitwise: the matrix's update differs by rounding (R = sum_k P^T G_k against P^T sum_k G_k, with
# matmul kernels that block and fuse differently on AVX2, AVX-512 and NEON), and the bias's
# gradient reads that matrix (y = x W + b), so the bias too can differ in the last bits from the
# second step on (measured after 5 steps here under the AVX-512, AVX2 and scalar kernels, MKL
# likewise: W <= 1.9e-8 relative; b 0, or 8.7e-10 with MKL's AVX2 matmul). 1e-6 is 50x that and far
# below what a micro-batch dropped from an accumulator (W >= 3.6e-3 or b >= 1.8e-2) or a refresh
# from the summed gradient instead of micro-batch 1's (W 1.5e-2) moves them.
ENGINE_RTOL = 1e-6


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).detach().norm() / y.detach().norm())


def test_low_rank_accumulator_between_refreshes():
    """GaLore's matrix accumulates R = sum proj(G_k) (4 x 24 here, not 16 x 24) on a step without a
    refresh, a full accumulator on a refresh step (the first, and t % T == 0); the bias always
    full. The updates equal the normal path's within rounding (`ENGINE_RTOL`)."""
    w, b, opt = _galore_pair()
    w2, b2, opt2 = _galore_pair()
    eng = InBackward([w, b], opt)
    shapes = []
    for _ in range(5):
        xs = [torch.randn(3, 16) for _ in range(K)]
        for k, x in enumerate(xs):
            eng.begin_micro(k, K)
            _micro_backward(w, b, x)
            if k == 0:
                shapes.append((tuple(eng._acc[id(w)][0].shape), tuple(eng._acc[id(b)][0].shape)))
            _micro_backward(w2, b2, x)
        eng.finish()
        opt2.step()
        opt2.zero_grad()
    full, low = ((16, 24), (24,)), ((4, 24), (24,))
    assert shapes == [full, low, low, full, low]  # refreshes at steps 1 and 4 (T = 3)
    assert _rel(w, w2) < ENGINE_RTOL and _rel(b, b2) < ENGINE_RTOL, (_rel(w, w2), _rel(b, b2))
    assert w.grad is None and b.grad is None  # every gradient freed


def test_refresh_from_the_first_micro_batch(monkeypatch):
    """``train.in_backward_refresh=first_micro``: the accumulator stays low rank on a refresh step
    too, and the step equals GaLore's normal step (the summed G) whose refresh was handed the
    first micro-batch's gradient instead of G, within rounding (`ENGINE_RTOL`, weights and bias)."""
    import optimizers.projection as projection

    w, b, opt = _galore_pair()
    w2, b2, opt2 = _galore_pair()
    eng = InBackward([w, b], opt, refresh_ahead=True)
    compute = projection.compute_basis
    shapes, first = [], {}
    for _ in range(5):
        # 8 rows: each micro-batch's gradient has rank 8 > 4, so its top-4 basis is well defined.
        xs = [torch.randn(8, 16) for _ in range(K)]
        for k, x in enumerate(xs):
            eng.begin_micro(k, K)
            _micro_backward(w, b, x)
            if k == 0:
                shapes.append(tuple(eng._acc[id(w)][0].shape))
            _micro_backward(w2, b2, x)
            if k == 0:
                first["G1"] = w2.grad.detach().clone()
        eng.finish()
        with monkeypatch.context() as m:  # the reference refreshes from G_1, steps with the sum
            m.setattr(projection, "compute_basis", lambda grad, *a, **kw: compute(first["G1"], *a, **kw))
            opt2.step()
        opt2.zero_grad()
    assert shapes == [(4, 24)] * 5  # low rank at the refreshes (steps 1 and 4, T = 3) as well
    assert opt.refresh_count == opt2.refresh_count == 2
    assert _rel(w, w2) < ENGINE_RTOL and _rel(b, b2) < ENGINE_RTOL, (_rel(w, w2), _rel(b, b2))
    assert torch.allclose(opt.state[w]["basis"], opt2.state[w2]["basis"], atol=1e-6)


def test_fira_and_apollo_keep_full_accumulators():
    """Their update reads G itself (Fira's residual, APOLLO's channel scaling of G)."""
    from optimizers import APOLLOAdamW, FiraAdamW

    for cls in (FiraAdamW, APOLLOAdamW):
        w = torch.nn.Parameter(torch.randn(16, 24))
        opt = cls([{"params": [w], "rank": 4, "update_proj_gap": 3}], lr=1e-2)
        eng = InBackward([w], opt)
        for _ in range(2):  # the second step has a basis and no refresh due
            for k in range(2):
                eng.begin_micro(k, 2)
                (torch.randn(3, 16) @ w).square().mean().backward()
                if k == 0:
                    assert eng._acc[id(w)][0].shape == (16, 24)
            eng.finish()


def test_factor_pairs_step_together():
    """A group with factor_pairs (LORO) steps each (B, A) pair once both gradients are final."""
    B, A, c = (torch.nn.Parameter(torch.randn(*s)) for s in ((8, 2), (2, 6), (6,)))
    opt = torch.optim.SGD([{"params": [B, A], FACTOR_PAIRS_KEY: True}, {"params": [c]}], lr=0.1)
    assert step_units(opt, [B, A, c]) == [[B, A], [c]]
    seen = []
    orig = opt.step

    def spy():
        seen.append({n for n, p in (("B", B), ("A", A), ("c", c)) if p.grad is not None})
        orig()

    opt.step = spy
    eng = InBackward([B, A, c], opt)
    eng.begin_micro(0, 1)
    ((torch.randn(3, 8) @ B @ A) + c).sum().backward()
    eng.finish()
    assert sorted(map(sorted, seen)) == [["A", "B"], ["c"]]


def test_non_finite_gradient_skips_only_its_parameter():
    w, b, opt = _galore_pair()
    before = b.detach().clone()
    eng = InBackward([w, b], opt)
    eng.begin_micro(0, 1)
    ((torch.randn(3, 16) @ w) + b * float("nan")).sum().backward()
    norm = eng.finish()
    assert eng.skipped == 1 and norm != norm  # b's gradient is NaN; w's is finite (and stepped)
    assert torch.equal(b.detach(), before)
    assert eng.prev_norm is None  # a non-finite norm never becomes the clipping reference


def test_one_host_read_per_step_unit_and_one_for_the_norm(monkeypatch):
    """Inside a step the engine reads the device (a CUDA host synchronisation) once per step unit,
    whether its final gradient is finite, and once for the global norm: a (B, A) pair is one read,
    and the squares are summed on the device, not read one by one (in_backward.py, "On CUDA")."""
    B, A, c = (torch.nn.Parameter(torch.randn(*s)) for s in ((8, 2), (2, 6), (6,)))
    opt = torch.optim.SGD([{"params": [B, A], FACTOR_PAIRS_KEY: True}, {"params": [c]}], lr=0.1)
    eng = InBackward([B, A, c], opt)
    reads = []
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **kw):
            reads.append(_name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for _ in range(3):
        x = torch.randn(3, 8)
        eng.begin_micro(0, 1)
        ((x @ B @ A) + c).square().sum().backward()
        assert len(reads) == 2  # the units' skip decisions: {B, A} and {c}
        norm = eng.finish()
        assert len(reads) == 3, reads  # and the norm
        reads.clear()
    assert norm > 0 and eng.skipped == 0


def test_clip_coefficient_rule():
    assert clip_coefficient(0.0, 5.0) == 1.0 and clip_coefficient(1.0, None) == 1.0
    assert clip_coefficient(1.0, 0.5) == 1.0
    assert clip_coefficient(1.0, 4.0) == pytest.approx(0.25, rel=1e-6)

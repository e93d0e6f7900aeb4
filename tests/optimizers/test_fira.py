"""Claims about optimizers.fira.FiraAdamW (PAPER.md 2.4)."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

from optimizers import projection as proj
from optimizers.fira import FiraAdamW

# One tall (right side) and one wide (left side) matrix, plus a vector in a plain-AdamW group.
SHAPES = [(24, 16), (12, 20), (7,)]


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    # Weights of std 0.02 (LLaMA init): fp32 rounding of W + dW is then far below the tolerances.
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((0.02 * torch.randn(s, generator=gen)).to(dtype)) for s in SHAPES]


def _set_grads(params: list[torch.Tensor], t: int) -> None:
    gen = torch.Generator().manual_seed(1000 + t)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * (1.0 + 0.1 * t)).to(p.dtype)


def _groups(params: list[torch.Tensor], **kw) -> list[dict]:
    return [{"params": params[:2], "rank": 4, "update_proj_gap": 3, **kw}, {"params": params[2:]}]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], start: int, stop: int) -> None:
    for t in range(start, stop):
        _set_grads(params, t)
        opt.step()


def _roundtrip(obj: dict) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _measured(opt: torch.optim.Optimizer, p: torch.Tensor) -> int:
    return sum(v.numel() * v.element_size() for v in opt.state[p].values() if torch.is_tensor(v))


def _least_squares_losses(opt_factory, steps: int = 30) -> list[float]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 20, generator=gen)
    w_true = torch.randn(24, 20, generator=gen)
    y = x @ w_true.t()
    w = torch.nn.Parameter(torch.zeros(24, 20))
    b = torch.nn.Parameter(torch.zeros(24))
    opt = opt_factory(w, b)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((x @ w.t() + b - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_reduces_to_torch_adamw_with_identity_basis(weight_decay: float) -> None:
    """Identity basis, rank = min(m, n), alpha 1, torch convention: the residual is exactly 0 and this is AdamW."""
    ours, ref = _params(), _params()
    groups = [
        {"params": ours[:1], "rank": 16, "basis": "identity"},
        {"params": ours[1:2], "rank": 12, "basis": "identity"},
        {"params": ours[2:]},
    ]
    kw = {"lr": 1e-2, "weight_decay": weight_decay, "eps": 1e-6}
    opt = FiraAdamW(groups, adam_convention="torch", update_proj_gap=2, **kw)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    for t in range(6):
        _set_grads(ours, t)
        _set_grads(ref, t)
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_reference_convention_is_adamw_when_eps_is_zero() -> None:
    """fira's convention differs from torch's only in eps placement and decay order."""
    ours, ref = _params(), _params()
    groups = [{"params": ours[:2], "rank": 20, "basis": "identity"}, {"params": ours[2:]}]
    # Decay order changes W by eta_t * eta * lambda * |D| per step: ~1e-8 here.
    opt = FiraAdamW(groups, lr=1e-3, eps=0.0, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, eps=0.0, weight_decay=0.01, foreach=False)
    for t in range(6):
        _set_grads(ours, t)
        _set_grads(ref, t)
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "right", "left"])
def test_matches_fira_step_by_step_across_refreshes(proj_type: str) -> None:
    ref_cls = pytest.importorskip("fira").FiraAdamW
    ours, ref = _params(), _params()
    start = [p.detach().clone() for p in ref]
    kw = {"rank": 4, "update_proj_gap": 3, "alpha": 0.25, "proj_type": proj_type}
    opt = FiraAdamW(
        [{"params": ours[:2], **kw, "basis": "svd"}, {"params": ours[2:]}], lr=1e-2, weight_decay=0.05
    )
    ref_opt = ref_cls(
        [{"params": ref[:2], **kw}, {"params": ref[2:]}],
        lr=1e-2,
        weight_decay=0.05,
        no_deprecation_warning=True,
    )
    limited, prev_norm = 0, 0.0
    for t in range(8):  # refreshes at steps 1, 4, 7; gradients grow, so the limiter acts
        _set_grads(ours, t)
        _set_grads(ref, t)
        opt.step()
        ref_opt.step()
        for a, b, b0 in zip([p.detach() for p in ours], [p.detach() for p in ref], start):
            moved = float((b - b0).abs().max())
            assert float((a - b).abs().max()) <= 1e-5 * moved, f"step {t + 1}"
        st, ref_st = opt.state[ours[0]], ref_opt.state[ref[0]]
        torch.testing.assert_close(st["residual_norm"], ref_st["scaling_grad"], rtol=1e-5, atol=0)
        limited += int(t > 0 and float(ref_st["scaling_grad"]) < 1.0101 * prev_norm)
        prev_norm = float(ref_st["scaling_grad"])
    assert opt.refresh_count == 2 * 3
    assert limited >= 3  # the comparison covered steps where the norm-growth limiter was active


def test_residual_is_what_the_projection_drops() -> None:
    """S = (G - alpha back(R)) phi by default (fira's code); G - back(R) with exact_residual."""
    w = torch.nn.Parameter(torch.zeros(24, 16))
    g = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))
    for exact in (False, True):
        w.data.zero_()
        opt = FiraAdamW(
            [{"params": [w], "rank": 4, "alpha": 0.5, "basis": "svd", "exact_residual": exact}],
            lr=1.0,
            adam_convention="torch",
            betas=(0.0, 0.0),
            eps=0.0,
        )
        w.grad = g.clone()
        opt.step()
        p = opt.state[w]["basis"]
        low = g @ p.t()
        phi = (torch.sign(low).norm(dim=1) / (low.norm(dim=1) + 1e-8)).unsqueeze(1)
        resid = (g - (1.0 if exact else 0.5) * low @ p) * phi
        expected = -(0.5 * torch.sign(low) @ p + resid)
        torch.testing.assert_close(w.detach(), expected, atol=1e-5, rtol=1e-5)


def test_norm_growth_limiter_caps_residual_growth() -> None:
    """A gradient whose off-basis part jumps 100x: S may grow by at most gamma = 1.01 per step."""
    gen = torch.Generator().manual_seed(0)
    low_rank = torch.randn(24, 4, generator=gen) @ torch.randn(4, 16, generator=gen)
    noise = torch.randn(24, 16, generator=gen)
    norms = {}
    for limit in (1.01, None):
        w = torch.nn.Parameter(torch.zeros(24, 16))
        opt = FiraAdamW(
            [{"params": [w], "rank": 4, "update_proj_gap": 100, "basis": "svd", "norm_growth_limit": limit}]
        )
        seen = []
        for t in range(4):
            w.grad = low_rank + (0.01 if t == 0 else 1.0) * noise
            opt.step()
            seen.append(float(opt.state[w]["residual_norm"]))
        norms[limit] = seen
    for a, b in zip(norms[1.01], norms[1.01][1:]):
        assert b <= 1.01 * a * (1 + 1e-5)
    assert norms[None][1] > 20 * norms[None][0]
    assert norms[1.01][0] == norms[None][0]  # the first step is never limited


def test_loss_goes_down_on_least_squares() -> None:
    def factory(w, b):
        return FiraAdamW([{"params": [w], "rank": 6, "update_proj_gap": 10}, {"params": [b]}], lr=0.05)

    losses = _least_squares_losses(factory)
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("basis", ["randomized_svd", "svd", "random"])
def test_two_seeded_runs_are_bitwise_equal(basis: str) -> None:
    finals = []
    for _ in range(2):
        params = _params()
        opt = FiraAdamW(_groups(params, basis=basis, seed=3), lr=1e-2)
        _run(opt, params, 0, 7)
        finals.append([p.detach().clone() for p in params])
    for a, b in zip(*finals):
        assert torch.equal(a, b)


@pytest.mark.parametrize("basis", ["randomized_svd", "random"])
def test_resume_across_a_refresh_is_bitwise_exact(basis: str) -> None:
    straight = _params()
    opt = FiraAdamW(_groups(straight, basis=basis), lr=1e-2, weight_decay=0.01)
    _run(opt, straight, 0, 8)

    first = _params()
    opt1 = FiraAdamW(_groups(first, basis=basis), lr=1e-2, weight_decay=0.01)
    _run(opt1, first, 0, 5)  # split between the refreshes at steps 4 and 7
    saved = _roundtrip({"opt": opt1.state_dict(), "params": [p.detach().clone() for p in first]})

    second = [torch.nn.Parameter(t) for t in saved["params"]]
    opt2 = FiraAdamW(_groups(second, basis=basis), lr=1e-2, weight_decay=0.01)
    opt2.load_state_dict(saved["opt"])
    _run(opt2, second, 5, 8)
    for a, b in zip(straight, second):
        assert torch.equal(a, b)
    assert opt2.state[second[0]]["refresh"] == 3


# ----------------------------------------------------------------------------- state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("basis", ["randomized_svd", "random"])
def test_state_bytes_formula_is_exact(dtype: torch.dtype, basis: str) -> None:
    params = _params(dtype=dtype)
    opt = FiraAdamW(_groups(params, basis=basis), lr=1e-2)
    _run(opt, params, 0, 2)
    for group in opt.param_groups:
        for p in group["params"]:
            assert _measured(opt, p) == FiraAdamW.state_bytes(tuple(p.shape), group, dtype)
    s = torch.empty((), dtype=dtype).element_size()
    # Right (24 x 16, k = 4): 2 s m k + s k n + s; left (12 x 20): 2 s k n + s m k + s; dense: 2 s numel.
    basis_on = basis != "random"
    assert FiraAdamW.state_bytes((24, 16), {"rank": 4, "basis": basis}, dtype) == s * (
        2 * 24 * 4 + basis_on * 4 * 16 + 1
    )
    assert FiraAdamW.state_bytes((12, 20), {"rank": 4, "basis": basis}, dtype) == s * (
        2 * 4 * 20 + basis_on * 12 * 4 + 1
    )
    assert FiraAdamW.state_bytes((7,), {}, dtype) == 2 * 7 * s
    assert FiraAdamW.state_bytes((12, 20), {"lr": 0.1}, dtype) == 2 * 240 * s


def test_state_dict_is_weights_only_loadable_and_plain() -> None:
    params = _params()
    opt = FiraAdamW(_groups(params), lr=1e-2)
    _run(opt, params, 0, 2)
    sd = _roundtrip(opt.state_dict())
    st = sd["state"][0]
    assert isinstance(st["step"], int) and isinstance(st["refresh"], int) and isinstance(st["seed"], int)
    assert set(st) == {"step", "refresh", "seed", "exp_avg", "exp_avg_sq", "basis", "residual_norm"}
    assert st["basis"].dtype == torch.float32 and st["exp_avg"].shape == (24, 4)


def test_groups_record_eligibility_and_step_never_mutates_them() -> None:
    params = _params()
    opt = FiraAdamW(_groups(params), lr=1e-2)
    g0, g1 = opt.param_groups
    assert g0["project"] is True and g1["project"] is False
    assert g0["proj_type"] == "std" and g0["alpha"] == 1.0 and g0["basis"] == "randomized_svd"
    assert g0["norm_growth_limit"] == 1.01 and g0["exact_residual"] is False
    assert "rank" not in g1 and "update_proj_gap" not in g1
    assert (g0["lr"], g0["betas"], g0["eps"], g0["weight_decay"], g0["correct_bias"]) == (
        1e-2,
        (0.9, 0.999),
        1e-6,
        0.0,
        True,
    )
    before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    _run(opt, params, 0, 4)
    after = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    assert before == after


def test_only_matrices_can_be_projected() -> None:
    with pytest.raises(ValueError, match="only 2-D weight matrices can be projected"):
        FiraAdamW([{"params": [torch.nn.Parameter(torch.zeros(5))], "rank": 2}])
    with pytest.raises(TypeError, match="unknown option"):
        FiraAdamW(_params()[:1], rnak=3)
    with pytest.raises(ValueError, match="full"):
        FiraAdamW([{"params": _params()[:1], "rank": 2, "proj_type": "full"}])
    # A galore-format group drops in: its scale becomes alpha.
    assert FiraAdamW([{"params": _params()[:1], "rank": 2, "scale": 0.25}]).param_groups[0]["alpha"] == 0.25


def test_zero_gradient_dummy_step_computes_no_basis_and_keeps_the_schedule() -> None:
    params = _params()
    opt = FiraAdamW(_groups(params), lr=1e-2)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.refresh_count == 0 and opt.refresh_seconds == 0.0
    for p, p0 in zip(params, before):
        assert torch.equal(p, p0)
        st = opt.state[p]
        assert st["step"] == 0 and not st["exp_avg"].any()  # materialised, untouched
    assert opt.state[params[0]]["refresh"] == 0 and not opt.state[params[0]]["basis"].any()
    # The next real step is step 1: it refreshes, and the schedule then matches a fresh optimizer.
    fresh_params = _params()
    fresh = FiraAdamW(_groups(fresh_params), lr=1e-2)
    _run(opt, params, 0, 5)
    _run(fresh, fresh_params, 0, 5)
    for a, b in zip(params, fresh_params):
        assert torch.equal(a, b)
    assert opt.refresh_count == fresh.refresh_count == 4


def test_non_finite_gradient_keeps_previous_basis_with_one_warning() -> None:
    proj.reset_failure_warning()
    params = _params()
    opt = FiraAdamW(_groups(params, basis="svd"), lr=1e-2)
    _run(opt, params, 0, 3)
    kept = opt.state[params[0]]["basis"].clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in (3, 6):  # two refresh steps, both with a non-finite gradient
            _set_grads(params, t)
            params[0].grad[0, 0] = float("nan")
            opt.step()
            assert torch.equal(opt.state[params[0]]["basis"], kept)
            _run(opt, params, t + 1, t + 3)
    assert len([w for w in caught if "basis refresh failed" in str(w.message)]) == 1
    assert opt.failed_refreshes == 2
    assert opt.state[params[0]]["refresh"] == 1


def test_telemetry_counts_refreshes() -> None:
    params = _params()
    opt = FiraAdamW(_groups(params), lr=1e-2)
    _run(opt, params, 0, 7)  # steps 1, 4, 7 refresh both matrices
    assert opt.refresh_count == 6
    assert opt.refresh_seconds > 0.0
    assert opt.failed_refreshes == 0

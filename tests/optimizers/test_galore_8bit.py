"""Claims about optimizers.galore_8bit.GaLoreAdamW8bit (GaLore with bitsandbytes 8-bit moments, on CPU)."""

from __future__ import annotations

import io
import sys
import warnings

import pytest
import torch

pytest.importorskip("bitsandbytes")

from optimizers import projection as proj  # noqa: E402
from optimizers.galore import GaLoreAdamW  # noqa: E402
from optimizers.galore_8bit import GaLoreAdamW8bit  # noqa: E402

# Tall (right side) and wide (left side) matrices plus a vector in a plain group. With rank 8 the
# low-rank moments are 80 x 8 and 8 x 300 (one full and one partial 256-entry block, or more).
SHAPES = [(80, 48), (40, 300), (300,)]


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((0.02 * torch.randn(s, generator=gen)).to(dtype)) for s in SHAPES]


def _set_grads(params: list[torch.Tensor], t: int) -> None:
    gen = torch.Generator().manual_seed(1000 + t)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * (1.0 + 0.1 * t)).to(p.dtype)


def _groups(params: list[torch.Tensor], **kw) -> list[dict]:
    return [{"params": params[:2], "rank": 8, "update_proj_gap": 3, **kw}, {"params": params[2:]}]


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


def _least_squares_losses(cls, steps: int = 15, **kw) -> list[float]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(128, 64, generator=gen)
    y = x @ torch.randn(80, 64, generator=gen).t()
    w = torch.nn.Parameter(torch.zeros(80, 64))
    b = torch.nn.Parameter(torch.zeros(80))
    opt = cls(
        [{"params": [w], "rank": 16, "update_proj_gap": 10, "basis": "svd"}, {"params": [b]}], lr=0.05, **kw
    )
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((x @ w.t() + b - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


# ----------------------------------------------------------------------------- numerics


def test_reduces_to_torch_adamw_with_identity_basis_and_fp32_moments() -> None:
    """Moments below min_8bit_size stay fp32: identity basis at full rank is then torch's AdamW."""
    ours, ref = _params(), _params()
    groups = [{"params": ours[:2], "rank": 48, "basis": "identity"}, {"params": ours[2:]}]
    kw = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-8}
    opt = GaLoreAdamW8bit(groups, min_8bit_size=10**9, update_proj_gap=2, **kw)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    for t in range(5):
        _set_grads(ours, t)
        _set_grads(ref, t)
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_reduces_to_bitsandbytes_adamw8bit_with_identity_basis() -> None:
    """8-bit moments, identity basis, full rank: bitsandbytes' own AdamW8bit (blockwise, CPU)."""
    import bitsandbytes as bnb

    ours, ref = _params(), _params()
    start = [p.detach().clone() for p in ref]
    groups = [{"params": ours[:2], "rank": 300, "basis": "identity"}, {"params": ours[2:]}]
    opt = GaLoreAdamW8bit(groups, lr=1e-2, weight_decay=0.1, min_8bit_size=0)
    ref_opt = bnb.optim.AdamW8bit(ref, lr=1e-2, weight_decay=0.1, min_8bit_size=0)
    for t in range(5):
        _set_grads(ours, t)
        _set_grads(ref, t)
        opt.step()
        ref_opt.step()
        for a, b, b0 in zip([p.detach() for p in ours], [p.detach() for p in ref], start):
            assert float((a - b).abs().max()) <= 1e-5 * float((b - b0).abs().max())


@pytest.mark.parametrize("weight_decay,tol", [(0.0, 1e-5), (0.05, 1e-3)])
def test_matches_galore_torch_8bit_across_refreshes(
    monkeypatch: pytest.MonkeyPatch, weight_decay: float, tol: float
) -> None:
    """galore-torch's GaLoreAdamW8bit (its CUDA sync patched out so it runs on CPU), same 8-bit moments.

    Without weight decay the two agree to rounding. With it they differ by the decay order
    (galore-torch decays projected weights after the update, we before, as bitsandbytes and torch
    do): a relative difference of about eta lambda per step, hence the looser bound.
    """
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_cls = pytest.importorskip("galore_torch").GaLoreAdamW8bit
    ours, ref = _params(), _params()
    start = [p.detach().clone() for p in ref]
    kw = {"rank": 8, "update_proj_gap": 3, "scale": 0.25, "proj_type": "std"}
    opt = GaLoreAdamW8bit(
        [{"params": ours[:2], **kw, "basis": "svd"}, {"params": ours[2:]}],
        lr=1e-2,
        weight_decay=weight_decay,
        min_8bit_size=0,
    )
    ref_opt = ref_cls(
        [{"params": ref[:2], **kw}, {"params": ref[2:]}], lr=1e-2, weight_decay=weight_decay, min_8bit_size=0
    )
    for t in range(5):  # refreshes at steps 1 and 4
        _set_grads(ours, t)
        _set_grads(ref, t)
        opt.step()
        ref_opt.step()
        for a, b, b0 in zip([p.detach() for p in ours], [p.detach() for p in ref], start):
            assert float((a - b).abs().max()) <= tol * float((b - b0).abs().max()), f"step {t + 1}"
    # Same quantised moments as the reference, and no more state bytes (it also stores the maps).
    st, ref_st = opt.state[ours[0]], ref_opt.state[ref[0]]
    assert torch.equal(st["exp_avg"], ref_st["state1"])
    torch.testing.assert_close(st["exp_avg_sq_absmax"], ref_st["absmax2"], rtol=1e-5, atol=0)
    assert _measured(opt, ours[0]) < sum(
        v.numel() * v.element_size() for v in ref_st.values() if torch.is_tensor(v)
    )


def test_loss_goes_down_close_to_galore_adamw() -> None:
    eight = _least_squares_losses(GaLoreAdamW8bit, min_8bit_size=0, weight_decay=0.0)
    full = _least_squares_losses(GaLoreAdamW, adam_convention="torch", eps=1e-8)
    assert eight[-1] < 0.75 * eight[0]
    for a, b in zip(eight, full):
        assert abs(a - b) <= 0.05 * b


def test_two_seeded_runs_are_bitwise_equal() -> None:
    finals = []
    for _ in range(2):
        params = _params()
        opt = GaLoreAdamW8bit(_groups(params, seed=3), lr=1e-2, min_8bit_size=0)
        _run(opt, params, 0, 5)
        finals.append([p.detach().clone() for p in params])
    for a, b in zip(*finals):
        assert torch.equal(a, b)


def test_resume_across_a_refresh_is_bitwise_exact() -> None:
    straight = _params()
    opt = GaLoreAdamW8bit(_groups(straight), lr=1e-2, min_8bit_size=0)
    _run(opt, straight, 0, 6)

    first = _params()
    opt1 = GaLoreAdamW8bit(_groups(first), lr=1e-2, min_8bit_size=0)
    _run(opt1, first, 0, 3)  # split just before the refresh at step 4
    saved = _roundtrip({"opt": opt1.state_dict(), "params": [p.detach().clone() for p in first]})
    second = [torch.nn.Parameter(t) for t in saved["params"]]
    opt2 = GaLoreAdamW8bit(_groups(second), lr=1e-2, min_8bit_size=0)
    opt2.load_state_dict(saved["opt"])
    st = opt2.state[second[0]]
    assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_absmax"].dtype == torch.float32
    _run(opt2, second, 3, 6)
    for a, b in zip(straight, second):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("min_8bit_size", [0, 4096])
def test_state_bytes_formula_is_exact(dtype: torch.dtype, min_8bit_size: int) -> None:
    params = _params(dtype=dtype)
    opt = GaLoreAdamW8bit(_groups(params), lr=1e-2, min_8bit_size=min_8bit_size)
    _run(opt, params, 0, 2)
    for group in opt.param_groups:
        for p in group["params"]:
            assert _measured(opt, p) == GaLoreAdamW8bit.state_bytes(tuple(p.shape), group, dtype)
    s = torch.empty((), dtype=dtype).element_size()
    # 8-bit: 2 L + 8 ceil(L / 256) + s B; right side of 80 x 48 at k = 8: L = 640, B = 384.
    group = {"rank": 8, "min_8bit_size": 0}
    assert GaLoreAdamW8bit.state_bytes((80, 48), group, dtype) == 2 * 640 + 8 * 3 + s * 384
    # Below min_8bit_size (default 4096) the moments are fp32: 8 L + s B.
    assert GaLoreAdamW8bit.state_bytes((80, 48), {"rank": 8}, dtype) == 8 * 640 + s * 384
    assert GaLoreAdamW8bit.state_bytes((100, 100), {}, dtype) == 2 * 10**4 + 8 * 40


def test_state_dict_is_weights_only_loadable() -> None:
    params = _params()
    opt = GaLoreAdamW8bit(_groups(params), lr=1e-2, min_8bit_size=0)
    _run(opt, params, 0, 2)
    sd = _roundtrip(opt.state_dict())
    assert set(sd["state"][0]) == {
        "step",
        "refresh",
        "seed",
        "exp_avg",
        "exp_avg_sq",
        "exp_avg_absmax",
        "exp_avg_sq_absmax",
        "basis",
    }
    assert sd["state"][0]["exp_avg"].dtype == torch.uint8
    assert opt.param_groups[0]["eps"] == 1e-8 and opt.param_groups[0]["adam_convention"] == "torch"


def test_zero_gradient_dummy_step_computes_no_basis_and_keeps_the_schedule() -> None:
    params = _params()
    opt = GaLoreAdamW8bit(_groups(params), lr=1e-2, min_8bit_size=0)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.refresh_count == 0
    for p, p0 in zip(params, before):
        assert torch.equal(p, p0) and opt.state[p]["step"] == 0
    fresh_params = _params()
    fresh = GaLoreAdamW8bit(_groups(fresh_params), lr=1e-2, min_8bit_size=0)
    _run(opt, params, 0, 4)
    _run(fresh, fresh_params, 0, 4)
    for a, b in zip(params, fresh_params):
        assert torch.equal(a, b)


def test_non_finite_gradient_keeps_previous_basis_with_one_warning() -> None:
    proj.reset_failure_warning()
    params = _params()
    opt = GaLoreAdamW8bit(_groups(params, basis="svd"), lr=1e-2, min_8bit_size=0)
    _run(opt, params, 0, 3)
    kept = opt.state[params[0]]["basis"].clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _set_grads(params, 3)
        params[0].grad[1, 1] = float("inf")
        opt.step()
    assert torch.equal(opt.state[params[0]]["basis"], kept)
    assert len([w for w in caught if "basis refresh failed" in str(w.message)]) == 1
    assert opt.failed_refreshes == 1


def test_missing_bitsandbytes_raises_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    with pytest.raises(ImportError, match="GaLoreAdamW8bit needs bitsandbytes"):
        GaLoreAdamW8bit(_groups(_params()))

"""Claims about optimizers.galore.GaLoreAdamW (PAPER.md 2.3)."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import io
import sys
import types
import warnings

import pytest
import torch

from optimizers import projection as proj
from optimizers.galore import GaLoreAdamW

# One tall (right side) and one wide (left side) matrix, plus a vector in a plain-AdamW group.
SHAPES = [(24, 16), (12, 20), (7,)]


def reference_module(package: str, module: str) -> types.ModuleType:
    """Imports `package.module` without running the package's __init__.

    galore_torch/__init__ imports its 8-bit class and with it bitsandbytes (10-20 s on a small CPU
    box); the AdamW we compare against needs neither.
    """
    name = f"{package}.{module}"
    if name in sys.modules or package in sys.modules:
        return importlib.import_module(name)
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.fail(
            f"{package} is not installed: the reference tests need the dev extras (pip install -e '.[dev]')"
        )
    shell = types.ModuleType(package)
    shell.__path__ = list(spec.submodule_search_locations or [])
    sys.modules[package] = shell
    try:
        return importlib.import_module(name)
    finally:
        # A later real `import package` runs __init__ and reuses the submodules loaded here.
        if sys.modules.get(package) is shell:
            del sys.modules[package]


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
    """Identity basis, rank = min(m, n), scale 1, torch convention: torch.optim.AdamW to 1e-6."""
    ours, ref = _params(), _params()
    groups = [
        {"params": ours[:1], "rank": 16, "basis": "identity"},
        {"params": ours[1:2], "rank": 12, "basis": "identity"},
        {"params": ours[2:]},
    ]
    kw = {"lr": 1e-2, "weight_decay": weight_decay, "eps": 1e-6}
    opt = GaLoreAdamW(groups, adam_convention="torch", update_proj_gap=2, **kw)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    for t in range(6):
        _set_grads(ours, t)
        _set_grads(ref, t)
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_reference_convention_is_adamw_when_eps_is_zero() -> None:
    """galore-torch's convention differs from torch's only in eps placement and decay order."""
    ours, ref = _params(), _params()
    groups = [{"params": ours[:2], "rank": 20, "basis": "identity"}, {"params": ours[2:]}]
    # Decay order changes W by eta_t * eta * lambda * |D| per step: ~1e-8 here.
    opt = GaLoreAdamW(groups, lr=1e-3, eps=0.0, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, eps=0.0, weight_decay=0.01, foreach=False)
    for t in range(6):
        _set_grads(ours, t)
        _set_grads(ref, t)
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "right", "left"])
def test_matches_galore_torch_step_by_step_across_refreshes(proj_type: str) -> None:
    ref_cls = reference_module("galore_torch", "adamw").AdamW
    ours, ref = _params(), _params()
    start = [p.detach().clone() for p in ref]
    kw = {"rank": 4, "update_proj_gap": 3, "scale": 0.25, "proj_type": proj_type}
    opt = GaLoreAdamW(
        [{"params": ours[:2], **kw, "basis": "svd"}, {"params": ours[2:]}], lr=1e-2, weight_decay=0.05
    )
    ref_opt = ref_cls(
        [{"params": ref[:2], **kw}, {"params": ref[2:]}],
        lr=1e-2,
        weight_decay=0.05,
        no_deprecation_warning=True,
    )
    for t in range(8):  # refreshes at steps 1, 4, 7
        _set_grads(ours, t)
        _set_grads(ref, t)
        opt.step()
        ref_opt.step()
        for a, b, b0 in zip([p.detach() for p in ours], [p.detach() for p in ref], start):
            moved = float((b - b0).abs().max())
            assert float((a - b).abs().max()) <= 1e-5 * moved, f"step {t + 1}"
    assert opt.refresh_count == 2 * 3


def test_loss_goes_down_on_least_squares() -> None:
    def factory(w, b):
        return GaLoreAdamW([{"params": [w], "rank": 6, "update_proj_gap": 10}, {"params": [b]}], lr=0.05)

    losses = _least_squares_losses(factory)
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("basis", ["randomized_svd", "svd", "random"])
def test_two_seeded_runs_are_bitwise_equal(basis: str) -> None:
    finals = []
    for _ in range(2):
        params = _params()
        opt = GaLoreAdamW(_groups(params, basis=basis, seed=3), lr=1e-2)
        _run(opt, params, 0, 7)
        finals.append([p.detach().clone() for p in params])
    for a, b in zip(*finals):
        assert torch.equal(a, b)


@pytest.mark.parametrize("basis", ["randomized_svd", "random"])
def test_resume_across_a_refresh_is_bitwise_exact(basis: str) -> None:
    straight = _params()
    opt = GaLoreAdamW(_groups(straight, basis=basis), lr=1e-2, weight_decay=0.01)
    _run(opt, straight, 0, 8)

    first = _params()
    opt1 = GaLoreAdamW(_groups(first, basis=basis), lr=1e-2, weight_decay=0.01)
    _run(opt1, first, 0, 5)  # split between the refreshes at steps 4 and 7
    saved = _roundtrip({"opt": opt1.state_dict(), "params": [p.detach().clone() for p in first]})

    second = [torch.nn.Parameter(t) for t in saved["params"]]
    opt2 = GaLoreAdamW(_groups(second, basis=basis), lr=1e-2, weight_decay=0.01)
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
    opt = GaLoreAdamW(_groups(params, basis=basis), lr=1e-2)
    _run(opt, params, 0, 2)
    for group in opt.param_groups:
        for p in group["params"]:
            assert _measured(opt, p) == GaLoreAdamW.state_bytes(tuple(p.shape), group, dtype)
    s = torch.empty((), dtype=dtype).element_size()
    # Right side (24 x 16, k = 4): 2 s m k + s k n; left (12 x 20): 2 s k n + s m k; dense: 2 s numel.
    basis_on = basis != "random"
    assert GaLoreAdamW.state_bytes((24, 16), {"rank": 4, "basis": basis}, dtype) == s * (
        2 * 24 * 4 + basis_on * 4 * 16
    )
    assert GaLoreAdamW.state_bytes((12, 20), {"rank": 4, "basis": basis}, dtype) == s * (
        2 * 4 * 20 + basis_on * 12 * 4
    )
    assert GaLoreAdamW.state_bytes((7,), {}, dtype) == 2 * 7 * s
    assert GaLoreAdamW.state_bytes((12, 20), {"lr": 0.1}, dtype) == 2 * 240 * s


def test_state_dict_is_weights_only_loadable_and_plain() -> None:
    params = _params()
    opt = GaLoreAdamW(_groups(params), lr=1e-2)
    _run(opt, params, 0, 2)
    sd = _roundtrip(opt.state_dict())
    st = sd["state"][0]
    assert isinstance(st["step"], int) and isinstance(st["refresh"], int) and isinstance(st["seed"], int)
    assert set(st) == {"step", "refresh", "seed", "exp_avg", "exp_avg_sq", "basis"}
    assert st["basis"].dtype == torch.float32 and st["exp_avg"].shape == (24, 4)


def test_groups_record_eligibility_and_step_never_mutates_them() -> None:
    params = _params()
    opt = GaLoreAdamW(_groups(params), lr=1e-2)
    g0, g1 = opt.param_groups
    assert g0["project"] is True and g1["project"] is False
    assert g0["proj_type"] == "std" and g0["scale"] == 1.0 and g0["basis"] == "randomized_svd"
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
        GaLoreAdamW([{"params": [torch.nn.Parameter(torch.zeros(5))], "rank": 2}])
    with pytest.raises(TypeError, match="unknown option"):
        GaLoreAdamW(_params()[:1], rnak=3)


def test_zero_gradient_dummy_step_computes_no_basis_and_keeps_the_schedule() -> None:
    params = _params()
    opt = GaLoreAdamW(_groups(params), lr=1e-2)
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
    fresh = GaLoreAdamW(_groups(fresh_params), lr=1e-2)
    _run(opt, params, 0, 5)
    _run(fresh, fresh_params, 0, 5)
    for a, b in zip(params, fresh_params):
        assert torch.equal(a, b)
    assert opt.refresh_count == fresh.refresh_count == 4


def test_large_gradient_zero_only_at_sampled_entries_still_steps() -> None:
    """Zero detection samples large gradients first: a gradient that is zero at every sampled
    entry but not elsewhere must still step, and an all-zero one must not."""
    w = torch.nn.Parameter(torch.zeros(128, 96))  # 12288 entries: sampled, every 48th entry
    opt = GaLoreAdamW([{"params": [w], "rank": 4}], lr=1e-2)
    w.grad = torch.zeros_like(w)
    opt.step()
    assert opt.state[w]["step"] == 0 and opt.refresh_count == 0
    g = torch.randn(128, 96, generator=torch.Generator().manual_seed(0))
    g.view(-1)[:: w.numel() // 256] = 0.0  # exactly the sampled entries
    w.grad = g
    opt.step()
    assert opt.state[w]["step"] == 1 and opt.refresh_count == 1 and w.detach().abs().sum() > 0


def test_non_finite_gradient_keeps_previous_basis_with_one_warning() -> None:
    proj.reset_failure_warning()
    params = _params()
    opt = GaLoreAdamW(_groups(params, basis="svd"), lr=1e-2)
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
    opt = GaLoreAdamW(_groups(params), lr=1e-2)
    _run(opt, params, 0, 7)  # steps 1, 4, 7 refresh both matrices
    assert opt.refresh_count == 6
    assert opt.refresh_seconds > 0.0
    assert opt.failed_refreshes == 0


def test_full_projection_matches_galore_torch_and_counts_its_bytes() -> None:
    """proj_type='full' (r x r core): the packed basis [P_L^T | P_R] is one tensor.

    At a refresh the core U^T G V^T is diagonal up to rounding noise, which Adam's normalisation
    amplifies to O(1) when eps is far below it (both implementations, differently): with eps
    above the noise the two match to 1e-5 like the other projection types.
    """
    ref_cls = reference_module("galore_torch", "adamw").AdamW
    ours, ref = _params(), _params()
    start = [p.detach().clone() for p in ref]
    kw = {"rank": 4, "update_proj_gap": 3, "scale": 0.25, "proj_type": "full"}
    opt = GaLoreAdamW([{"params": ours[:2], **kw, "basis": "svd"}, {"params": ours[2:]}], lr=1e-2, eps=1e-3)
    ref_opt = ref_cls(
        [{"params": ref[:2], **kw}, {"params": ref[2:]}], lr=1e-2, eps=1e-3, no_deprecation_warning=True
    )
    for t in range(5):
        _set_grads(ours, t)
        _set_grads(ref, t)
        opt.step()
        ref_opt.step()
    for a, b, b0 in zip([p.detach() for p in ours], [p.detach() for p in ref], start):
        assert float((a - b).abs().max()) <= 1e-5 * float((b - b0).abs().max())
    assert opt.state[ours[0]]["basis"].shape == (4, 24 + 16)
    for group in opt.param_groups:
        for p in group["params"]:
            assert _measured(opt, p) == GaLoreAdamW.state_bytes(tuple(p.shape), group, torch.float32)
    assert GaLoreAdamW.state_bytes((24, 16), kw, torch.float32) == 4 * (2 * 4 * 4 + 4 * 40)


def test_add_param_group_later_is_configured_too() -> None:
    params = _params()
    opt = GaLoreAdamW([{"params": params[2:]}], lr=1e-2, basis="svd", update_proj_gap=7)
    opt.add_param_group({"params": params[:2], "rank": 3})
    group = opt.param_groups[-1]
    assert group["project"] is True and group["basis"] == "svd" and group["update_proj_gap"] == 7
    assert group["lr"] == 1e-2 and group["scale"] == 1.0
    _run(opt, params, 0, 2)
    assert opt.state[params[0]]["exp_avg"].shape == (24, 3)

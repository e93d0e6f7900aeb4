"""Claims about optimizers.apollo.APOLLOAdamW (Zhu et al. 2024) beyond the contract (test_contract.py).

Reference match: apollo-torch draws its projections from its own seed chain. Our optimizer can
draw the very same stream (group key ``random_stream="apollo_torch"``), so the reference test
runs the unmodified apollo_torch.APOLLOAdamW side by side; nothing is injected into either.
The default stream ("mix") is checked separately to be regenerable from (seed, refresh count).
"""

from __future__ import annotations

import harness
import pytest
import torch
from harness import make_params, reference_groups, run, run_beside, set_grads, state_bytes_of

from optimizers import projection as proj
from optimizers.apollo import APOLLOAdamW, apollo_torch_next_seed

# A right-side (m >= n), a left-side (m < n) weight and a vector (never projected).
SHAPES = [(16, 8), (6, 20), (7,)]
GRADS = {"seed": 500, "growth": 0.0}

#: How the contract runs "apollo" (test_contract.py), with each of its random streams.
CONTRACT = harness.Case(
    reduces="does not reduce: the update is the raw gradient scaled per channel by ||N_c|| / ||R_c||, "
    "not Adam's element-wise N, whatever the basis",
    variants=harness.APOLLO_STREAMS,
    loss_lr=0.8,
)


def _params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return make_params(SHAPES, seed, dtype, std=1.0)


def _groups(params, **keys) -> list[dict]:
    """apollo-torch's format: rank 4, random projection, channel-wise scaling, scale 2."""
    return reference_groups(params, **{"proj": "random", "scale_type": "channel", "scale": 2.0, **keys})


@pytest.mark.parametrize("scale_front", [False, True])
def test_matches_apollo_torch_step_by_step_across_refreshes(scale_front):
    apollo_torch = pytest.importorskip("apollo_torch")
    ours_p, ref_p = _params(0), _params(0)
    kw = dict(lr=1e-2, weight_decay=0.1, scale_front=scale_front)
    ref = apollo_torch.APOLLOAdamW(_groups(ref_p, proj_type="std"), **kw)
    ours = APOLLOAdamW(_groups(ours_p, proj_type="std", random_stream="apollo_torch"), **kw)
    run_beside(
        ours, ours_p, ref, ref_p, 10, relative_to="weights", **GRADS
    )  # refreshes before steps 1, 4, 7 and 10
    assert ours.state[ours_p[0]]["refresh"] == 4


def test_apollo_torch_seed_chain_is_reproduced():
    random_projector = pytest.importorskip("apollo_torch.random_projector")
    seed = 3
    for _ in range(4):
        assert apollo_torch_next_seed(seed) == random_projector.next_seed(seed)
        seed = apollo_torch_next_seed(seed)


def test_default_projection_is_regenerated_from_seed_and_refresh_count():
    """After one step M = (1 - beta1) R with R = G P^T, P = random_basis(seed, refresh=1):
    the projection is a function of two ints, and no basis tensor is stored."""
    params = _params(1)
    opt = APOLLOAdamW(_groups(params), betas=(0.9, 0.999))
    set_grads(params, 0, **GRADS)
    opt.step()
    for p, side in ((params[0], "right"), (params[1], "left")):
        st = opt.state[p]
        assert "basis" not in st and st["refresh"] == 1
        P = proj.random_basis(tuple(p.shape), 4, side, seed=st["seed"], refresh=1)
        R = proj.project(p.grad, P, side)
        torch.testing.assert_close(st["exp_avg"], 0.1 * R, rtol=1e-6, atol=1e-7)
    assert opt.state[params[0]]["seed"] != opt.state[params[1]]["seed"]


def test_eligibility_and_defaults_are_recorded():
    params = _params(4)
    opt = APOLLOAdamW(_groups(params))
    assert [g["project"] for g in opt.param_groups] == [True, False]
    assert opt.param_groups[0]["basis"] == "random" and opt.param_groups[0]["scale_type"] == "channel"
    run(opt, params, 0, 1, **GRADS)
    assert "exp_avg" in opt.state[params[2]] and opt.state[params[2]]["exp_avg"].shape == (7,)


def test_channel_factor_is_per_row_on_the_right_and_per_column_on_the_left():
    """With beta1 = 0 the first update is D = G * s with s_c = ||N_c|| / ||R_c||: one factor per
    row of a tall weight and per column of a wide one."""
    params = _params(5)
    opt = APOLLOAdamW(_groups(params, scale=1.0), lr=1.0, betas=(0.0, 0.999), correct_bias=False)
    before = [p.detach().clone() for p in params]
    set_grads(params, 0, **GRADS)
    opt.step()
    for b, p, dim in ((before[0], params[0], 1), (before[1], params[1], 0)):
        delta, g = b - p.detach(), p.grad
        # Least-squares fit of delta = c * G with one c per row (tall) or per column (wide).
        c = (delta * g).sum(dim, keepdim=True) / (g * g).sum(dim, keepdim=True)
        assert (delta - c * g).abs().max() <= 1e-5 * delta.abs().max()
        assert c.std() > 1e-3 * c.mean()  # and the channels really get different factors


def test_norm_growth_limiter_caps_growth_at_one_percent():
    params = _params(6)
    opt = APOLLOAdamW(_groups(params))
    run(opt, params, 0, 3, **GRADS)
    p = params[0]
    prev = opt.state[p]["scaled_grad_norm"].item()
    for q in params:
        q.grad = 100.0 * torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    opt.step()
    assert opt.state[p]["scaled_grad_norm"].item() <= 1.01 * prev * (1 + 1e-5)
    off = APOLLOAdamW(_groups(params), disable_nl=True)
    assert off.param_groups[0]["norm_growth_limit"] == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_formula_worked_values(dtype):
    s = dtype.itemsize
    expected = [2 * s * 16 * 4 + 4, 2 * s * 4 * 20 + 4, 2 * s * 7]  # right, left, dense
    params = _params(10, dtype)
    opt = APOLLOAdamW(_groups(params))
    run(opt, params, 0, 2, **GRADS)
    assert [state_bytes_of(opt, p) for p in params] == expected
    groups = [opt.param_groups[0], opt.param_groups[0], opt.param_groups[1]]
    assert [APOLLOAdamW.state_bytes(tuple(p.shape), g, dtype) for p, g in zip(params, groups)] == expected
    # A plain dict group works without an optimizer; missing keys take the defaults.
    assert APOLLOAdamW.state_bytes((16, 8), {"rank": 4}, dtype) == expected[0]
    assert APOLLOAdamW.state_bytes((7,), {}, dtype) == expected[2]
    # A stored (svd) basis adds P: k x n on the right side.
    assert APOLLOAdamW.state_bytes((16, 8), {"rank": 4, "proj": "svd"}, dtype) == expected[0] + s * 4 * 8


def test_svd_projection_option_runs_and_counts_its_basis():
    params = _params(11)
    opt = APOLLOAdamW(_groups(params, proj="svd"))
    run(opt, params, 0, 4, **GRADS)
    assert opt.param_groups[0]["basis"] == "svd" and opt.refresh_count == 4
    for p in params[:2]:
        assert state_bytes_of(opt, p) == APOLLOAdamW.state_bytes(tuple(p.shape), opt.param_groups[0], p.dtype)


@pytest.mark.parametrize(
    "bad", [dict(proj_type="full"), dict(scale_type="row"), dict(random_stream="numpy"), dict(rank=0)]
)
def test_bad_group_options_are_rejected(bad):
    with pytest.raises(ValueError):
        APOLLOAdamW(_groups(_params(12), **bad))

"""Claims about optimizers.apollo.APOLLOAdamW (PAPER.md 2.5).

Reference match: apollo-torch draws its projections from its own seed chain. Our optimizer can
draw the very same stream (group key ``random_stream="apollo_torch"``), so the reference test
runs the unmodified apollo_torch.APOLLOAdamW side by side; nothing is injected into either.
The default stream ("mix") is checked separately to be regenerable from (seed, refresh count).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from optimizers import projection as proj
from optimizers.apollo import APOLLOAdamW, apollo_torch_next_seed

# A right-side (m >= n), a left-side (m < n) weight and a vector (never projected).
SHAPES = [(16, 8), (6, 20), (7,)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These tensors are tiny: a second intra-op thread only adds synchronisation, which stalls
    # badly when the machine is busy. Restored after the module.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _groups(params, **proj_keys) -> list[dict]:
    keys = dict(rank=4, proj="random", scale_type="channel", update_proj_gap=3, scale=2.0, proj_type="std")
    keys.update(proj_keys)
    return [{"params": [params[2]]}, {"params": params[:2], **keys}]


def _set_grads(params, t: int) -> None:
    gen = torch.Generator().manual_seed(500 + t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _run(opt, params, start: int, stop: int) -> None:
    for t in range(start, stop):
        _set_grads(params, t)
        opt.step()


def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _real_bytes(opt, p) -> int:
    return sum(v.numel() * v.element_size() for v in opt.state[p].values() if torch.is_tensor(v))


@pytest.mark.parametrize("scale_front", [False, True])
def test_matches_apollo_torch_step_by_step_across_refreshes(scale_front):
    apollo_torch = pytest.importorskip("apollo_torch")
    ours_p, ref_p = _params(0), _params(0)
    kw = dict(lr=1e-2, weight_decay=0.1, scale_front=scale_front)
    ref = apollo_torch.APOLLOAdamW(_groups(ref_p), **kw)
    ours = APOLLOAdamW(_groups(ours_p, random_stream="apollo_torch"), **kw)
    for t in range(10):  # refreshes before steps 1, 4, 7 and 10
        _set_grads(ours_p, t)
        for a, b in zip(ref_p, ours_p):
            a.grad = b.grad.clone()
        ref.step()
        ours.step()
        for a, b in zip(ref_p, ours_p):
            assert (a - b).abs().max() <= 1e-5 * a.abs().max(), f"step {t + 1}"
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
    _set_grads(params, 0)
    opt.step()
    for p, side in ((params[0], "right"), (params[1], "left")):
        st = opt.state[p]
        assert "basis" not in st and st["refresh"] == 1
        P = proj.random_basis(tuple(p.shape), 4, side, seed=st["seed"], refresh=1)
        R = proj.project(p.grad, P, side)
        torch.testing.assert_close(st["exp_avg"], 0.1 * R, rtol=1e-6, atol=1e-7)
    assert opt.state[params[0]]["seed"] != opt.state[params[1]]["seed"]


def test_refresh_schedule_and_telemetry():
    params = _params(2)
    opt = APOLLOAdamW(_groups(params, update_proj_gap=3))
    assert (opt.refresh_count, opt.refresh_seconds, opt.failed_refreshes) == (0, 0.0, 0)
    _run(opt, params, 0, 7)  # refreshes before steps 1, 4 and 7
    assert opt.state[params[0]]["refresh"] == 3 and opt.state[params[1]]["refresh"] == 3
    assert opt.refresh_count == 6 and opt.refresh_seconds > 0.0 and opt.failed_refreshes == 0


def test_zero_gradient_step_neither_refreshes_nor_moves():
    params = _params(3)
    opt = APOLLOAdamW(_groups(params, update_proj_gap=2), weight_decay=0.1)
    _run(opt, params, 0, 2)  # the next real step (step 3) is a refresh
    before = [p.detach().clone() for p in params]
    state_before = copy.deepcopy({i: dict(opt.state[p]) for i, p in enumerate(params)})
    count = opt.refresh_count
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.refresh_count == count
    for i, p in enumerate(params):
        assert torch.equal(p, before[i])
        for k, v in opt.state[p].items():
            assert torch.equal(v, state_before[i][k]) if torch.is_tensor(v) else v == state_before[i][k]


def test_zero_gradient_first_step_materializes_state():
    params = _params(3)
    opt = APOLLOAdamW(_groups(params))
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.refresh_count == 0
    for p in params:
        assert opt.state[p]["step"] == 0
        assert _real_bytes(opt, p) == APOLLOAdamW.state_bytes(
            tuple(p.shape), _groups(params)[int(p.ndim == 2)], p.dtype
        )


def test_eligibility_recorded_and_step_leaves_param_groups_alone():
    params = _params(4)
    opt = APOLLOAdamW(_groups(params))
    assert [g["project"] for g in opt.param_groups] == [False, True]
    assert opt.param_groups[1]["basis"] == "random" and opt.param_groups[1]["scale_type"] == "channel"
    snap = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    _run(opt, params, 0, 4)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == snap
    assert "exp_avg" in opt.state[params[2]] and opt.state[params[2]]["exp_avg"].shape == (7,)


def test_channel_factor_is_per_row_on_the_right_and_per_column_on_the_left():
    """With beta1 = 0 the first update is D = G * s with s_c = ||N_c|| / ||R_c||: one factor per
    row of a tall weight and per column of a wide one."""
    params = _params(5)
    opt = APOLLOAdamW(_groups(params, scale=1.0), lr=1.0, betas=(0.0, 0.999), correct_bias=False)
    before = [p.detach().clone() for p in params]
    _set_grads(params, 0)
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
    _run(opt, params, 0, 3)
    p = params[0]
    prev = opt.state[p]["scaled_grad_norm"].item()
    for q in params:
        q.grad = 100.0 * torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    opt.step()
    assert opt.state[p]["scaled_grad_norm"].item() <= 1.01 * prev * (1 + 1e-5)
    off = APOLLOAdamW(_groups(params), disable_nl=True)
    assert off.param_groups[1]["norm_growth_limit"] == 0.0


def test_loss_goes_down_least_squares():
    gen = torch.Generator().manual_seed(0)
    A, x_true = torch.randn(64, 32, generator=gen), torch.randn(32, 16, generator=gen)
    B = A @ x_true
    x = torch.nn.Parameter(torch.zeros(32, 16))
    opt = APOLLOAdamW([{"params": [x], "rank": 4, "update_proj_gap": 50}], lr=5e-2)
    first = None
    for _ in range(100):
        loss = ((A @ x - B) ** 2).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert ((A @ x - B) ** 2).mean().item() < 0.05 * first


@pytest.mark.parametrize("stream", ["mix", "apollo_torch"])
def test_two_seeded_runs_are_bitwise_equal(stream):
    runs = []
    for _ in range(2):
        params = _params(7)
        _run(APOLLOAdamW(_groups(params, random_stream=stream), weight_decay=0.01), params, 0, 8)
        runs.append([p.detach().clone() for p in params])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stream", ["mix", "apollo_torch"])
def test_resume_across_refresh_is_exact(dtype, stream):
    def build(ps):
        return APOLLOAdamW(_groups(ps, random_stream=stream, update_proj_gap=3), weight_decay=0.01)

    straight = _params(8, dtype)
    _run(build(straight), straight, 0, 11)

    first = _params(8, dtype)
    opt = build(first)
    _run(opt, first, 0, 3)  # the next step (4) starts with a refresh
    sd = _roundtrip(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = build(resumed)
    opt2.load_state_dict(sd)
    assert opt2.state[resumed[0]]["scaled_grad_norm"].dtype == torch.float32
    _run(opt2, resumed, 3, 11)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_state_holds_only_tensors_and_ints():
    params = _params(9)
    opt = APOLLOAdamW(_groups(params, random_stream="apollo_torch"))
    _run(opt, params, 0, 4)
    for st in opt.state.values():
        assert {"step", "exp_avg", "exp_avg_sq"} <= set(st)
        assert all(torch.is_tensor(v) or type(v) is int for v in st.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_formula_matches_real_state(dtype):
    params = _params(10, dtype)
    groups = _groups(params)
    opt = APOLLOAdamW(groups)
    _run(opt, params, 0, 2)
    s = torch.empty((), dtype=dtype).element_size()
    expected = {0: 2 * s * 16 * 4 + 4, 1: 2 * s * 4 * 20 + 4, 2: 2 * s * 7}  # right, left, dense
    for i, p in enumerate(params):
        g = opt.param_groups[0] if i == 2 else opt.param_groups[1]
        assert _real_bytes(opt, p) == expected[i]
        assert APOLLOAdamW.state_bytes(tuple(p.shape), g, dtype) == expected[i]
    # A plain dict group works without an optimizer; missing keys take the defaults.
    assert APOLLOAdamW.state_bytes((16, 8), {"rank": 4}, dtype) == expected[0]
    assert APOLLOAdamW.state_bytes((7,), {}, dtype) == expected[2]
    # A stored (svd) basis adds P: k x n on the right side.
    assert APOLLOAdamW.state_bytes((16, 8), {"rank": 4, "proj": "svd"}, dtype) == expected[0] + s * 4 * 8


def test_svd_projection_option_runs_and_counts_its_basis():
    params = _params(11)
    opt = APOLLOAdamW(_groups(params, proj="svd"))
    _run(opt, params, 0, 4)
    assert opt.param_groups[1]["basis"] == "svd" and opt.refresh_count == 4
    for p in params[:2]:
        assert _real_bytes(opt, p) == APOLLOAdamW.state_bytes(tuple(p.shape), opt.param_groups[1], p.dtype)


@pytest.mark.parametrize(
    "bad", [dict(proj_type="full"), dict(scale_type="row"), dict(random_stream="numpy"), dict(rank=0)]
)
def test_bad_group_options_are_rejected(bad):
    with pytest.raises(ValueError):
        APOLLOAdamW(_groups(_params(12), **bad))


def test_vector_in_a_projected_group_is_rejected():
    p = torch.nn.Parameter(torch.zeros(5))
    with pytest.raises(ValueError, match="2-D"):
        APOLLOAdamW([{"params": [p], "rank": 2}])

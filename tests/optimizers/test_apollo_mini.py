"""Claims about optimizers.apollo.APOLLOMini: rank-1, tensor-wise APOLLO (PAPER.md 2.5).

The reference match runs apollo_torch.APOLLOAdamW with its README's APOLLO-Mini group (rank 1,
scale_type "tensor", scale 128) beside ours drawing apollo-torch's random stream
(``random_stream="apollo_torch"``); nothing is injected.
"""

from __future__ import annotations

import io

import pytest
import torch

from optimizers.apollo import APOLLOAdamW, APOLLOMini

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


def _set_grads(params, t: int) -> None:
    gen = torch.Generator().manual_seed(700 + t)
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


def test_defaults_are_apollo_mini():
    params = _params(0)
    opt = APOLLOMini([{"params": [params[2]]}, {"params": params[:2], "rank": 1}])
    g = opt.param_groups[1]
    assert issubclass(APOLLOMini, APOLLOAdamW)
    assert (g["rank"], g["scale_type"], g["scale"], g["basis"]) == (1, "tensor", 128.0, "random")
    assert [gr["project"] for gr in opt.param_groups] == [False, True]
    marked = APOLLOMini([{"params": params[:2], "project": True}])
    assert marked.param_groups[0]["rank"] == 1


def test_rank_other_than_one_is_rejected():
    with pytest.raises(ValueError, match="rank 1"):
        APOLLOMini([{"params": _params(0)[:2], "rank": 4}])


def test_matches_apollo_torch_readme_mini_setting_across_refreshes():
    apollo_torch = pytest.importorskip("apollo_torch")
    readme = dict(rank=1, proj="random", scale_type="tensor", scale=128, update_proj_gap=3, proj_type="std")
    ref_p, ours_p = _params(1), _params(1)
    ref = apollo_torch.APOLLOAdamW([{"params": [ref_p[2]]}, {"params": ref_p[:2], **readme}], lr=1e-3)
    ours = APOLLOMini(
        [{"params": [ours_p[2]]}, {"params": ours_p[:2], "rank": 1, "update_proj_gap": 3}],
        lr=1e-3,
        random_stream="apollo_torch",
    )
    for t in range(8):  # refreshes before steps 1, 4 and 7
        _set_grads(ours_p, t)
        for a, b in zip(ref_p, ours_p):
            a.grad = b.grad.clone()
        ref.step()
        ours.step()
        for a, b in zip(ref_p, ours_p):
            assert (a - b).abs().max() <= 1e-5 * a.abs().max(), f"step {t + 1}"


def test_update_is_one_scalar_times_the_gradient():
    """Tensor-wise scaling: without decay, each weight moves by c G for a single scalar c."""
    params = _params(2)
    opt = APOLLOMini([{"params": params[:2], "rank": 1}], lr=1e-2)
    before = [p.detach().clone() for p in params[:2]]
    _set_grads(params, 0)
    opt.step()
    for b, p in zip(before, params[:2]):
        delta, g = b - p.detach(), p.grad
        c = (delta * g).sum() / (g * g).sum()  # least-squares fit of delta = c G
        assert c > 0
        assert (delta - c * g).abs().max() <= 1e-5 * delta.abs().max()


def test_loss_goes_down_least_squares():
    gen = torch.Generator().manual_seed(0)
    A, x_true = torch.randn(64, 32, generator=gen), torch.randn(32, 16, generator=gen)
    B = A @ x_true
    x = torch.nn.Parameter(torch.zeros(32, 16))
    opt = APOLLOMini([{"params": [x], "rank": 1, "update_proj_gap": 50}], lr=1e-2)
    first = None
    for _ in range(100):
        loss = ((A @ x - B) ** 2).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert ((A @ x - B) ** 2).mean().item() < 0.05 * first


def test_two_seeded_runs_are_bitwise_equal():
    runs = []
    for _ in range(2):
        params = _params(3)
        _run(APOLLOMini([{"params": params[:2], "rank": 1, "update_proj_gap": 2}]), params, 0, 6)
        runs.append([p.detach().clone() for p in params[:2]])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_across_refresh_is_exact(dtype):
    def build(ps):
        return APOLLOMini([{"params": [ps[2]]}, {"params": ps[:2], "rank": 1, "update_proj_gap": 3}], lr=1e-3)

    straight = _params(4, dtype)
    _run(build(straight), straight, 0, 9)

    first = _params(4, dtype)
    opt = build(first)
    _run(opt, first, 0, 3)  # the next step (4) starts with a refresh
    sd = _roundtrip(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = build(resumed)
    opt2.load_state_dict(sd)
    _run(opt2, resumed, 3, 9)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_formula_matches_real_state(dtype):
    params = _params(5, dtype)
    opt = APOLLOMini([{"params": [params[2]]}, {"params": params[:2], "rank": 1}])
    _run(opt, params, 0, 2)
    s = torch.empty((), dtype=dtype).element_size()
    # Right side (16 x 8): moments 16 x 1; left side (6 x 20): 1 x 20; plus the fp32 limiter norm.
    expected = [2 * s * 16 + 4, 2 * s * 20 + 4, 2 * s * 7]
    groups = [opt.param_groups[1], opt.param_groups[1], opt.param_groups[0]]
    for p, g, e in zip(params, groups, expected):
        assert _real_bytes(opt, p) == e
        assert APOLLOMini.state_bytes(tuple(p.shape), g, dtype) == e
    assert APOLLOMini.state_bytes((16, 8), {"rank": 1}, dtype) == expected[0]
    assert APOLLOMini.state_bytes((16, 8), {"project": True}, dtype) == expected[0]
    assert APOLLOMini.state_bytes((7,), {}, dtype) == expected[2]

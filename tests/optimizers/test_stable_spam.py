"""Claims about optimizers.stable_spam.StableSPAM (PAPER.md 2.2)."""

from __future__ import annotations

import io
import math

import pytest
import torch

from optimizers.stable_spam import StableSPAM

SHAPES = [(6, 4), (5,), (3, 7)]


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


def _grads(step: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Deterministic gradients for step `step`, with occasional large spikes."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for s in SHAPES:
        g = torch.randn(s, generator=gen)
        if step % 7 == 3:
            g.view(-1)[step % g.numel()] *= 300.0
        out.append(g.to(dtype))
    return out


def _run(opt: torch.optim.Optimizer, params, start: int, stop: int, dtype=torch.float32) -> None:
    for t in range(start, stop):
        for p, g in zip(params, _grads(t, dtype)):
            p.grad = g
        opt.step()


def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _reference_stable_spam(params, steps: int, hp: dict) -> list[torch.Tensor]:
    """Plain transcription of the Stable-SPAM rule (float64 EMAs in python floats, boolean
    indexing as in the official code), written independently of the optimizer under test."""
    lr, betas, eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    g1, g2, theta, total, lo, interval = (
        hp[k] for k in ("gamma1", "gamma2", "theta", "total_steps", "anneal_min", "reset_interval")
    )
    ws = [p.detach().clone() for p in params]
    st = [dict(m=torch.zeros_like(w), v=torch.zeros_like(w), k=0, tmax=0.0, mn=0.0, vn=0.0) for w in ws]
    for t in range(1, steps + 1):
        s = lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * min(t, total) / total))
        for w, g, S in zip(ws, _grads(t - 1), st):
            g = g.clone()
            gmax = g.abs().max().item()
            S["tmax"] = theta * S["tmax"] + (1 - theta) * gmax
            thr = S["tmax"] / (1 - theta**t)
            mask = g.abs() > thr
            g[mask] = g[mask] / gmax * thr
            n = g.norm().item()
            a = g1 * s
            S["mn"] = a * S["mn"] + (1 - a) * n
            S["vn"] = g2 * S["vn"] + (1 - g2) * n * n
            c = (S["mn"] / (1 - a**t)) / (math.sqrt(S["vn"] / (1 - g2**t)) + eps)
            g = g / n * c
            if t % interval == 0:
                S["m"].zero_()
                S["v"].zero_()
                S["k"] = 0
            S["k"] += 1
            b1 = betas[0] * s
            w.mul_(1 - lr * wd)
            S["m"] = b1 * S["m"] + (1 - b1) * g
            S["v"] = betas[1] * S["v"] + (1 - betas[1]) * g * g
            mh = S["m"] / (1 - b1 ** S["k"])
            vh = S["v"] / (1 - betas[1] ** S["k"])
            w -= lr * mh / (vh.sqrt() + eps)
    return ws


def test_reduces_to_torch_adamw():
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ours, ref = _params(0), _params(0)
    opt = StableSPAM(ours, adaptive_clip=False, norm_scaling=False, reset_interval=0, total_steps=None, **kw)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    _run(opt, ours, 0, 25)
    _run(ref_opt, ref, 0, 25)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_matches_transcribed_rule_with_spikes_reset_and_annealing():
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, gamma1=0.85, gamma2=0.999)
    hp.update(theta=0.999, total_steps=30, anneal_min=0.5, reset_interval=10)
    params = _params(1)
    opt = StableSPAM(params, **hp)
    expected = _reference_stable_spam(params, 30, hp)
    _run(opt, params, 0, 30)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)


def test_adaptive_clip_bounds_a_spike():
    """After five steps with max|G| = 0.1, a spike of 1000 is scaled down to the bias-corrected
    EMA threshold T^_6 (~167, the EMA already includes the spike); only that reaches m."""
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = StableSPAM([p], lr=0.0, norm_scaling=False, reset_interval=0, betas=(0.5, 0.999))
    for _ in range(5):
        p.grad = torch.full((4, 4), 0.1)
        opt.step()
    m_before = opt.state[p]["exp_avg"].clone()
    spike = torch.full((4, 4), 0.1)
    spike[0, 0] = 1000.0
    p.grad = spike
    opt.step()
    theta = 0.999
    ema = theta * 0.1 * (1 - theta**5) + (1 - theta) * 1000.0
    thr = ema / (1 - theta**6)
    m_after = opt.state[p]["exp_avg"]
    torch.testing.assert_close(m_after[0, 0], 0.5 * m_before[0, 0] + 0.5 * thr, rtol=1e-5, atol=0)
    # Entries below the threshold pass untouched.
    torch.testing.assert_close(m_after[1, 1], 0.5 * m_before[1, 1] + 0.05, rtol=1e-6, atol=0)
    assert thr < 200.0


def test_momentum_reset_restarts_moments_and_step():
    p = torch.nn.Parameter(torch.zeros(3, 3))
    opt = StableSPAM([p], lr=1e-3, reset_interval=4, adaptive_clip=False, norm_scaling=False)
    for t in range(1, 5):
        p.grad = torch.full((3, 3), float(t))
        opt.step()
    st = opt.state[p]
    assert st["step"] == 1 and st["global_step"] == 4
    # Fresh moments hold exactly one gradient: m = (1 - beta1) g, v = (1 - beta2) g^2.
    torch.testing.assert_close(st["exp_avg"], torch.full((3, 3), 0.1 * 4.0))
    torch.testing.assert_close(st["exp_avg_sq"], torch.full((3, 3), 0.001 * 16.0))


def test_annealing_factor_goes_from_one_to_half():
    opt = StableSPAM([torch.nn.Parameter(torch.zeros(2))], total_steps=100)
    g = opt.param_groups[0]
    vals = [opt.annealing_factor(g, t) for t in range(0, 121)]
    assert vals[0] == 1.0 and vals[100] == pytest.approx(0.5) and vals[120] == pytest.approx(0.5)
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    assert vals[50] == pytest.approx(0.75)


def test_zero_gradient_step_is_finite():
    p = torch.nn.Parameter(torch.ones(4, 3))
    opt = StableSPAM([p], total_steps=10)
    p.grad = torch.zeros(4, 3)
    opt.step()
    assert torch.isfinite(p).all()
    assert all(torch.isfinite(v).all() for v in opt.state[p].values() if torch.is_tensor(v))


def test_loss_goes_down_least_squares():
    gen = torch.Generator().manual_seed(0)
    A, x_true = torch.randn(64, 16, generator=gen), torch.randn(16, 8, generator=gen)
    B = A @ x_true
    x = torch.nn.Parameter(torch.zeros(16, 8))
    opt = StableSPAM([x], lr=5e-2, total_steps=100, reset_interval=40)
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
        _run(StableSPAM(params, total_steps=20, reset_interval=6), params, 0, 20)
        runs.append([p.detach().clone() for p in params])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_across_reset_is_exact(dtype):
    kw = dict(lr=1e-2, weight_decay=0.01, total_steps=16, reset_interval=5)
    straight = _params(4, dtype)
    _run(StableSPAM(straight, **kw), straight, 0, 16, dtype)

    first = _params(4, dtype)
    opt = StableSPAM(first, **kw)
    _run(opt, first, 0, 4, dtype)  # stop just before the reset at t = 5
    sd = _roundtrip(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = StableSPAM(resumed, **kw)
    opt2.load_state_dict(sd)
    assert opt2.state[resumed[0]]["exp_avg_max"].dtype == torch.float32
    _run(opt2, resumed, 4, 16, dtype)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_state_holds_only_tensors_and_ints():
    params = _params(5)
    opt = StableSPAM(params)
    _run(opt, params, 0, 2)
    for st in opt.state.values():
        assert {"step", "exp_avg", "exp_avg_sq"} <= set(st)
        assert isinstance(st["step"], int)
        assert all(torch.is_tensor(v) or type(v) is int for v in st.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_formula_matches_real_state(dtype):
    params = _params(6, dtype)
    opt = StableSPAM(params)
    _run(opt, params, 0, 2, dtype)
    for p in params:
        real = sum(v.numel() * v.element_size() for v in opt.state[p].values() if torch.is_tensor(v))
        assert real == StableSPAM.state_bytes(tuple(p.shape), {}, dtype)
        assert real == StableSPAM.state_bytes(tuple(p.shape), opt.param_groups[0], dtype)

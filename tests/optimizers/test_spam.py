"""Claims about optimizers.stable_spam.SPAM (PAPER.md 2.2, last sentence)."""

from __future__ import annotations

import io
import math

import pytest
import torch

from optimizers.stable_spam import SPAM

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
    """Deterministic gradients for step `step`, with occasional 1e3x spikes."""
    gen = torch.Generator().manual_seed(2000 + step)
    out = []
    for s in SHAPES:
        g = torch.randn(s, generator=gen)
        if step % 5 == 2:
            g.view(-1)[step % g.numel()] *= 1000.0
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


def _reference_spam(params, steps, lr, betas, eps, wd, thres, interval, warm, start, delay):
    """Plain transcription of the SPAM rule (boolean indexing as in the official code),
    written independently of the optimizer under test."""
    ws = [p.detach().clone() for p in params]
    st = [dict(m=torch.zeros_like(w), v=torch.zeros_like(w), k=0) for w in ws]
    for t in range(1, steps + 1):
        for w, g, S in zip(ws, _grads(t - 1), st):
            g = g.clone()
            if t % interval == 0:
                S["m"] = torch.zeros_like(w)
                S["v"] = torch.zeros_like(w)
            S["k"] += 1
            if t % interval >= delay:
                mask = g**2 > thres * S["v"]
                g[mask] = g[mask].sign() * torch.sqrt(S["v"][mask] * thres)
            c = t % interval
            mult = 1.0
            if t >= interval and c < warm:
                mult = 1 - (1 - start) * 0.5 * (1 + math.cos(math.pi * c / warm))
            w.mul_(1 - lr * wd)
            S["m"] = betas[0] * S["m"] + (1 - betas[0]) * g
            S["v"] = betas[1] * S["v"] + (1 - betas[1]) * g * g
            mh = S["m"] / (1 - betas[0] ** S["k"])
            vh = S["v"] / (1 - betas[1] ** S["k"])
            w -= lr * mult * mh / (vh.sqrt() + eps)
    return ws


def test_reduces_to_torch_adamw():
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ours, ref = _params(0), _params(0)
    opt = SPAM(ours, threshold=0.0, reset_interval=0, **kw)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    _run(opt, ours, 0, 25)
    _run(ref_opt, ref, 0, 25)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_matches_transcribed_rule_with_spikes_reset_and_rewarm():
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    params = _params(1)
    opt = SPAM(
        params, threshold=50.0, reset_interval=12, warmup_steps=5, warmup_start=0.01, clip_delay=3, **kw
    )
    expected = _reference_spam(
        params, 36, kw["lr"], kw["betas"], kw["eps"], kw["weight_decay"], 50.0, 12, 5, 0.01, 3
    )
    _run(opt, params, 0, 36)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)


def test_spike_is_clipped_to_sqrt_threshold_v():
    p = torch.nn.Parameter(torch.zeros(3, 3))
    opt = SPAM([p], lr=0.0, threshold=5000.0, reset_interval=0, clip_delay=2)
    for _ in range(3):
        p.grad = torch.full((3, 3), 0.01)
        opt.step()
    v = opt.state[p]["exp_avg_sq"].clone()
    m = opt.state[p]["exp_avg"].clone()
    g = torch.full((3, 3), 0.01)
    g[1, 2] = 100.0  # 1e4x a normal entry: g^2 = 1e4 >> 5000 v ~ 1.5e-3
    p.grad = g
    opt.step()
    bound = math.sqrt(5000.0 * v[1, 2].item())
    new_m = opt.state[p]["exp_avg"]
    torch.testing.assert_close(new_m[1, 2].item(), 0.9 * m[1, 2].item() + 0.1 * bound, rtol=1e-5, atol=0)
    torch.testing.assert_close(new_m[0, 0], 0.9 * m[0, 0] + 0.1 * 0.01, rtol=1e-6, atol=0)
    assert p.grad[1, 2] == 100.0  # the caller's gradient is not modified


def test_reset_zeroes_moments_and_keeps_step_counter_by_default():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = SPAM([p], reset_interval=4, threshold=0.0)
    for t in range(1, 5):
        p.grad = torch.full((2, 2), float(t))
        opt.step()
    st = opt.state[p]
    assert st["global_step"] == 4 and st["step"] == 4
    torch.testing.assert_close(st["exp_avg"], torch.full((2, 2), 0.1 * 4.0))
    opt2 = SPAM([q := torch.nn.Parameter(torch.zeros(2, 2))], reset_interval=4, reset_step_counter=True)
    for _ in range(4):
        q.grad = torch.ones(2, 2)
        opt2.step()
    assert opt2.state[q]["step"] == 1


def test_rewarm_multiplier_schedule():
    opt = SPAM([torch.nn.Parameter(torch.zeros(1))], reset_interval=500, warmup_steps=150)
    g = opt.param_groups[0]
    assert opt.lr_multiplier(g, 499) == 1.0  # no re-warm before the first reset
    assert opt.lr_multiplier(g, 500) == pytest.approx(0.01)
    assert opt.lr_multiplier(g, 575) == pytest.approx(0.505)
    assert opt.lr_multiplier(g, 650) == 1.0
    vals = [opt.lr_multiplier(g, t) for t in range(500, 651)]
    assert all(a <= b for a, b in zip(vals, vals[1:]))


def test_loss_goes_down_least_squares():
    gen = torch.Generator().manual_seed(0)
    A, x_true = torch.randn(64, 16, generator=gen), torch.randn(16, 8, generator=gen)
    B = A @ x_true
    x = torch.nn.Parameter(torch.zeros(16, 8))
    opt = SPAM([x], lr=5e-2, reset_interval=40, warmup_steps=10)
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
        _run(SPAM(params, reset_interval=6, warmup_steps=3, clip_delay=2, threshold=50.0), params, 0, 20)
        runs.append([p.detach().clone() for p in params])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_across_reset_is_exact(dtype):
    kw = dict(lr=1e-2, weight_decay=0.01, reset_interval=5, warmup_steps=3, clip_delay=1, threshold=50.0)
    straight = _params(4, dtype)
    _run(SPAM(straight, **kw), straight, 0, 16, dtype)

    first = _params(4, dtype)
    opt = SPAM(first, **kw)
    _run(opt, first, 0, 4, dtype)  # stop just before the reset at t = 5
    sd = _roundtrip(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = SPAM(resumed, **kw)
    opt2.load_state_dict(sd)
    _run(opt2, resumed, 4, 16, dtype)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_state_holds_only_tensors_and_ints():
    params = _params(5)
    opt = SPAM(params)
    _run(opt, params, 0, 2)
    for st in opt.state.values():
        assert {"step", "exp_avg", "exp_avg_sq"} <= set(st)
        assert all(torch.is_tensor(v) or type(v) is int for v in st.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_formula_matches_real_state(dtype):
    params = _params(6, dtype)
    opt = SPAM(params)
    _run(opt, params, 0, 2, dtype)
    for p in params:
        real = sum(v.numel() * v.element_size() for v in opt.state[p].values() if torch.is_tensor(v))
        assert real == SPAM.state_bytes(tuple(p.shape), {}, dtype)

"""Claims about optimizers.stable_spam.StableSPAM (PAPER.md 2.2) beyond the contract
(test_contract.py): the rule against an independent transcription, clipping, reset, annealing."""

from __future__ import annotations

import math

import harness
import pytest
import torch
from harness import make_grads, make_params, reference_adamw_step, run, step_with

from optimizers.stable_spam import StableSPAM

SHAPES = [(6, 4), (5,), (3, 7)]
GRADS = {"seed": 1000, "growth": 0.0, "spike": (7, 3, 300.0)}  # x300 on one entry every 7 steps

#: How the contract runs "stable_spam" (test_contract.py), on the spiky GRADS so that clipping acts.
CONTRACT = harness.Case(
    reduces=(
        harness.Reduction(
            "features_off",
            harness.ADAMW_SETTINGS,
            {"adaptive_clip": False, "norm_scaling": False, "reset_interval": 0, "total_steps": None},
        ),
    ),
    kwargs={"reset_interval": 5},  # resets at steps 5 and 10; annealed over 11 steps
    loss_lr=0.2,
    grads=GRADS,
    split=4,
    steps=11,
)


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
        for w, g, S in zip(ws, make_grads(SHAPES, t - 1, **GRADS), st):
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
            reference_adamw_step(w, g, S, lr, (betas[0] * s, betas[1]), eps, wd)  # beta1 annealed
    return ws


def test_matches_transcribed_rule_with_spikes_reset_and_annealing():
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, gamma1=0.85, gamma2=0.999)
    hp.update(theta=0.999, total_steps=30, anneal_min=0.5, reset_interval=10)
    params = make_params(SHAPES, 1, std=1.0)
    opt = StableSPAM(params, **hp)
    expected = _reference_stable_spam(params, 30, hp)
    run(opt, params, 0, 30, **GRADS)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)


def test_adaptive_clip_bounds_a_spike():
    """After five steps with max|G| = 0.1, a spike of 1000 is scaled down to the bias-corrected
    EMA threshold T^_6 (~167, the EMA already includes the spike); only that reaches m."""
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = StableSPAM([p], lr=0.0, norm_scaling=False, reset_interval=0, betas=(0.5, 0.999))
    step_with(opt, p, [0.1] * 5)
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
    step_with(opt, p, [1.0, 2.0, 3.0, 4.0])
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

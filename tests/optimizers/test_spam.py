"""Claims about optimizers.stable_spam.SPAM (Huang et al., ICLR 2025) beyond the contract
(test_contract.py): the rule against an independent transcription, clipping, reset, re-warm."""

from __future__ import annotations

import math

import harness
import pytest
import torch
from harness import make_grads, make_params, reference_adamw_step, run, step_with

from optimizers.stable_spam import SPAM

SHAPES = [(6, 4), (5,), (3, 7)]
GRADS = {"seed": 2000, "growth": 0.0, "spike": (5, 2, 1000.0)}  # x1000 on one entry every 5 steps

#: How the contract runs "spam" (test_contract.py), on the spiky GRADS so that clipping acts.
CONTRACT = harness.Case(
    reduces=(
        harness.Reduction("features_off", harness.ADAMW_SETTINGS, {"threshold": 0.0, "reset_interval": 0}),
    ),
    kwargs={"reset_interval": 5, "warmup_steps": 3, "clip_delay": 1, "threshold": 50.0},
    grads=GRADS,
    split=4,
    steps=11,
    loss_steps=50,  # the re-warm after each reset slows it
)


def _reference_spam(params, steps, lr, betas, eps, wd, thres, interval, warm, start, delay):
    """Plain transcription of the SPAM rule (boolean indexing as in the official code),
    written independently of the optimizer under test."""
    ws = [p.detach().clone() for p in params]
    st = [dict(m=torch.zeros_like(w), v=torch.zeros_like(w), k=0) for w in ws]
    for t in range(1, steps + 1):
        for w, g, S in zip(ws, make_grads(SHAPES, t - 1, **GRADS), st):
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
            reference_adamw_step(w, g, S, lr, betas, eps, wd, lr_mult=mult)
    return ws


def test_matches_transcribed_rule_with_spikes_reset_and_rewarm():
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    params = make_params(SHAPES, 1, std=1.0)
    opt = SPAM(
        params, threshold=50.0, reset_interval=12, warmup_steps=5, warmup_start=0.01, clip_delay=3, **kw
    )
    expected = _reference_spam(
        params, 36, kw["lr"], kw["betas"], kw["eps"], kw["weight_decay"], 50.0, 12, 5, 0.01, 3
    )
    run(opt, params, 0, 36, **GRADS)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)


def test_spike_is_clipped_to_sqrt_threshold_v():
    p = torch.nn.Parameter(torch.zeros(3, 3))
    opt = SPAM([p], lr=0.0, threshold=5000.0, reset_interval=0, clip_delay=2)
    step_with(opt, p, [0.01] * 3)
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
    step_with(opt, p, [1.0, 2.0, 3.0, 4.0])
    st = opt.state[p]
    assert st["global_step"] == 4 and st["step"] == 4
    torch.testing.assert_close(st["exp_avg"], torch.full((2, 2), 0.1 * 4.0))
    opt2 = SPAM([q := torch.nn.Parameter(torch.zeros(2, 2))], reset_interval=4, reset_step_counter=True)
    step_with(opt2, q, [1.0] * 4)
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

"""Claims about optimizers/restarts.py: when it fires, what it does, exact resume, LR recovery."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from harness import roundtrip
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from optimizers.restarts import Restarts, recovery_factor


class Tiny(nn.Module):
    """y = B (A x) + W x: one factor pair (deliberately unbalanced at init) and one dense weight."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.B = nn.Parameter(5.0 * torch.randn(6, 3, generator=g))
        self.A = nn.Parameter(0.05 * torch.randn(3, 8, generator=g))
        self.W = nn.Parameter(0.1 * torch.randn(6, 8, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.A.T) @ self.B.T + x @ self.W.T

    def pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        return [(self.B, self.A)]


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 6, generator=g)


def _train_step(model: Tiny, opt: torch.optim.Optimizer, i: int, sched=None) -> None:
    x, y = _batch(i)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    if sched is not None:
        sched.step()


def _imbalance(model: Tiny) -> float:
    gb, ga = model.B.T @ model.B, model.A @ model.A.T
    return ((gb - ga).norm() / gb.norm()).item()


def test_is_an_optimizer_sharing_the_inner_state():
    model = Tiny()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = Restarts(inner, model.pairs(), every=3)
    assert isinstance(opt, torch.optim.Optimizer)
    assert (
        opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    )
    _train_step(model, opt, 0)
    assert opt.state is inner.state and len(inner.state) == 3
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    seen = []
    opt.register_step_post_hook(lambda o, a, k: seen.append(o.num_steps))
    _train_step(model, opt, 1)
    assert seen == [2]


def test_fires_at_exactly_the_configured_steps():
    model = Tiny()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    calls = []

    def hook():
        # Hooks run first: state not yet reset, factors not yet balanced.
        calls.append((opt.num_steps, inner.state[model.B]["step"].item(), _imbalance(model) > 1e-3))

    opt = Restarts(inner, model.pairs, every=3, hooks=[hook])
    for i in range(8):
        _train_step(model, opt, i)
        steps = inner.state[model.W]["step"].item()
        fired = (i + 1) % 3 == 0
        assert steps == (0.0 if fired else float((i + 1) % 3))
        if fired:
            assert _imbalance(model) <= 1e-5
            assert torch.count_nonzero(inner.state[model.W]["exp_avg"]) == 0
        else:
            assert _imbalance(model) > 1e-3
    assert calls == [(3, 3.0, True), (6, 3.0, True)]
    assert opt.num_steps == 8 and opt.num_restarts == 2


def test_switches_turn_parts_off():
    model, twin = Tiny(), Tiny()
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    opt = Restarts(torch.optim.AdamW(model.parameters(), lr=1e-2), model.pairs(), 2, False, False)
    for i in range(5):
        _train_step(model, opt, i)
        _train_step(twin, plain, i)
    assert opt.num_restarts == 2
    # Bitwise: with both parts off the wrapper only calls the inner AdamW, as the plain one runs.
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_state_dict_round_trip_weights_only():
    model = Tiny()
    opt = Restarts(torch.optim.AdamW(model.parameters(), lr=1e-2), model.pairs, every=2)
    for i in range(5):
        _train_step(model, opt, i)
    sd = roundtrip(opt.state_dict())
    assert sd["restarts"] == {"step": 5, "count": 2}
    other = Restarts(torch.optim.AdamW(model.parameters(), lr=1e-2), model.pairs, every=2)
    other.load_state_dict(sd)
    assert (other.num_steps, other.num_restarts) == (5, 2)
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(other.state[p][k], v)
    with pytest.raises(ValueError, match="'restarts'"):
        other.load_state_dict(opt.optimizer.state_dict())


def _setup(seed: int, every: int = 4, recovery: int = 2):
    model = Tiny(seed)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    opt = Restarts(inner, model.pairs, every=every)
    sched = LambdaLR(opt, lambda s: (0.5 + 0.5 * min(1.0, s / 3)) * recovery_factor(s, every, recovery))
    return model, opt, sched


def test_resume_across_a_restart_boundary_is_bitwise_exact():
    model, opt, sched = _setup(0)
    for i in range(11):
        _train_step(model, opt, i, sched)

    first, opt1, sched1 = _setup(0)
    for i in range(6):
        _train_step(first, opt1, i, sched1)
    ckpt = roundtrip({"model": first.state_dict(), "opt": opt1.state_dict(), "sched": sched1.state_dict()})
    second, opt2, sched2 = _setup(1)  # different init: everything must come from the checkpoint
    second.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    for i in range(6, 11):  # crosses the restart after update 8
        _train_step(second, opt2, i, sched2)

    assert opt.num_restarts == opt2.num_restarts == 2
    for p, q in zip(model.parameters(), second.parameters()):
        assert torch.equal(p, q)  # bitwise: the same kernels in the same order after the resume
    for p, q in zip(model.parameters(), second.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(opt2.state[q][k], v)
    assert sched.get_last_lr() == sched2.get_last_lr()


def test_recovery_factor_values():
    T, R, f = 200, 10, 1e-3
    assert [recovery_factor(s, T, R) for s in (0, 1, 199)] == [1.0, 1.0, 1.0]
    assert recovery_factor(200, T, R) == pytest.approx(f)
    assert recovery_factor(201, T, R) == pytest.approx(f + (1 - f) * 0.1)
    assert recovery_factor(209, T, R) == pytest.approx(f + (1 - f) * 0.9)
    assert [recovery_factor(s, T, R) for s in (210, 399)] == [1.0, 1.0]
    assert recovery_factor(400, T, R) == pytest.approx(f)
    assert recovery_factor(405, T, R, floor=0.0) == pytest.approx(0.5)
    assert all(recovery_factor(s, T, 0) == 1.0 for s in range(0, 1000, 7))
    ramp = [recovery_factor(s, T, R) for s in range(200, 211)]
    assert all(b > a for a, b in zip(ramp, ramp[1:]))
    for bad in ((-1, T, R), (5, 0, R), (5, T, -1)):
        with pytest.raises(ValueError):
            recovery_factor(*bad)


def test_recovery_ramp_starts_with_the_first_update_after_a_restart():
    model = Tiny()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = Restarts(inner, model.pairs, every=3, reset_momentum=False)
    sched = LambdaLR(opt, lambda s: recovery_factor(s, 3, 2))
    used, restarted_before = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for i in range(8):
            used.append(inner.param_groups[0]["lr"])
            restarted_before.append(opt.num_restarts)
            _train_step(model, opt, i, sched)
    f = 1e-3
    expected = [0.1, 0.1, 0.1, 0.1 * f, 0.1 * (f + (1 - f) / 2), 0.1, 0.1 * f, 0.1 * (f + (1 - f) / 2)]
    assert used == pytest.approx(expected)
    # update number 4 (index 3) is the first one after the first restart, 7 after the second
    assert restarted_before == [0, 0, 0, 1, 1, 1, 2, 2]


def test_factor_pairs_may_be_a_callable_resolved_at_each_restart():
    model = Tiny()
    asked = []

    def pairs():
        asked.append(1)
        return model.pairs()

    opt = Restarts(torch.optim.AdamW(model.parameters(), lr=1e-2), pairs, every=2)
    _train_step(model, opt, 0)
    assert asked == []
    _train_step(model, opt, 1)
    assert asked == [1] and _imbalance(model) <= 1e-5


def test_skipped_inner_steps_are_not_counted():
    model = Tiny()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inner.gradient_state = SimpleNamespace(sync_gradients=False)  # an accumulation micro-step
    opt = Restarts(inner, model.pairs(), every=1)
    _train_step(model, opt, 0)
    assert opt.num_steps == 0 and opt.num_restarts == 0


def test_state_materialising_dummy_step_is_not_counted():
    model = Tiny()
    opt = Restarts(torch.optim.AdamW(model.parameters(), lr=1e-2), model.pairs(), every=1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # like torch.distributed.checkpoint's _init_optim_state
    assert (opt.num_steps, opt.num_restarts) == (0, 0) and len(opt.state) == 3
    _train_step(model, opt, 0)
    assert (opt.num_steps, opt.num_restarts) == (1, 1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # later zero-gradient steps are ordinary updates
    assert opt.num_steps == 2


def test_rejects_bad_arguments():
    model = Tiny()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for every in (0, 2.5, True):
        with pytest.raises(ValueError, match="every"):
            Restarts(inner, model.pairs(), every=every)
    with pytest.raises(TypeError):
        Restarts(object(), model.pairs(), every=2)


def test_inside_accelerate_with_gradient_accumulation():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    try:
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = Tiny()
        opt = Restarts(torch.optim.AdamW(model.parameters(), lr=1e-2), model.pairs, every=2)
        sched = LambdaLR(opt, lambda s: recovery_factor(s, 2, 1))
        pmodel, popt, psched = acc.prepare(model, opt, sched)
        for i in range(8):  # 8 micro-batches = 4 updates = 2 restarts
            with acc.accumulate(pmodel):
                x, y = _batch(i)
                acc.backward(((pmodel(x) - y) ** 2).mean())
                popt.step()
                psched.step()
                popt.zero_grad()
        assert (opt.num_steps, opt.num_restarts) == (4, 2)
        assert popt.state_dict()["restarts"] == {"step": 4, "count": 2}
        assert _imbalance(model) <= 1e-5
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

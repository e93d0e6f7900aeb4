"""Claims about optimizers/momentum_reset.py: exactly the named state of exactly the given params."""

from __future__ import annotations

import pytest
import torch

import optimizers
from optimizers.momentum_reset import prune_, reset_, unwrap_optimizer


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in [(4, 3), (5,), (2, 6)]]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def _snapshot(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_resets_exactly_given_params(foreach, amsgrad):
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=foreach, amsgrad=amsgrad)
    _train(opt, params, 3)
    objects = {k: id(v) for k, v in opt.state[params[0]].items()}
    untouched = _snapshot(opt, params[2])
    values = [p.detach().clone() for p in params]

    n = reset_(opt, params=params[:2])

    per_param = 4 if amsgrad else 3
    assert n == 2 * per_param
    for p in params[:2]:
        st = opt.state[p]
        assert st["step"].dtype == torch.float32 and st["step"].item() == 0.0
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            assert torch.count_nonzero(st[key]) == 0
    assert {k: id(v) for k, v in opt.state[params[0]].items()} == objects  # zeroed in place
    after = opt.state[params[2]]
    assert after.keys() == untouched.keys()
    for k, v in untouched.items():
        assert torch.equal(after[k], v)
    assert all(torch.equal(p, v) for p, v in zip(params, values))  # weights untouched


@pytest.mark.parametrize("foreach", [False, True])
def test_reset_then_step_equals_fresh_optimizer(foreach):
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=foreach)
    _train(opt, params, 4)
    reset_(opt)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1, foreach=foreach)
    _train(opt, params, 2, seed=7)
    _train(fresh, twins, 2, seed=7)
    for p, q in zip(params, twins):
        assert torch.equal(p, q)  # bitwise: the same kernels on the same (reset / fresh) state


def test_reset_changes_the_next_update():
    # Control for the claim above: without a reset the continuation differs.
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e-2)
    _train(opt, params, 4)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = torch.optim.AdamW(twins, lr=1e-2)
    _train(opt, params, 1, seed=7)
    _train(fresh, twins, 1, seed=7)
    assert not torch.equal(params[0], twins[0])


def test_keys_select_what_is_reset():
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e-2)
    _train(opt, params, 2)
    before = _snapshot(opt, params[0])
    assert reset_(opt, keys=("exp_avg",)) == 3
    st = opt.state[params[0]]
    assert torch.count_nonzero(st["exp_avg"]) == 0
    assert torch.equal(st["exp_avg_sq"], before["exp_avg_sq"]) and st["step"].item() == 2.0


# Methods whose next update after a reset is, by design, not a fresh optimizer's: they keep state
# that a reset must not clear (the reason each), so the test below cannot hold for them.
KEEPS_HISTORY = {
    "stable_spam": "keeps its spike statistics and global step, as its own periodic resets do",
    "spam": "keeps its global step, which schedules its own resets",
    "golore": "keeps its refresh count, which seeds the next random basis",
    "apollo": "keeps its refresh count, which seeds the next random projection",
    "apollo_mini": "keeps its refresh count, which seeds the next random projection",
}
_MATS, _DENSE = [(64, 64), (96, 64)], [(512, 64), (64,), (512, 64)]


def _registry_groups(name: str, ps: list[torch.nn.Parameter]) -> list[dict]:
    """The method's param groups for two matrices, an embedding, a vector and a head."""
    spec = optimizers.METHODS[name]
    mats, dense = ps[: len(_MATS)], ps[len(_MATS) :]
    if spec.matrix_params:  # each role the method gives a group (SCALE: embedding and head too)
        groups = [{"params": mats, **spec.matrix_group("hidden")}, {"params": dense[1:2]}]
        for p, role in (
            (dense[0], spec.matrix_role(target=False, embedding=True, ndim=2)),
            (dense[2], spec.matrix_role(target=False, embedding=False, ndim=2)),
        ):
            groups.append({"params": [p], **spec.matrix_group(role)} if role else {"params": [p]})
        return groups
    if spec.projects:  # the exact SVD basis (the randomized one is seeded by the refresh count)
        proj = spec.projection_group(rank=8, update_proj_gap=100, scale=0.5, basis="svd")
        return [{"params": mats, **proj}, {"params": dense}]
    return [{"params": ps}]


@pytest.mark.parametrize("name", sorted(set(optimizers.METHODS) - set(KEEPS_HISTORY)))
def test_every_methods_reset_then_step_equals_a_fresh_optimizer(name):
    """reset_ with the optimizer's own keys (`reset_keys`: Muon's momentum, the 8-bit codes and
    their scales) leaves state under which the next update is a freshly built optimizer's first,
    bitwise. A projected method refreshes its basis at the step after a reset (t = 0), here with
    the exact SVD (the default randomized SVD is seeded by the refresh count, which a reset keeps:
    another sketch than a fresh optimizer's first, by design), from step 1's gradient again.
    Bitwise: a reset state holds what a fresh one holds, and the same kernels step it."""
    if name.endswith("8bit"):
        pytest.importorskip("bitsandbytes")
    spec = optimizers.METHODS[name]
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in _MATS + _DENSE]
    kw = {"total_steps": 10} if spec.needs_total_steps else {}
    opt = optimizers.build_optimizer(name, _registry_groups(name, params), lr=1e-2, **kw)
    first = [torch.randn(p.shape, generator=gen) for p in params]
    for step in range(3):
        for p, g in zip(
            params, first if step == 0 else [torch.randn(p.shape, generator=gen) for p in params]
        ):
            p.grad = g
        opt.step()
    assert reset_(opt) > 0
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = optimizers.build_optimizer(name, _registry_groups(name, twins), lr=1e-2, **kw)
    for o, ps in ((opt, params), (fresh, twins)):
        for p, g in zip(ps, first):
            p.grad = g.clone()
        o.step()
    for p, q in zip(params, twins):
        assert torch.equal(p, q), (name, tuple(p.shape), float((p - q).detach().abs().max()))


def test_every_method_is_checked_after_a_reset_or_keeps_history_for_a_reason():
    assert set(KEEPS_HISTORY) <= set(optimizers.METHODS)


class _ProjectionLike(torch.optim.Optimizer):
    """Stand-in for this package's optimizers: python-int step, low-rank moments, a basis."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-2})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(step=0, seed=1234, refresh=0, basis=torch.randn(p.shape[0], 2))
                    st.update(exp_avg=torch.zeros(2, p.shape[-1]), exp_avg_sq=torch.zeros(2, p.shape[-1]))
                st["step"] += 1
                st["refresh"] += 1
                st["exp_avg"].add_(1.0)
                st["exp_avg_sq"].add_(2.0)


def test_int_step_and_projection_state():
    params = [torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(3, 5))]
    opt = _ProjectionLike(params)
    _train(opt, params, 3)
    basis = opt.state[params[0]]["basis"].clone()
    assert reset_(opt) == 2 * 3
    st = opt.state[params[0]]
    assert st["step"] == 0 and type(st["step"]) is int
    assert torch.count_nonzero(st["exp_avg"]) == 0 and torch.count_nonzero(st["exp_avg_sq"]) == 0
    assert torch.equal(st["basis"], basis) and st["seed"] == 1234 and st["refresh"] == 3


class _Wrapper(torch.optim.Optimizer):
    """Like Accelerate's AcceleratedOptimizer: the real optimizer is in `.optimizer`."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups


def test_accepts_wrappers():
    params = _params()
    inner = torch.optim.AdamW(params, lr=1e-2)
    wrapped = _Wrapper(_Wrapper(inner))
    assert unwrap_optimizer(wrapped) is inner
    _train(inner, params, 2)
    assert reset_(wrapped, params=[params[1]]) == 3
    assert inner.state[params[1]]["step"].item() == 0.0 and inner.state[params[0]]["step"].item() == 2.0


def test_unknown_param_and_no_state():
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e-2)
    assert reset_(opt) == 0  # nothing stepped yet: no state to reset
    with pytest.raises(ValueError, match="not managed"):
        reset_(opt, params=[torch.nn.Parameter(torch.zeros(2))])


def test_prune_keeps_the_largest_fraction():
    p = torch.nn.Parameter(torch.zeros(4, 5))
    opt = torch.optim.AdamW([p], lr=1e-2)
    p.grad = torch.ones_like(p)
    opt.step()
    values = torch.arange(1.0, 21.0).view(4, 5) * torch.tensor([1.0, -1.0]).repeat(10).view(4, 5)
    opt.state[p]["exp_avg"].copy_(values)
    opt.state[p]["exp_avg_sq"].copy_(values.abs())
    assert prune_(opt, 0.75) == 2
    for key, ref in (("exp_avg", values), ("exp_avg_sq", values.abs())):
        x = opt.state[p][key]
        kept = x != 0
        assert kept.sum() == 5
        assert torch.equal(x[kept], ref[kept])  # kept entries exactly, signs included
        assert set(x[kept].abs().tolist()) == {16.0, 17.0, 18.0, 19.0, 20.0}
    assert opt.state[p]["step"].item() == 1.0  # counter untouched


def test_prune_ratio_edges():
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e-2)
    _train(opt, params, 2)
    before = _snapshot(opt, params[0])
    prune_(opt, 0.0, params=[params[0]])
    assert torch.equal(opt.state[params[0]]["exp_avg"], before["exp_avg"])
    prune_(opt, 0.999, params=[params[0]])  # 12 entries: floor(11.988) = 11 pruned, 1 kept
    assert torch.count_nonzero(opt.state[params[0]]["exp_avg"]) == 1
    prune_(opt, 1.0, params=[params[0]])
    assert torch.count_nonzero(opt.state[params[0]]["exp_avg"]) == 0
    with pytest.raises(ValueError, match="prune ratio"):
        prune_(opt, 1.5)

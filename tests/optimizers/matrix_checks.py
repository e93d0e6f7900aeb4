"""Shared claims about the whole-matrix optimizers (optimizers/_matrix.py: Muon, SWAN, SinkGD,
SCALE) that the contract's projected-only checks do not cover: the zero-gradient dummy step and
AdamW on the non-matrix parameters. Each method's tests/optimizers/test_<name>.py runs them."""

from __future__ import annotations

from typing import Any

import harness
import torch
from harness import assert_same, assert_same_state, make_params, run, snapshot

import optimizers


def build(name: str, params: list[torch.Tensor], **kw: Any) -> torch.optim.Optimizer:
    """`name` over `params` (laid out as `harness.SHAPES`) with the contract's groups."""
    groups = harness.param_groups(name, params[:2], params[2:3], params[3:])
    return optimizers.build_optimizer(name, groups, **{**harness.ADAM, **kw})


def check_groups(name: str, roles: list[str]) -> None:
    """The contract's groups put the two matrices (and the 'dense' one where the method takes
    every matrix) in ``matrix`` groups with these roles; the rest are AdamW groups."""
    opt = build(name, make_params())
    got = [g["role"] for g in opt.param_groups if g["matrix"]]
    assert got == roles
    assert any(not g["matrix"] for g in opt.param_groups)


def check_dummy_step(name: str, **kw: Any) -> None:
    """A step on all-zero gradients (distributed checkpoint loaders) allocates every parameter's
    state (the formula's bytes, zeros), moves no weight, advances no counter, and the run then
    equals a fresh one; in mid-run it changes nothing at all. Bitwise: a state that the dummy step
    only allocated (zeros) is stepped by the same kernels as a fresh one."""
    spec = optimizers.method_spec(name)
    params, fresh_params = make_params(), make_params()
    opt, fresh = build(name, params, **kw), build(name, fresh_params, **kw)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert_same(params, fresh_params, what="weights after the dummy step")
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            assert st["step"] == 0
            assert harness.state_bytes_of(opt, p) == spec.state_bytes(tuple(p.shape), group, p.dtype)
            assert not any(v.any() for v in st.values() if torch.is_tensor(v))
    run(opt, params, 0, 3)
    run(fresh, fresh_params, 0, 3)
    assert_same(params, fresh_params, what="after a dummy first step")
    weights, states = [p.detach().clone() for p in params], [snapshot(opt, p) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert_same(params, weights, what="weights after a mid-run dummy step")
    for p, before in zip(params, states):
        assert_same_state(opt.state[p], before)
    run(opt, params, 3, 6)
    run(fresh, fresh_params, 3, 6)
    assert_same(params, fresh_params, what="after a mid-run dummy step")


def check_adamw_part(name: str) -> None:
    """Parameters outside the matrix groups step exactly as torch.optim.AdamW (single-tensor path),
    bitwise, with and without weight decay: `optimizers._adam.adamw_step_` is that path's sequence
    of element-wise operations, op for op, so the same kernels run on the same values."""
    ours, ref = make_params(std=1.0), make_params(std=1.0)
    adam = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8}
    groups = [{"params": ours[:3], "weight_decay": 0.1}, {"params": ours[3:], "weight_decay": 0.0}]
    ref_groups = [{"params": ref[:3], "weight_decay": 0.1}, {"params": ref[3:], "weight_decay": 0.0}]
    opt = optimizers.build_optimizer(name, groups, **adam)
    ref_opt = torch.optim.AdamW(ref_groups, **adam, foreach=False)
    for t in range(8):
        harness.set_grads(ours, t)
        harness.set_grads(ref, t)
        opt.step()
        ref_opt.step()
        assert_same(ours, ref, what=f"{name} AdamW part, step {t + 1}")


def check_rejects_vectors_and_unknown_options(name: str) -> None:
    """A vector in a matrix group, an unknown role and an unknown option are errors."""
    import pytest

    spec = optimizers.method_spec(name)
    with pytest.raises(ValueError, match="only 2-D weights"):
        optimizers.build_optimizer(
            name, [{"params": [torch.nn.Parameter(torch.zeros(5))], **spec.matrix_group("hidden")}]
        )
    with pytest.raises(ValueError, match="role"):
        optimizers.build_optimizer(name, [{"params": make_params()[:1], "matrix": True, "role": "tail"}])
    with pytest.raises(TypeError, match="unknown option.*rnak"):
        optimizers.build_optimizer(name, make_params()[:1], rnak=3)

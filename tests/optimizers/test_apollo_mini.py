"""Claims about optimizers.apollo.APOLLOMini: rank-1, tensor-wise APOLLO (Zhu et al. 2024), beyond the
contract (test_contract.py).

The reference match runs apollo_torch.APOLLOAdamW with its README's APOLLO-Mini group (rank 1,
scale_type "tensor", scale 128) beside ours drawing apollo-torch's random stream
(``random_stream="apollo_torch"``); nothing is injected.
"""

from __future__ import annotations

import harness
import pytest
import torch
from harness import make_params, reference_groups, run, run_beside, set_grads, state_bytes_of

from optimizers.apollo import APOLLOAdamW, APOLLOMini

SHAPES = [(16, 8), (6, 20), (7,)]
GRADS = {"seed": 700, "growth": 0.0}

#: How the contract runs "apollo_mini" (test_contract.py), with each of APOLLO's random streams.
CONTRACT = harness.Case(
    reduces="does not reduce: rank 1 and one tensor-wide scale of the raw gradient",
    variants=harness.APOLLO_STREAMS,
    loss_lr=1.0,
)


def _params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return make_params(SHAPES, seed, dtype, std=1.0)


def test_defaults_are_apollo_mini():
    params = _params(0)
    opt = APOLLOMini(reference_groups(params, rank=1))
    g = opt.param_groups[0]
    assert issubclass(APOLLOMini, APOLLOAdamW)
    assert (g["rank"], g["scale_type"], g["scale"], g["basis"]) == (1, "tensor", 128.0, "random")
    assert [gr["project"] for gr in opt.param_groups] == [True, False]
    marked = APOLLOMini([{"params": params[:2], "project": True}])
    assert marked.param_groups[0]["rank"] == 1


def test_rank_other_than_one_is_rejected():
    with pytest.raises(ValueError, match="rank 1"):
        APOLLOMini([{"params": _params(0)[:2], "rank": 4}])


def test_matches_apollo_torch_readme_mini_setting_across_refreshes():
    apollo_torch = pytest.importorskip("apollo_torch")
    readme = dict(proj="random", scale_type="tensor", scale=128, proj_type="std")
    ref_p, ours_p = _params(1), _params(1)
    ref = apollo_torch.APOLLOAdamW(reference_groups(ref_p, rank=1, **readme), lr=1e-3)
    ours = APOLLOMini(reference_groups(ours_p, rank=1), lr=1e-3, random_stream="apollo_torch")
    run_beside(
        ours, ours_p, ref, ref_p, 8, relative_to="weights", **GRADS
    )  # refreshes before steps 1, 4 and 7


def test_update_is_one_scalar_times_the_gradient():
    """Tensor-wise scaling: without decay, each weight moves by c G for a single scalar c."""
    params = _params(2)
    opt = APOLLOMini([{"params": params[:2], "rank": 1}], lr=1e-2)
    before = [p.detach().clone() for p in params[:2]]
    set_grads(params, 0, **GRADS)
    opt.step()
    for b, p in zip(before, params[:2]):
        delta, g = b - p.detach(), p.grad
        c = (delta * g).sum() / (g * g).sum()  # least-squares fit of delta = c G
        assert c > 0
        assert (delta - c * g).abs().max() <= 1e-5 * delta.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_formula_worked_values(dtype):
    params = _params(5, dtype)
    opt = APOLLOMini(reference_groups(params, rank=1))
    run(opt, params, 0, 2, **GRADS)
    s = dtype.itemsize
    # Right side (16 x 8): moments 16 x 1; left side (6 x 20): 1 x 20; plus the fp32 limiter norm.
    expected = [2 * s * 16 + 4, 2 * s * 20 + 4, 2 * s * 7]
    groups = [opt.param_groups[0], opt.param_groups[0], opt.param_groups[1]]
    for p, g, e in zip(params, groups, expected):
        assert state_bytes_of(opt, p) == e
        assert APOLLOMini.state_bytes(tuple(p.shape), g, dtype) == e
    assert APOLLOMini.state_bytes((16, 8), {"rank": 1}, dtype) == expected[0]
    assert APOLLOMini.state_bytes((16, 8), {"project": True}, dtype) == expected[0]
    assert APOLLOMini.state_bytes((7,), {}, dtype) == expected[2]

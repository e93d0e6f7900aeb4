"""Claims about optimizers.fira.FiraAdamW (Chen et al. 2024) beyond the contract (test_contract.py):
step-by-step match with fira, the residual and its norm-growth limiter, state layout, defaults."""

from __future__ import annotations

import harness
import pytest
import torch
from harness import (
    REF_SHAPES,
    assert_projected_defaults,
    make_params,
    reference_groups,
    run_beside,
    saved_projected_state,
)

from optimizers.fira import FiraAdamW
from optimizers.galore import GaLoreAdamW

#: How the contract runs "fira" (test_contract.py).
CONTRACT = harness.Case(
    # With the full basis the residual G - back(R) is exactly 0.
    reduces=harness.PROJECTED_ADAM,
    variants=harness.SVD_FAMILY,
    loss_lr=0.5,
)


def test_residual_is_what_the_projection_drops() -> None:
    """S = (G - alpha back(R)) phi by default (fira's code); G - back(R) with exact_residual."""
    w = torch.nn.Parameter(torch.zeros(24, 16))
    g = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))
    for exact in (False, True):
        w.data.zero_()
        opt = FiraAdamW(
            [{"params": [w], "rank": 4, "alpha": 0.5, "basis": "svd", "exact_residual": exact}],
            lr=1.0,
            adam_convention="torch",
            betas=(0.0, 0.0),
            eps=0.0,
        )
        w.grad = g.clone()
        opt.step()
        p = opt.state[w]["basis"]
        low = g @ p.t()
        phi = (torch.sign(low).norm(dim=1) / (low.norm(dim=1) + 1e-8)).unsqueeze(1)
        resid = (g - (1.0 if exact else 0.5) * low @ p) * phi
        expected = -(0.5 * torch.sign(low) @ p + resid)
        torch.testing.assert_close(w.detach(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "right", "left"])
def test_matches_fira_step_by_step_across_refreshes(proj_type: str) -> None:
    ref_cls = pytest.importorskip("fira").FiraAdamW
    ours, ref = make_params(REF_SHAPES), make_params(REF_SHAPES)
    kw = {"alpha": 0.25, "proj_type": proj_type}
    opt = FiraAdamW(reference_groups(ours, basis="svd", **kw), lr=1e-2, weight_decay=0.05)
    ref_opt = ref_cls(reference_groups(ref, **kw), lr=1e-2, weight_decay=0.05, no_deprecation_warning=True)
    norms = []

    def same_residual_norm(t: int) -> None:
        st, ref_st = opt.state[ours[0]], ref_opt.state[ref[0]]
        torch.testing.assert_close(st["residual_norm"], ref_st["scaling_grad"], rtol=1e-5, atol=0)
        norms.append(float(ref_st["scaling_grad"]))

    run_beside(opt, ours, ref_opt, ref, 8, after=same_residual_norm)  # refreshes at steps 1, 4, 7
    # Gradients grow (harness.set_grads), so the limiter acts: the norm grew by at most ~1%.
    limited = sum(b < 1.0101 * a for a, b in zip(norms, norms[1:]))
    assert opt.refresh_count == 2 * 3
    assert limited >= 3  # the comparison covered steps where the norm-growth limiter was active


def test_norm_growth_limiter_caps_residual_growth() -> None:
    """A gradient whose off-basis part jumps 100x: S may grow by at most gamma = 1.01 per step."""
    gen = torch.Generator().manual_seed(0)
    low_rank = torch.randn(24, 4, generator=gen) @ torch.randn(4, 16, generator=gen)
    noise = torch.randn(24, 16, generator=gen)
    norms = {}
    for limit in (1.01, None):
        w = torch.nn.Parameter(torch.zeros(24, 16))
        opt = FiraAdamW(
            [{"params": [w], "rank": 4, "update_proj_gap": 100, "basis": "svd", "norm_growth_limit": limit}]
        )
        seen = []
        for t in range(4):
            w.grad = low_rank + (0.01 if t == 0 else 1.0) * noise
            opt.step()
            seen.append(float(opt.state[w]["residual_norm"]))
        norms[limit] = seen
    for a, b in zip(norms[1.01], norms[1.01][1:]):
        assert b <= 1.01 * a * (1 + 1e-5)
    assert norms[None][1] > 20 * norms[None][0]
    assert norms[1.01][0] == norms[None][0]  # the first step is never limited


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("basis", ["randomized_svd", "random"])
def test_state_bytes_are_galores_plus_the_residual_norm(dtype: torch.dtype, basis: str) -> None:
    """Projected: GaLore's 2 s m k + s k n (right) or 2 s k n + s m k (left), plus s for
    ``residual_norm``; dense: GaLore's 2 s numel."""
    for shape, group in (((24, 16), {"rank": 4, "basis": basis}), ((12, 20), {"rank": 4, "basis": basis})):
        assert (
            FiraAdamW.state_bytes(shape, group, dtype)
            == GaLoreAdamW.state_bytes(shape, group, dtype) + dtype.itemsize
        )
    for shape, group in (((7,), {}), ((12, 20), {"lr": 0.1})):
        assert FiraAdamW.state_bytes(shape, group, dtype) == GaLoreAdamW.state_bytes(shape, group, dtype)


def test_state_dict_is_galores_plus_the_residual_norm() -> None:
    params = make_params(REF_SHAPES)
    st = saved_projected_state(FiraAdamW(reference_groups(params), lr=1e-2), params)
    galore = saved_projected_state(GaLoreAdamW(reference_groups(params), lr=1e-2), params)
    assert set(st) == set(galore) | {"residual_norm"}
    assert st["basis"].dtype == torch.float32 and st["exp_avg"].shape == (24, 4)


def test_groups_record_eligibility_and_defaults() -> None:
    opt = FiraAdamW(reference_groups(make_params(REF_SHAPES)), lr=1e-2)
    assert_projected_defaults(opt, scale_key="alpha")
    g0 = opt.param_groups[0]
    assert g0["norm_growth_limit"] == 1.01 and g0["exact_residual"] is False


def test_full_projection_is_rejected_and_galore_groups_drop_in() -> None:
    with pytest.raises(ValueError, match="full"):
        FiraAdamW([{"params": make_params(REF_SHAPES)[:1], "rank": 2, "proj_type": "full"}])
    # A galore-format group drops in: its scale becomes alpha.
    group = {"params": make_params(REF_SHAPES)[:1], "rank": 2, "scale": 0.25}
    assert FiraAdamW([group]).param_groups[0]["alpha"] == 0.25

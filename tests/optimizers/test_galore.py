"""Claims about optimizers.galore.GaLoreAdamW (Zhao et al. 2024) beyond the contract (test_contract.py):
step-by-step match with galore-torch, its state layout and defaults, its worked memory formula."""

from __future__ import annotations

import harness
import pytest
import torch
from harness import (
    REF_SHAPES,
    assert_projected_defaults,
    make_params,
    reference_groups,
    reference_module,
    run,
    run_beside,
    saved_projected_state,
    state_bytes_of,
)

from optimizers.galore import GaLoreAdamW

#: How the contract runs "galore" (test_contract.py).
CONTRACT = harness.Case(
    reduces=harness.PROJECTED_ADAM, variants=harness.SVD_FAMILY, loss_lr=0.5, loss_steps=50
)


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "right", "left"])
def test_matches_galore_torch_step_by_step_across_refreshes(proj_type: str) -> None:
    ref_cls = reference_module("galore_torch", "adamw").AdamW
    ours, ref = make_params(REF_SHAPES), make_params(REF_SHAPES)
    kw = {"scale": 0.25, "proj_type": proj_type}
    opt = GaLoreAdamW(reference_groups(ours, basis="svd", **kw), lr=1e-2, weight_decay=0.05)
    ref_opt = ref_cls(reference_groups(ref, **kw), lr=1e-2, weight_decay=0.05, no_deprecation_warning=True)
    run_beside(opt, ours, ref_opt, ref, 8)  # refreshes at steps 1, 4, 7
    assert opt.refresh_count == 2 * 3


def test_full_projection_matches_galore_torch_and_counts_its_bytes() -> None:
    """proj_type='full' (r x r core): the packed basis [P_L^T | P_R] is one tensor.

    At a refresh the core U^T G V^T is diagonal up to rounding noise, which Adam's normalisation
    amplifies to O(1) when eps is far below it (both implementations, differently): with eps
    above the noise the two match to 1e-5 like the other projection types.
    """
    ref_cls = reference_module("galore_torch", "adamw").AdamW
    ours, ref = make_params(REF_SHAPES), make_params(REF_SHAPES)
    kw = {"scale": 0.25, "proj_type": "full"}
    opt = GaLoreAdamW(reference_groups(ours, basis="svd", **kw), lr=1e-2, eps=1e-3)
    ref_opt = ref_cls(reference_groups(ref, **kw), lr=1e-2, eps=1e-3, no_deprecation_warning=True)
    run_beside(opt, ours, ref_opt, ref, 5)
    assert opt.state[ours[0]]["basis"].shape == (4, 24 + 16)
    for group in opt.param_groups:
        for p in group["params"]:
            assert state_bytes_of(opt, p) == GaLoreAdamW.state_bytes(tuple(p.shape), group, torch.float32)
    assert GaLoreAdamW.state_bytes((24, 16), {"rank": 4, **kw}, torch.float32) == 4 * (2 * 4 * 4 + 4 * 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("basis", ["randomized_svd", "random"])
def test_state_bytes_formula_worked_values(dtype: torch.dtype, basis: str) -> None:
    s = dtype.itemsize
    # Right side (24 x 16, k = 4): 2 s m k + s k n; left (12 x 20): 2 s k n + s m k; dense: 2 s numel.
    basis_on = basis != "random"
    assert GaLoreAdamW.state_bytes((24, 16), {"rank": 4, "basis": basis}, dtype) == s * (
        2 * 24 * 4 + basis_on * 4 * 16
    )
    assert GaLoreAdamW.state_bytes((12, 20), {"rank": 4, "basis": basis}, dtype) == s * (
        2 * 4 * 20 + basis_on * 12 * 4
    )
    assert GaLoreAdamW.state_bytes((7,), {}, dtype) == 2 * 7 * s
    assert GaLoreAdamW.state_bytes((12, 20), {"lr": 0.1}, dtype) == 2 * 240 * s


def test_state_dict_is_weights_only_loadable_and_plain() -> None:
    params = make_params(REF_SHAPES)
    st = saved_projected_state(GaLoreAdamW(reference_groups(params), lr=1e-2), params)
    assert set(st) == {"step", "refresh", "seed", "exp_avg", "exp_avg_sq", "basis"}
    assert st["basis"].dtype == torch.float32 and st["exp_avg"].shape == (24, 4)


def test_groups_record_eligibility_and_defaults() -> None:
    assert_projected_defaults(GaLoreAdamW(reference_groups(make_params(REF_SHAPES)), lr=1e-2))


def test_large_gradient_zero_only_at_sampled_entries_still_steps() -> None:
    """Zero detection samples large gradients first: a gradient that is zero at every sampled
    entry but not elsewhere must still step, and an all-zero one must not."""
    w = torch.nn.Parameter(torch.zeros(128, 96))  # 12288 entries: sampled, every 48th entry
    opt = GaLoreAdamW([{"params": [w], "rank": 4}], lr=1e-2)
    w.grad = torch.zeros_like(w)
    opt.step()
    assert opt.state[w]["step"] == 0 and opt.refresh_count == 0
    g = torch.randn(128, 96, generator=torch.Generator().manual_seed(0))
    g.view(-1)[:: w.numel() // 256] = 0.0  # exactly the sampled entries
    w.grad = g
    opt.step()
    assert opt.state[w]["step"] == 1 and opt.refresh_count == 1 and w.detach().abs().sum() > 0


def test_add_param_group_later_is_configured_too() -> None:
    params = make_params(REF_SHAPES)
    opt = GaLoreAdamW([{"params": params[2:]}], lr=1e-2, basis="svd", update_proj_gap=7)
    opt.add_param_group({"params": params[:2], "rank": 3})
    group = opt.param_groups[-1]
    assert group["project"] is True and group["basis"] == "svd" and group["update_proj_gap"] == 7
    assert group["lr"] == 1e-2 and group["scale"] == 1.0
    run(opt, params, 0, 2)
    assert opt.state[params[0]]["exp_avg"].shape == (24, 3)

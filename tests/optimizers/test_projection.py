"""Claims about optimizers.projection: bases, sides, randomized SVD quality, regenerable random maps."""

from __future__ import annotations

import warnings

import pytest
import torch
from harness import reference_module

from optimizers import projection as proj


def _low_rank_plus_noise(m: int, n: int, rank: int, noise: float, seed: int = 0) -> torch.Tensor:
    """A matrix with `rank` strong directions (decaying) plus small Gaussian noise."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, rank, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(n, rank, generator=gen))[0]
    s = torch.logspace(0, -1, rank)
    return (u * s) @ v.t() + noise * torch.randn(m, n, generator=gen)


def _energy(g: torch.Tensor, basis: torch.Tensor, side: str) -> float:
    """||proj(G)||^2 / ||G||^2 for an orthonormal basis."""
    return float(proj.project(g, basis, side).norm() ** 2 / g.norm() ** 2)


@pytest.mark.parametrize("method", ["svd", "randomized_svd", "identity"])
@pytest.mark.parametrize("shape", [(40, 24), (24, 40)])
def test_bases_are_orthonormal(method: str, shape: tuple[int, int]) -> None:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    r = 6
    for side in ("left", "right"):
        p = proj.compute_basis(g, r, side, method)
        assert p.dtype == torch.float32 and p.shape == proj.basis_shape(shape, r, side, method)
        gram = p.t() @ p if side == "left" else p @ p.t()
        torch.testing.assert_close(gram, torch.eye(r), atol=1e-5, rtol=0)
    full = proj.compute_basis(g, r, "full", method)
    m = shape[0]
    for part in (full[:, :m], full[:, m:]):
        torch.testing.assert_close(part @ part.t(), torch.eye(r), atol=1e-5, rtol=0)


def test_side_rule_matches_galore_torch() -> None:
    """std: right if m >= n else left; reverse_std the opposite; right/left/full fixed."""
    assert proj.choose_side((8, 8), "std") == "right"
    assert proj.choose_side((9, 8), "std") == "right"
    assert proj.choose_side((8, 9), "std") == "left"
    assert proj.choose_side((9, 8), "reverse_std") == "left"
    assert proj.choose_side((8, 9), "reverse_std") == "right"
    for t in ("left", "right", "full"):
        assert proj.choose_side((8, 9), t) == t
    with pytest.raises(ValueError, match="proj_type"):
        proj.choose_side((8, 9), "bogus")
    # Shapes: right R = G P^T is m x r, left R = P^T G is r x n, full r x r.
    assert proj.low_rank_shape((30, 20), 4, "right") == (30, 4)
    assert proj.low_rank_shape((20, 30), 4, "left") == (4, 30)
    assert proj.low_rank_shape((20, 30), 4, "full") == (4, 4)
    assert proj.basis_shape((20, 30), 4, "full") == (4, 50)


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "right", "left", "full"])
@pytest.mark.parametrize("shape", [(30, 20), (20, 30)])
def test_svd_projection_equals_galore_torch(proj_type: str, shape: tuple[int, int]) -> None:
    GaLoreProjector = reference_module("galore_torch", "galore_projector").GaLoreProjector  # noqa: N806

    g = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    ref = GaLoreProjector(5, update_proj_gap=10, scale=1.0, proj_type=proj_type)
    r_ref = ref.project(g, 0)
    side = proj.choose_side(shape, proj_type)
    basis = proj.compute_basis(g, 5, side, "svd")
    r_ours = proj.project(g, basis, side)
    torch.testing.assert_close(r_ours, r_ref, atol=1e-5, rtol=1e-5)
    n_low = torch.randn(r_ours.shape, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        proj.project_back(n_low, basis, side, m=shape[0]), ref.project_back(n_low), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("side", ["right", "left"])
def test_randomized_svd_captures_exact_energy(side: str) -> None:
    """Within 1% of the exact SVD's captured energy on a low-rank-plus-noise matrix."""
    g = _low_rank_plus_noise(300, 200, rank=20, noise=0.002)
    r = 16
    exact = _energy(g, proj.compute_basis(g, r, side, "svd"), side)
    approx = _energy(g, proj.compute_basis(g, r, side, "randomized_svd", seed=5), side)
    assert exact > 0.5
    assert approx >= 0.99 * exact


def test_randomized_svd_warm_start_tracks_a_drifting_subspace() -> None:
    g0 = _low_rank_plus_noise(200, 120, rank=12, noise=0.01, seed=0)
    g1 = g0 + 0.05 * _low_rank_plus_noise(200, 120, rank=12, noise=0.01, seed=1)
    prev = proj.compute_basis(g0, 10, "right", "svd")
    warm = proj.compute_basis(g1, 10, "right", "randomized_svd", prev, power_iters=0)
    exact = _energy(g1, proj.compute_basis(g1, 10, "right", "svd"), "right")
    assert _energy(g1, warm, "right") >= 0.99 * exact


def test_randomized_svd_is_reproducible_from_seed_and_refresh() -> None:
    g = torch.randn(60, 40, generator=torch.Generator().manual_seed(4))
    a = proj.compute_basis(g, 5, "left", "randomized_svd", seed=9, refresh=3)
    b = proj.compute_basis(g, 5, "left", "randomized_svd", seed=9, refresh=3)
    assert torch.equal(a, b)


def test_random_basis_regenerable_from_seed_and_refresh() -> None:
    shape = (48, 32)
    a = proj.random_basis(shape, 8, "right", seed=11, refresh=2)
    b = proj.random_basis(shape, 8, "right", seed=11, refresh=2)
    c = proj.random_basis(shape, 8, "right", seed=11, refresh=3)
    d = proj.random_basis(shape, 8, "right", seed=12, refresh=2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)
    assert a.shape == (8, 32)
    # Entries N(0, 1/r): variance ~ 1/8.
    big = proj.random_basis((4000, 400), 8, "right", seed=0, refresh=1)
    assert abs(float(big.var()) * 8 - 1.0) < 0.05
    # compute_basis("random") is the same draw and ignores G's values (so it cannot fail on them).
    g = torch.full(shape, float("nan"))
    assert torch.equal(proj.compute_basis(g, 8, "right", "random", seed=11, refresh=2), a)
    assert proj.random_basis(shape, 8, "left", seed=11, refresh=2).shape == (48, 8)


def test_mix_seed_is_deterministic_and_spreads() -> None:
    seeds = {proj.mix_seed(0, k) for k in range(1000)}
    assert len(seeds) == 1000
    assert proj.mix_seed(3, 4) == proj.mix_seed(3, 4)
    assert all(0 <= s < 2**63 for s in seeds)


def test_rank_is_clamped_for_decompositions() -> None:
    g = torch.randn(10, 6, generator=torch.Generator().manual_seed(0))
    assert proj.compute_basis(g, 50, "right", "svd").shape == (6, 6)
    assert proj.compute_basis(g, 50, "right", "randomized_svd").shape == (6, 6)
    assert proj.effective_rank((10, 6), 50, "random") == 50


def test_non_finite_gradient_keeps_previous_basis_and_warns_once() -> None:
    proj.reset_failure_warning()
    g = torch.randn(20, 12, generator=torch.Generator().manual_seed(0))
    prev = proj.compute_basis(g, 4, "right", "svd")
    bad = g.clone()
    bad[3, 2] = float("inf")
    stats = proj.RefreshStats()
    before = proj.failed_refreshes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for method in ("svd", "randomized_svd", "svd"):
            assert proj.compute_basis(bad, 4, "right", method, prev, stats=stats) is prev
    assert len([w for w in caught if "basis refresh failed" in str(w.message)]) == 1
    assert stats.failed == 3 and stats.count == 0
    assert proj.failed_refreshes() == before + 3
    assert proj.compute_basis(bad, 4, "right", "svd", None) is None


def test_decomposition_error_keeps_previous_basis(monkeypatch: pytest.MonkeyPatch) -> None:
    proj.reset_failure_warning()

    def boom(*args, **kwargs):
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(torch.linalg, "svd", boom)
    prev = torch.eye(3, 5)
    stats = proj.RefreshStats()
    with pytest.warns(RuntimeWarning, match="did not converge"):
        assert proj.compute_basis(torch.ones(7, 5), 3, "right", "svd", prev, stats=stats) is prev
    assert stats.failed == 1


def test_bf16_gradient_is_decomposed_in_fp32() -> None:
    g = torch.randn(40, 24, generator=torch.Generator().manual_seed(0))
    a = proj.compute_basis(g.bfloat16(), 4, "right", "svd")
    b = proj.compute_basis(g.bfloat16().float(), 4, "right", "svd")
    assert a.dtype == torch.float32 and torch.equal(a, b)  # bitwise: the same SVD of the same fp32 copy


@pytest.mark.parametrize("power_iters", [0, 1, 2])
def test_randomized_svd_is_orthonormal_for_rank_deficient_and_zero_gradients(power_iters: int) -> None:
    """Zero pivots in the LU normalisation fall back to QR: still an orthonormal basis, no failure."""
    gen = torch.Generator().manual_seed(0)
    low = torch.randn(40, 2, generator=gen) @ torch.randn(2, 30, generator=gen)
    stats = proj.RefreshStats()
    for g in (low, torch.zeros(40, 30)):
        for side in ("left", "right"):
            p = proj.compute_basis(g, 6, side, "randomized_svd", power_iters=power_iters, stats=stats)
            gram = p.t() @ p if side == "left" else p @ p.t()
            torch.testing.assert_close(gram, torch.eye(6), atol=1e-5, rtol=0)
    assert _energy(low, proj.compute_basis(low, 6, "left", "randomized_svd"), "left") > 0.9999
    assert stats.failed == 0


@pytest.mark.parametrize("decay", [0.5, 1.0, 2.0, 3.0])
def test_randomized_svd_r_factor_path_matches_formed_q(monkeypatch: pytest.MonkeyPatch, decay: float) -> None:
    """Rayleigh-Ritz through W's R factor (A W R^{-1}) and through W's formed Q capture the same
    energy on power-law spectra, flat (where q = 1 itself falls short of exact) to steep."""
    gen = torch.Generator().manual_seed(3)
    m, n, r = 200, 120, 24
    a = torch.linalg.qr(torch.randn(m, n, generator=gen))[0]
    b = torch.linalg.qr(torch.randn(n, n, generator=gen))[0]
    g = (a * (1.0 + torch.arange(n)) ** -decay) @ b.t()
    exact = _energy(g, proj.compute_basis(g, r, "left", "svd"), "left")
    energies = {}
    for name, pivot in (("r_factor", 0.0), ("formed_q", 1.0)):
        monkeypatch.setattr(proj, "_MIN_PIVOT", pivot)
        basis = proj.compute_basis(g, r, "left", "randomized_svd", seed=2)
        torch.testing.assert_close(basis.t() @ basis, torch.eye(r), atol=1e-5, rtol=0)
        energies[name] = _energy(g, basis, "left")
    assert energies["formed_q"] >= (0.95 if decay < 1 else 0.999) * exact
    assert abs(energies["r_factor"] - energies["formed_q"]) <= 1e-4 * exact

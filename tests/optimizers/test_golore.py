"""Claims about optimizers.golore.GoLoreAdamW (He et al. 2024) beyond the contract (test_contract.py):
the random basis is orthonormal and uniform, rand_ratio 1 is GaLore bitwise, the switch happens at
rand_ratio of the run and frees the stored basis, the state formula before and after it."""

from __future__ import annotations

import harness
import pytest
import torch
from harness import GAP, REF_SHAPES, make_params, reference_groups, run, state_bytes_of

from optimizers import projection as proj
from optimizers.galore import GaLoreAdamW
from optimizers.golore import GoLoreAdamW, orthonormal_basis, switched

#: How the contract runs "golore" (test_contract.py): over 3 GAP + 1 = 10 steps with rand_ratio 0.8
#: the refreshes at steps 1, 4, 7 compute SVD bases and the one at step 10 (t = 9 >= 8) switches to
#: a random orthonormal basis, so determinism and the resume (split at 5) cross the switch.
CONTRACT = harness.Case(
    reduces=harness.PROJECTED_ADAM,
    kwargs={"rand_ratio": 0.8},
    variants={"randomized_svd": harness.Variant("randomized_svd"), "svd": harness.Variant("svd")},
    steps=3 * GAP + 1,
    loss_lr=0.5,
    loss_steps=300,
)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("shape", [(24, 16), (12, 20), (64, 48)])
def test_random_basis_is_orthonormal(shape: tuple[int, int], side: str) -> None:
    p = orthonormal_basis(shape, 8, side, generator_seed=123)
    k = min(8, *shape)
    assert p.shape == ((k, shape[1]) if side == "right" else (shape[0], k))
    gram = p @ p.t() if side == "right" else p.t() @ p
    assert float((gram - torch.eye(k)).abs().max()) <= 1e-6
    assert torch.equal(p, orthonormal_basis(shape, 8, side, generator_seed=123))  # regenerated, same
    assert not torch.equal(p, orthonormal_basis(shape, 8, side, generator_seed=124))


def test_random_basis_is_uniform_on_the_stiefel_manifold() -> None:
    """Haar-distributed rows: E[P^T P] = (k / n) I (averaged over draws, to sampling error), and the
    sign fix makes every entry's mean 0 (QR alone would bias the diagonal)."""
    n, k, draws = 6, 2, 4000
    ps = torch.stack([orthonormal_basis((10, n), k, "right", generator_seed=s) for s in range(draws)])
    proj_mean = torch.einsum("dki,dkj->ij", ps, ps) / draws
    assert float((proj_mean - (k / n) * torch.eye(n)).abs().max()) < 0.03
    assert float(ps.mean(0).abs().max()) < 0.05


@pytest.mark.parametrize("basis", ["svd", "randomized_svd"])
def test_rand_ratio_one_is_galore_bitwise(basis: str) -> None:
    """Bitwise: GoLore with rand_ratio 1 never switches, so it runs GaLore's own step code."""
    ours, ref = make_params(REF_SHAPES), make_params(REF_SHAPES)
    kw = {"scale": 0.25, "basis": basis}
    opt = GoLoreAdamW(
        reference_groups(ours, **kw), lr=1e-2, weight_decay=0.05, rand_ratio=1.0, total_steps=12
    )
    ref_opt = GaLoreAdamW(reference_groups(ref, **kw), lr=1e-2, weight_decay=0.05)
    run(opt, ours, 0, 12)
    run(ref_opt, ref, 0, 12)
    harness.assert_same(ours, ref, what="rand_ratio=1 vs GaLore")
    for p, q in zip(ours, ref):
        harness.assert_same_state(opt.state[p], ref_opt.state[q])


def test_switch_at_rand_ratio_frees_the_basis_and_draws_orthonormal_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Total 12 steps, rand_ratio 0.5, gap 3: SVD at steps 1 and 4 (t = 0, 3), random from the
    refresh at step 7 (t = 6 >= 6): the stored basis is gone, the state is the moments only, and
    every step's basis is orthonormal and fixed between refreshes."""
    params = make_params(REF_SHAPES)
    opt = GoLoreAdamW(reference_groups(params), lr=1e-2, rand_ratio=0.5, total_steps=12)
    w = params[0]
    group = opt.param_groups[0]
    run(opt, params, 0, 6)
    assert opt.state[w]["basis"].shape == (4, 16) and opt.state[w]["refresh"] == 2
    before = GoLoreAdamW.state_bytes((24, 16), group, torch.float32)
    assert state_bytes_of(opt, w) == before == 4 * (2 * 24 * 4 + 4 * 16)
    run(opt, params, 6, 7)
    st = opt.state[w]
    assert st["basis"].numel() == 0 and st["refresh"] == 3
    assert state_bytes_of(opt, w) == before - 4 * 4 * 16  # the formula is the SVD phase's peak
    drawn = orthonormal_basis((24, 16), 4, "right", proj.mix_seed(st["seed"], 3))
    assert float((drawn @ drawn.t() - torch.eye(4)).abs().max()) <= 1e-6
    # Between refreshes the same random basis is regenerated: R = G P^T with that P.
    low = []
    orig = proj.project

    def spy(grad, basis, side):
        low.append(basis.clone())
        return orig(grad, basis, side)

    monkeypatch.setattr(proj, "project", spy)
    run(opt, params, 7, 9)
    assert torch.equal(low[0], drawn) and torch.equal(low[2], drawn)  # params[0] at steps 8 and 9
    assert switched(6, group) and not switched(5, group)


def test_rand_ratio_zero_never_stores_a_basis() -> None:
    params = make_params(REF_SHAPES)
    opt = GoLoreAdamW(reference_groups(params), lr=1e-2, rand_ratio=0.0)
    run(opt, params, 0, 2)
    group = opt.param_groups[0]
    assert opt.state[params[0]]["basis"].numel() == 0
    assert state_bytes_of(opt, params[0]) == GoLoreAdamW.state_bytes((24, 16), group, torch.float32)
    assert GoLoreAdamW.state_bytes((24, 16), {"rank": 4, "rand_ratio": 0.0}, torch.float32) == 4 * 2 * 24 * 4


def test_options_are_validated() -> None:
    params = make_params(REF_SHAPES)
    with pytest.raises(ValueError, match="total_steps"):
        GoLoreAdamW(reference_groups(params), rand_ratio=0.5)
    with pytest.raises(ValueError, match="rand_ratio"):
        GoLoreAdamW(reference_groups(params), rand_ratio=1.5, total_steps=10)
    with pytest.raises(ValueError, match="full"):
        GoLoreAdamW(reference_groups(params, proj_type="full"), total_steps=10)
    GoLoreAdamW(reference_groups(params, proj_type="full"), rand_ratio=1.0)  # GaLore's full projection

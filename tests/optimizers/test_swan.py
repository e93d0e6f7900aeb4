"""Claims about optimizers.swan.SWAN beyond the contract (test_contract.py): GradNorm standardises
rows, GradWhitening by Newton-Schulz equals the exact (G G^T)^{-1/2} G (eigendecomposition) on a
well-conditioned matrix, a step equals a dense transcription of the paper's rule, the dummy step,
the AdamW part and stateless matrices."""

from __future__ import annotations

import harness
import matrix_checks
import pytest
import torch
from harness import make_params, set_grads

import optimizers
from optimizers.swan import grad_norm, grad_whitening

#: How the contract runs "swan": normalisation and whitening are not an Adam step.
CONTRACT = harness.Case(
    reduces="does not reduce: hidden matrices take the whitened, row-standardised gradient, not Adam",
    kwargs={"adam_lr": 0.05},  # the AdamW part (the bias) at its own LR in the loss check
    loss_lr=0.2,
    loss_steps=40,
    # GradNorm centres every row, so the update has zero row mean: W's component along the
    # all-ones input is never learned, and the least-squares loss stops at ~5.4% of its start.
    loss_below=0.06,
    state_keys=("step",),
)


def _exact_whitening(x: torch.Tensor) -> torch.Tensor:
    """(X X^T)^{-1/2} X (wide X) or X (X^T X)^{-1/2} (tall) by a float64 eigendecomposition."""
    x = x.double()
    wide = x.shape[0] <= x.shape[1]
    gram = x @ x.T if wide else x.T @ x
    evals, evecs = torch.linalg.eigh(gram)
    inv_sqrt = evecs @ torch.diag(evals.rsqrt()) @ evecs.T
    return inv_sqrt @ x if wide else x @ inv_sqrt


def _conditioned(m: int, n: int, seed: int) -> torch.Tensor:
    """An m x n matrix with singular values in [0.5, 1.5] (condition number 3)."""
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=gen))
    return u @ torch.diag(torch.linspace(0.5, 1.5, k)) @ v.T


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
def test_newton_schulz_whitening_equals_eigendecomposition(shape: tuple[int, int]) -> None:
    """GradWhitening's Newton-Schulz result is the exact inverse-square-root whitening to 1e-5
    (condition number 3, 10 steps), and its singular values are 1 (an orthogonal polar factor)."""
    x = _conditioned(*shape, seed=sum(shape))
    got = grad_whitening(x, steps=10)
    want = _exact_whitening(x)
    assert float((got.double() - want).abs().max()) < 1e-5
    assert torch.allclose(
        torch.linalg.svdvals(got.double()), torch.ones(min(shape), dtype=torch.float64), atol=1e-5
    )


def test_grad_norm_standardises_rows() -> None:
    """Every row of GradNorm(G) has mean 0 and (population) standard deviation 1."""
    g = 3.0 * torch.randn(12, 50, generator=torch.Generator().manual_seed(0)) + 2.0
    x = grad_norm(g, 1e-8)
    assert float(x.mean(dim=1).abs().max()) < 1e-5
    assert float((x.std(dim=1, correction=0) - 1).abs().max()) < 1e-5


@pytest.mark.parametrize("rescale", [True, False])
def test_step_equals_the_paper_rule(rescale: bool) -> None:
    """One SWAN step on a hidden matrix: W <- W (1 - eta lambda) - eta D with D the exact whitening
    of the row-standardised gradient (rescaled to its norm when ``rescale``), to 1e-5 relative
    (30 Newton-Schulz steps: the random gradient is not well conditioned)."""
    w = torch.nn.Parameter(0.02 * torch.randn(16, 40, generator=torch.Generator().manual_seed(1)))
    g = torch.randn(16, 40, generator=torch.Generator().manual_seed(2))
    w0 = w.detach().clone()
    opt = optimizers.build_optimizer(
        "swan", [{"params": [w], **optimizers.method_spec("swan").matrix_group("hidden")}],
        lr=0.01, weight_decay=0.1, ns_steps=30, rescale=rescale,
    )  # fmt: skip
    w.grad = g
    opt.step()
    mean, std = g.double().mean(1, keepdim=True), g.double().std(1, correction=0, keepdim=True)
    x = (g.double() - mean) / std
    d = _exact_whitening(x)
    if rescale:
        d = d * x.norm() / d.norm()
    want = w0.double() * (1 - 0.01 * 0.1) - 0.01 * d
    moved = float((want - w0.double()).abs().max())
    assert float((w.detach().double() - want).abs().max()) < 1e-5 * moved


def test_matrices_are_stateless() -> None:
    """After steps, a hidden matrix's state is the int step only (0 bytes, the formula's)."""
    params = make_params()
    opt = matrix_checks.build("swan", params)
    for t in range(3):
        set_grads(params, t)
        opt.step()
    assert opt.state[params[0]] == {"step": 3}
    spec = optimizers.method_spec("swan")
    assert spec.state_bytes((24, 16), opt.param_groups[0], torch.float32) == 0


def test_groups_hidden_only() -> None:
    matrix_checks.check_groups("swan", ["hidden"])


def test_zero_gradient_dummy_step() -> None:
    matrix_checks.check_dummy_step("swan")


def test_adamw_part_is_torch_adamw() -> None:
    matrix_checks.check_adamw_part("swan")


def test_rejects_vectors_and_unknown_options() -> None:
    matrix_checks.check_rejects_vectors_and_unknown_options("swan")

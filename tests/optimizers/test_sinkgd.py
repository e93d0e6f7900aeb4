"""Claims about optimizers.sinkgd.SinkGD beyond the contract (test_contract.py): the alternating
normalisation reaches row norms sqrt(n) and column norms sqrt(m), a step equals a dense
transcription of the rule, the dummy step, the AdamW part and stateless matrices."""

from __future__ import annotations

import math

import harness
import matrix_checks
import pytest
import torch

import optimizers
from optimizers.sinkgd import sinkhorn_normalise

#: How the contract runs "sinkgd": the normalised gradient is not an Adam step.
CONTRACT = harness.Case(
    reduces="does not reduce: hidden matrices take the row/column-normalised gradient, not Adam",
    kwargs={"adam_lr": 0.05},  # the AdamW part (the bias) at its own LR in the loss check
    loss_lr=0.1,
    loss_steps=40,
    state_keys=("step",),
)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (64, 48)])
def test_rows_sqrt_n_and_columns_sqrt_m(shape: tuple[int, int]) -> None:
    """With enough iterations (20) every row has l2 norm sqrt(n) and every column sqrt(m) to 1e-3
    (relative), from a gradient whose rows and columns have very different scales."""
    m, n = shape
    gen = torch.Generator().manual_seed(m + n)
    g = torch.randn(m, n, generator=gen) * torch.rand(m, 1, generator=gen).add(0.1) * 10
    g = g * torch.rand(1, n, generator=gen).add(0.1)
    x = sinkhorn_normalise(g, 20)
    assert float((x.norm(dim=1) / math.sqrt(n) - 1).abs().max()) < 1e-3
    assert float((x.norm(dim=0) / math.sqrt(m) - 1).abs().max()) < 1e-3


def test_step_equals_the_rule() -> None:
    """One step: W <- W (1 - eta lambda) - eta SR_L(G), SR_L transcribed in float64 (L = 5)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(0.02 * torch.randn(24, 40, generator=gen))
    g = torch.randn(24, 40, generator=gen)
    w0 = w.detach().clone()
    spec = optimizers.method_spec("sinkgd")
    opt = optimizers.build_optimizer(
        "sinkgd", [{"params": [w], **spec.matrix_group("hidden")}], lr=0.01, weight_decay=0.1
    )
    w.grad = g
    opt.step()
    x = g.double()
    for _ in range(5):
        x = x / x.norm(dim=1, keepdim=True) * math.sqrt(40)
        x = x / x.norm(dim=0, keepdim=True) * math.sqrt(24)
    want = w0.double() * (1 - 0.01 * 0.1) - 0.01 * x
    assert float((w.detach().double() - want).abs().max()) < 1e-5 * float((want - w0.double()).abs().max())


def test_matrices_are_stateless() -> None:
    params = harness.make_params()
    opt = matrix_checks.build("sinkgd", params)
    harness.run(opt, params, 0, 3)
    assert opt.state[params[0]] == {"step": 3} and opt.state[params[1]] == {"step": 3}


def test_groups_hidden_only() -> None:
    matrix_checks.check_groups("sinkgd", ["hidden"])


def test_zero_gradient_dummy_step() -> None:
    matrix_checks.check_dummy_step("sinkgd")


def test_adamw_part_is_torch_adamw() -> None:
    matrix_checks.check_adamw_part("sinkgd")


def test_rejects_vectors_and_unknown_options() -> None:
    matrix_checks.check_rejects_vectors_and_unknown_options("sinkgd")

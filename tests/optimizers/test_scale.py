"""Claims about optimizers.scale.SCALE beyond the contract (test_contract.py): which axis it
normalises (each row of a torch (out x in) weight, each column of the embedding: the paper's
"column-wise" along the output dimension), momentum on the head only, a step equals the
reference code's rule, the dummy step, the AdamW part and the state formula."""

from __future__ import annotations

import harness
import matrix_checks
import pytest
import torch

import optimizers
from optimizers.scale import unit_rms

#: How the contract runs "scale": normalised SGD is not an Adam step.
CONTRACT = harness.Case(
    reduces="does not reduce: matrices take the normalised gradient (head: of its momentum), not Adam",
    kwargs={"adam_lr": 0.05},  # the AdamW part (the bias) at its own LR in the loss check
    loss_lr=0.1,
    loss_steps=40,
    state_keys=("step",),
)


def _one_step(
    role: str, g: torch.Tensor, steps: int = 1, momentum: float = 0.9
) -> tuple[torch.Tensor, torch.Tensor]:
    """(update direction D = (W_before - W_after) / eta, the momentum state) after `steps` steps of
    gradient `g` on a weight in a matrix group of `role`, eta = 1, no decay."""
    w = torch.nn.Parameter(torch.zeros_like(g))
    spec = optimizers.method_spec("scale")
    opt = optimizers.build_optimizer(
        "scale", [{"params": [w], **spec.matrix_group(role)}], lr=1.0, momentum=momentum
    )
    for _ in range(steps):
        before = w.detach().clone()
        w.grad = g.clone()
        opt.step()
    return before - w.detach(), opt.state[w].get("moment1")


@pytest.mark.parametrize("role", ["hidden", "head"])
def test_linear_weights_rows_have_unit_rms(role: str) -> None:
    """A hidden or head weight (out x in): every ROW of the update (an output neuron, over the
    inputs) has RMS 1; columns do not."""
    g = torch.randn(12, 30, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 5, 30)
    d, _ = _one_step(role, g)
    assert torch.allclose(d.square().mean(dim=1), torch.ones(12), atol=1e-5)
    assert not torch.allclose(d.square().mean(dim=0), torch.ones(30), atol=1e-2)


def test_embedding_columns_have_unit_rms() -> None:
    """The embedding (vocab x hidden): every COLUMN of the update (one hidden unit, over the vocab)
    has RMS 1, as the reference code's col_dim = 0 for embed_tokens."""
    g = torch.randn(40, 8, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 5, 40)[:, None]
    d, _ = _one_step("embedding", g)
    assert torch.allclose(d.square().mean(dim=0), torch.ones(8), atol=1e-5)


def test_head_momentum_and_reference_rule() -> None:
    """The head keeps M <- beta M + (1 - beta) G (``moment1``); after two steps of the same G the
    update is M / RMS_rows(M), a positive multiple of G's row-normalised form; the other roles keep
    no momentum."""
    g = torch.randn(6, 10, generator=torch.Generator().manual_seed(2))
    d, m = _one_step("head", g, steps=2, momentum=0.9)
    want_m = 0.1 * g * 0.9 + 0.1 * g  # M_1 = 0.1 G, M_2 = 0.9 M_1 + 0.1 G
    assert torch.allclose(m, want_m, atol=1e-7)
    assert torch.allclose(d, unit_rms(want_m, dim=1), atol=1e-5)
    assert _one_step("hidden", g)[1] is None and _one_step("embedding", g)[1] is None


def test_state_formula() -> None:
    """s m n for the head's momentum, 0 for the other matrices, 2 s numel (AdamW) for vectors."""
    spec = optimizers.method_spec("scale")
    for role, want in (("head", 64 * 48 * 2), ("hidden", 0), ("embedding", 0)):
        assert spec.state_bytes((64, 48), spec.matrix_group(role), torch.bfloat16) == want
    assert spec.state_bytes((48,), {}, torch.bfloat16) == 2 * 48 * 2


def test_adam_lr_is_the_vectors_learning_rate() -> None:
    """``adam_lr`` sets the AdamW groups' LR; the matrix groups keep ``lr``."""
    params = harness.make_params()
    opt = matrix_checks.build("scale", params, lr=1e-3, adam_lr=2e-2)
    assert {g["role"] if g["matrix"] else "adamw": g["lr"] for g in opt.param_groups} == {
        "hidden": 1e-3,
        "head": 1e-3,
        "adamw": 2e-2,
    }


def test_groups_every_matrix() -> None:
    """SCALE takes every matrix: the hidden ones and the 'dense' one as the head."""
    matrix_checks.check_groups("scale", ["hidden", "head"])
    spec = optimizers.method_spec("scale")
    assert spec.matrix_role(target=False, embedding=True, ndim=2) == "embedding"


def test_zero_gradient_dummy_step() -> None:
    matrix_checks.check_dummy_step("scale")


def test_adamw_part_is_torch_adamw() -> None:
    matrix_checks.check_adamw_part("scale")


def test_rejects_vectors_and_unknown_options() -> None:
    matrix_checks.check_rejects_vectors_and_unknown_options("scale")


def test_only_the_embedding_needs_the_whole_matrix() -> None:
    """Row normalisation is row-local, so under FSDP2 hidden weights and the head step on their
    row shards; the embedding's column norms need the whole matrix (an owner rank)."""
    spec = optimizers.method_spec("scale")
    assert [spec.steps_whole(spec.matrix_group(r)) for r in ("hidden", "head", "embedding")] == [
        False,
        False,
        True,
    ]
    muon = optimizers.method_spec("muon")
    assert muon.steps_whole(muon.matrix_group("hidden")) and not muon.steps_whole({})

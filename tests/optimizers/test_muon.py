"""Claims about optimizers.muon.Muon beyond the contract (test_contract.py): the rule equals
torch.optim.Muon (hidden matrices) plus torch.optim.AdamW (the rest) under every LR adjustment,
the dummy step, the groups, and state bytes (one momentum buffer per hidden matrix)."""

from __future__ import annotations

import harness
import matrix_checks
import pytest
import torch
from harness import make_params, set_grads

import optimizers

#: How the contract runs "muon": Newton-Schulz orthogonalisation is not an Adam step.
CONTRACT = harness.Case(
    reduces="does not reduce: hidden matrices take orthogonalised momentum, not Adam",
    variants={
        "match_rms_adamw": harness.Variant(),
        "original": harness.Variant(kwargs={"adjust_lr": "original"}),
    },
    # The AdamW part (the bias) at its own smaller LR; Muon's fixed-size orthogonal steps need a
    # large LR on this problem and settle faster with less momentum.
    kwargs={"adam_lr": 0.05, "momentum": 0.8},
    loss_lr=1.0,
    loss_steps=40,
    state_keys=("step",),
)


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_equals_torch_muon_plus_adamw(adjust: str, nesterov: bool) -> None:
    """Hidden matrices step as torch.optim.Muon (same lr, momentum, nesterov, NS coefficients and
    steps, weight decay, adjust_lr_fn), the others as torch.optim.AdamW: bitwise, 10 steps.
    Bitwise because ours is torch's single-tensor Muon op for op (the lerps, the bf16 Newton-Schulz
    matmuls on the same layouts, the decay, the add) and `adamw_step_` torch's AdamW path."""
    ours, ref = make_params(), make_params()
    kw = {"lr": 2e-2, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
    groups = harness.param_groups("muon", ours[:2], ours[2:3], ours[3:], weight_decay=0.1)
    opt = optimizers.build_optimizer("muon", groups, **kw, momentum=0.9, nesterov=nesterov, adjust_lr=adjust)
    muon = torch.optim.Muon(
        ref[:2], lr=2e-2, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust
    )
    adamw = torch.optim.AdamW(
        [{"params": ref[2:3], "weight_decay": 0.1}, {"params": ref[3:], "weight_decay": 0.0}],
        lr=2e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False,
    )  # fmt: skip
    for t in range(10):
        set_grads(ours, t)
        set_grads(ref, t)
        opt.step()
        muon.step()
        adamw.step()
        harness.assert_same(ours, ref, what=f"step {t + 1}")
    for p, q in zip(ours[:2], ref[:2]):
        assert torch.equal(opt.state[p]["momentum_buffer"], muon.state[q]["momentum_buffer"])


def test_groups_hidden_only() -> None:
    """Only the hidden (attention/MLP) matrices take Muon; embedding-like and head matrices AdamW."""
    matrix_checks.check_groups("muon", ["hidden"])
    spec = optimizers.method_spec("muon")
    assert spec.matrix_role(target=False, embedding=True, ndim=2) is None
    assert spec.matrix_role(target=True, embedding=False, ndim=1) is None


def test_state_formula() -> None:
    """s A B per hidden matrix (the momentum), AdamW's 2 s numel elsewhere."""
    spec = optimizers.method_spec("muon")
    assert spec.state_bytes((64, 48), {"matrix": True}, torch.bfloat16) == 64 * 48 * 2
    assert spec.state_bytes((64, 48), {}, torch.bfloat16) == 2 * 64 * 48 * 2


def test_zero_gradient_dummy_step() -> None:
    matrix_checks.check_dummy_step("muon")


def test_adamw_part_is_torch_adamw() -> None:
    matrix_checks.check_adamw_part("muon")


def test_rejects_vectors_and_unknown_options() -> None:
    matrix_checks.check_rejects_vectors_and_unknown_options("muon")
    with pytest.raises(ValueError, match="adjust_lr"):
        optimizers.build_optimizer("muon", [{"params": make_params()[:1], "matrix": True}], adjust_lr="x")

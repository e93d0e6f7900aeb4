"""The optimizer contract (DESIGN.md sections 4 and 7), for every method in `optimizers.METHODS`.

Each registered name is run through the same checks (harness.py): determinism, exact resume
across a refresh or reset through weights_only loading, state bytes equal the registry formula,
plain state and untouched param groups, loss goes down, reduce-to-AdamW under degenerate
settings, and, for projecting methods, the zero-gradient dummy step, the refresh schedule, a
failed refresh and group validation. `CASES` says how to run each method; a method registered
without a row fails `test_every_method_has_a_case`, so a new method must decide, among other
things, whether and how it reduces to AdamW.
"""

from __future__ import annotations

import pytest
import torch
from harness import (
    Case,
    Reduction,
    Variant,
    check_determinism,
    check_loss_goes_down,
    check_non_finite_gradient_keeps_basis,
    check_projected_groups_are_validated,
    check_reduces_to_adamw,
    check_refresh_schedule,
    check_resume,
    check_state_and_groups,
    check_state_bytes,
    check_zero_gradient_dummy_step,
)

import optimizers

# Identity basis at full rank, scale 1: the projection is exact, so the torch convention is
# torch.optim.AdamW; the reference convention differs from it only in where eps enters and in the
# order of weight decay (eta_t eta lambda |D| per step: ~1e-8 at lr 1e-3), so it is AdamW at eps 0.
_PROJECTED_ADAM = (
    Reduction(
        "torch_convention", {"lr": 1e-2, "eps": 1e-6}, {"adam_convention": "torch"}, "identity", steps=6
    ),
    Reduction(
        "torch_convention_decay",
        {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.1},
        {"adam_convention": "torch"},
        "identity",
        steps=6,
    ),
    Reduction(
        "reference_convention_eps0",
        {"lr": 1e-3, "eps": 0.0, "weight_decay": 0.01},
        {},
        "identity",
        steps=6,
        std=0.02,  # LLaMA's init scale, where the decay-order term stays far below the tolerance
    ),
)
_SVD_FAMILY = {
    "randomized_svd": Variant("randomized_svd"),
    "svd": Variant("svd"),
    "random": Variant("random"),
}
_ADAMW = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
# Spikes (x300 / x1000 on one entry every few steps) so that the clipping rules act.
_STABLE_SPAM_GRADS = {"seed": 1000, "growth": 0.0, "spike": (7, 3, 300.0)}
_SPAM_GRADS = {"seed": 2000, "growth": 0.0, "spike": (5, 2, 1000.0)}

CASES: dict[str, Case] = {
    "adamw": Case(reduces=(Reduction("registry_defaults", _ADAMW),)),
    "adamw_8bit": Case(
        # Tensors below min_8bit_size keep fp32 moments: bitsandbytes' fp32 AdamW is torch's.
        reduces=(Reduction("fp32_moments", _ADAMW, {"min_8bit_size": 10**9}),),
        variants={"8bit": Variant(kwargs={"min_8bit_size": 0}), "fp32_small": Variant()},
        state_keys=("step", "state1", "state2"),  # bitsandbytes' class, unchanged
    ),
    "stable_spam": Case(
        reduces=(
            Reduction(
                "features_off",
                _ADAMW,
                {"adaptive_clip": False, "norm_scaling": False, "reset_interval": 0, "total_steps": None},
            ),
        ),
        kwargs={"reset_interval": 5},  # resets at steps 5 and 10; annealed over 11 steps
        loss_lr=0.2,
        grads=_STABLE_SPAM_GRADS,
        split=4,
        steps=11,
    ),
    "spam": Case(
        reduces=(Reduction("features_off", _ADAMW, {"threshold": 0.0, "reset_interval": 0}),),
        kwargs={"reset_interval": 5, "warmup_steps": 3, "clip_delay": 1, "threshold": 50.0},
        grads=_SPAM_GRADS,
        split=4,
        steps=11,
        loss_steps=50,  # the re-warm after each reset slows it
    ),
    "galore": Case(reduces=_PROJECTED_ADAM, variants=_SVD_FAMILY, loss_lr=0.5, loss_steps=50),
    "galore_8bit": Case(
        # Moments below min_8bit_size stay fp32: then it is GaLore (torch convention, its default).
        reduces=(
            Reduction(
                "fp32_moments",
                {"lr": 1e-2, "eps": 1e-8, "weight_decay": 0.1},
                {"min_8bit_size": 10**9},
                "identity",
                steps=6,
            ),
        ),
        variants={"8bit": Variant(kwargs={"min_8bit_size": 0}), "fp32_small": Variant()},
        loss_lr=0.5,
        loss_steps=50,
    ),
    "fira": Case(
        # With the full basis the residual G - back(R) is exactly 0.
        reduces=_PROJECTED_ADAM,
        variants=_SVD_FAMILY,
        loss_lr=0.5,
    ),
    "apollo": Case(
        reduces="does not reduce: the update is the raw gradient scaled per channel by ||N_c|| / ||R_c||, "
        "not Adam's element-wise N, whatever the basis",
        variants={"mix": Variant(), "apollo_torch_stream": Variant(kwargs={"random_stream": "apollo_torch"})},
        loss_lr=0.8,
    ),
    "apollo_mini": Case(
        reduces="does not reduce: rank 1 and one tensor-wide scale of the raw gradient",
        variants={"mix": Variant(), "apollo_torch_stream": Variant(kwargs={"random_stream": "apollo_torch"})},
        loss_lr=1.0,
    ),
}

NAMES = sorted(optimizers.METHODS)
PROJECTED = [n for n in NAMES if optimizers.METHODS[n].projects]
REDUCTIONS = [
    pytest.param(n, r, id=f"{n}-{r.label}")
    for n in NAMES
    if n in CASES and not isinstance(CASES[n].reduces, str)
    for r in CASES[n].reduces
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _case(name: str) -> Case:
    if name not in CASES:
        pytest.fail(
            f"optimizer {name!r} is registered but has no row in tests/optimizers/test_contract.py CASES"
        )
    return CASES[name]


def _variants() -> list:
    return [
        pytest.param(n, v, id=f"{n}-{v}")
        for n in NAMES
        for v in (CASES[n].variants if n in CASES else ["default"])
    ]


@pytest.mark.parametrize("name", NAMES)
def test_every_method_has_a_case(name: str) -> None:
    """A registered method must say how the contract runs it and whether it reduces to AdamW."""
    case = _case(name)
    if isinstance(case.reduces, str):
        assert case.reduces.startswith("does not reduce: ") and len(case.reduces) > len("does not reduce: ")
    else:
        assert case.reduces and all(isinstance(r, Reduction) for r in case.reduces)
    assert case.variants


@pytest.mark.parametrize("name,variant", _variants())
def test_two_seeded_runs_are_bitwise_equal(name: str, variant: str) -> None:
    check_determinism(name, _case(name), variant)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,variant", _variants())
def test_resume_across_a_refresh_or_reset_is_bitwise_exact(
    name: str, variant: str, dtype: torch.dtype
) -> None:
    check_resume(name, _case(name), variant, dtype)


@pytest.mark.parametrize("name,variant", _variants())
def test_state_bytes_equal_the_registry_formula(name: str, variant: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        check_state_bytes(name, _case(name), variant, dtype)


@pytest.mark.parametrize("name,variant", _variants())
def test_state_is_plain_and_step_never_changes_param_groups(name: str, variant: str) -> None:
    check_state_and_groups(name, _case(name), variant)


@pytest.mark.parametrize("name", NAMES)
def test_loss_goes_down_on_least_squares(name: str) -> None:
    check_loss_goes_down(name, _case(name))


@pytest.mark.parametrize("name,reduction", REDUCTIONS)
def test_reduces_to_torch_adamw(name: str, reduction: Reduction) -> None:
    check_reduces_to_adamw(name, reduction, CASES[name].grads)


@pytest.mark.parametrize("name", PROJECTED)
def test_zero_gradient_dummy_step_computes_no_basis_and_keeps_the_schedule(name: str) -> None:
    check_zero_gradient_dummy_step(name, _case(name))


@pytest.mark.parametrize("name", PROJECTED)
def test_refresh_schedule_and_telemetry(name: str) -> None:
    for variant in _case(name).variants:
        check_refresh_schedule(name, _case(name), variant)


@pytest.mark.parametrize("name", PROJECTED)
def test_non_finite_gradient_keeps_the_previous_basis_with_one_warning(name: str) -> None:
    check_non_finite_gradient_keeps_basis(name, _case(name))


@pytest.mark.parametrize("name", PROJECTED)
def test_projected_groups_reject_vectors_and_unknown_options(name: str) -> None:
    check_projected_groups_are_validated(name)

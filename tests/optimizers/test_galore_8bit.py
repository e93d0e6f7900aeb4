"""Claims about optimizers.galore_8bit.GaLoreAdamW8bit (GaLore with bitsandbytes 8-bit moments, on
CPU) beyond the contract (test_contract.py): matches with bitsandbytes and galore-torch, the 8-bit
curve beside the fp32 one, state layout and the worked memory formula."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

pytest.importorskip("bitsandbytes")

import harness  # noqa: E402
from harness import (  # noqa: E402
    least_squares_losses,
    make_params,
    reference_groups,
    roundtrip,
    run,
    run_beside,
    state_bytes_of,
)

from optimizers.galore import GaLoreAdamW  # noqa: E402
from optimizers.galore_8bit import GaLoreAdamW8bit  # noqa: E402

# Tall (right side) and wide (left side) matrices plus a vector in a plain group. With rank 8 the
# low-rank moments are 80 x 8 and 8 x 300 (one full and one partial 256-entry block, or more).
SHAPES = [(80, 48), (40, 300), (300,)]

#: How the contract runs "galore_8bit" (test_contract.py).
CONTRACT = harness.Case(
    # Moments below min_8bit_size stay fp32: then it is GaLore (torch convention, its default).
    reduces=(
        harness.Reduction(
            "fp32_moments",
            {"lr": 1e-2, "eps": 1e-8, "weight_decay": 0.1},
            {"min_8bit_size": 10**9},
            "identity",
            steps=6,
        ),
    ),
    variants={"8bit": harness.Variant(kwargs={"min_8bit_size": 0}), "fp32_small": harness.Variant()},
    loss_lr=0.5,
    loss_steps=50,
)


def test_reduces_to_bitsandbytes_adamw8bit_with_identity_basis() -> None:
    """8-bit moments, identity basis, full rank: bitsandbytes' own AdamW8bit (blockwise, CPU)."""
    import bitsandbytes as bnb

    ours, ref = make_params(SHAPES), make_params(SHAPES)
    opt = GaLoreAdamW8bit(
        reference_groups(ours, rank=300, basis="identity"), lr=1e-2, weight_decay=0.1, min_8bit_size=0
    )
    ref_opt = bnb.optim.AdamW8bit(ref, lr=1e-2, weight_decay=0.1, min_8bit_size=0)
    run_beside(opt, ours, ref_opt, ref, 5)


@pytest.mark.parametrize("weight_decay,tol", [(0.0, 1e-5), (0.05, 1e-3)])
def test_matches_galore_torch_8bit_across_refreshes(
    monkeypatch: pytest.MonkeyPatch, weight_decay: float, tol: float
) -> None:
    """galore-torch's GaLoreAdamW8bit (its CUDA sync patched out so it runs on CPU), same 8-bit moments.

    Without weight decay the two agree to rounding. With it they differ by the decay order
    (galore-torch decays projected weights after the update, we before, as bitsandbytes and torch
    do): a relative difference of about eta lambda per step, hence the looser bound.
    """
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_cls = pytest.importorskip("galore_torch").GaLoreAdamW8bit
    ours, ref = make_params(SHAPES), make_params(SHAPES)
    kw = {"rank": 8, "scale": 0.25, "proj_type": "std"}
    opt = GaLoreAdamW8bit(
        reference_groups(ours, basis="svd", **kw), lr=1e-2, weight_decay=weight_decay, min_8bit_size=0
    )
    ref_opt = ref_cls(reference_groups(ref, **kw), lr=1e-2, weight_decay=weight_decay, min_8bit_size=0)
    run_beside(opt, ours, ref_opt, ref, 5, tol=tol)  # refreshes at steps 1 and 4
    # Same quantised moments as the reference, and no more state bytes (it also stores the maps).
    # Not bitwise: bitsandbytes' fused 8-bit update and our dequantize-update-quantize round M in
    # another operation order (and with CPU-specific vector code), so an M within an ulp of the
    # midpoint between two codes may take either. Measured here: no code differs. Allowed: 1% of
    # the codes, each to a neighbouring code (the signed map is sorted); another map, block size
    # or beta1 changes most codes.
    st, ref_st = opt.state[ours[0]], ref_opt.state[ref[0]]
    codes = st["exp_avg"].int() - ref_st["state1"].int()
    assert codes.shape == ref_st["state1"].shape and int(codes.abs().max()) <= 1
    assert float((codes != 0).float().mean()) <= 0.01, int((codes != 0).sum())
    torch.testing.assert_close(st["exp_avg_sq_absmax"], ref_st["absmax2"], rtol=1e-5, atol=0)
    assert state_bytes_of(opt, ours[0]) < sum(
        v.numel() * v.element_size() for v in ref_st.values() if torch.is_tensor(v)
    )


def test_loss_goes_down_close_to_galore_adamw() -> None:
    def losses(cls, **kw) -> list[float]:
        def make(w, b):
            groups = [{"params": [w], "rank": 16, "update_proj_gap": 10, "basis": "svd"}, {"params": [b]}]
            return cls(groups, lr=0.05, **kw)

        return least_squares_losses(make, 15, out_features=80, in_features=64, batch=128)

    eight = losses(GaLoreAdamW8bit, min_8bit_size=0, weight_decay=0.0)
    full = losses(GaLoreAdamW, adam_convention="torch", eps=1e-8)
    assert eight[-1] < 0.75 * eight[0]
    for a, b in zip(eight, full):
        assert abs(a - b) <= 0.05 * b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_formula_worked_values(dtype: torch.dtype) -> None:
    s = dtype.itemsize
    # 8-bit: 2 L + 8 ceil(L / 256) + s B; right side of 80 x 48 at k = 8: L = 640, B = 384.
    group = {"rank": 8, "min_8bit_size": 0}
    assert GaLoreAdamW8bit.state_bytes((80, 48), group, dtype) == 2 * 640 + 8 * 3 + s * 384
    # Below min_8bit_size (default 4096) the moments are fp32: 8 L + s B.
    assert GaLoreAdamW8bit.state_bytes((80, 48), {"rank": 8}, dtype) == 8 * 640 + s * 384
    assert GaLoreAdamW8bit.state_bytes((100, 100), {}, dtype) == 2 * 10**4 + 8 * 40


def test_state_dict_is_weights_only_loadable() -> None:
    params = make_params(SHAPES)
    opt = GaLoreAdamW8bit(reference_groups(params, rank=8), lr=1e-2, min_8bit_size=0)
    run(opt, params, 0, 2)
    sd = roundtrip(opt.state_dict())
    assert set(sd["state"][0]) == {
        "step",
        "refresh",
        "seed",
        "exp_avg",
        "exp_avg_sq",
        "exp_avg_absmax",
        "exp_avg_sq_absmax",
        "basis",
    }
    assert sd["state"][0]["exp_avg"].dtype == torch.uint8
    assert opt.param_groups[0]["eps"] == 1e-8 and opt.param_groups[0]["adam_convention"] == "torch"


def test_missing_bitsandbytes_raises_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    with pytest.raises(ImportError, match="GaLoreAdamW8bit needs bitsandbytes"):
        GaLoreAdamW8bit(reference_groups(make_params(SHAPES), rank=8))

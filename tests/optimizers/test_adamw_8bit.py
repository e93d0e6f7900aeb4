"""Claims about optimizers.adamw_8bit.AdamW8bit (bitsandbytes' 8-bit AdamW, on CPU) beyond the
contract (test_contract.py): it is bitsandbytes' class, its 8-bit state, its distance from AdamW."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

pytest.importorskip("bitsandbytes")

import harness  # noqa: E402
from harness import make_params, run, state_bytes_of  # noqa: E402

import optimizers  # noqa: E402
from optimizers.adamw_8bit import AdamW8bit  # noqa: E402

# 8-bit (>= 4096 entries, one with a partial last block) and fp32-state (small) tensors.
SHAPES = [(128, 64), (5000,), (10, 7)]
GRADS = {"seed": 3000, "growth": 0.0}

#: How the contract runs "adamw_8bit" (test_contract.py).
CONTRACT = harness.Case(
    # Tensors below min_8bit_size keep fp32 moments: bitsandbytes' fp32 AdamW is torch's.
    reduces=(harness.Reduction("fp32_moments", harness.ADAMW_SETTINGS, {"min_8bit_size": 10**9}),),
    variants={"8bit": harness.Variant(kwargs={"min_8bit_size": 0}), "fp32_small": harness.Variant()},
    state_keys=("step", "state1", "state2"),  # bitsandbytes' class, unchanged
)


def _params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return make_params(SHAPES, seed, dtype, std=1.0)


def test_is_the_bitsandbytes_optimizer():
    import bitsandbytes as bnb

    assert issubclass(AdamW8bit, bnb.optim.AdamW8bit)
    assert issubclass(AdamW8bit, torch.optim.Optimizer)


def test_steps_on_cpu_with_8bit_state():
    params = _params(0)
    before = [p.detach().clone() for p in params]
    opt = AdamW8bit(params, lr=1e-2)
    run(opt, params, 0, 3, **GRADS)
    assert opt.state[params[0]]["state1"].dtype == torch.uint8
    assert opt.state[params[2]]["state1"].dtype == torch.float32  # below min_8bit_size
    assert opt.state[params[0]]["step"] == 3
    assert all(not torch.equal(a, b) for a, b in zip(before, params))


def test_close_to_torch_adamw_over_a_few_steps():
    """The 8-bit round trip of m and v perturbs AdamW only slightly."""
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    ours, ref = _params(1), _params(1)
    run(AdamW8bit(ours, **kw), ours, 0, 5, **GRADS)
    run(torch.optim.AdamW(ref, **kw), ref, 0, 5, **GRADS)
    start = _params(1)
    for a, b, s in zip(ours, ref, start):
        moved = (b - s).abs().max()
        assert (a - b).abs().max() < 0.05 * moved


def test_group_min_8bit_size_is_honoured_and_counted():
    big, small = _params(5)[:2]
    opt = AdamW8bit([{"params": [big], "min_8bit_size": 10**6}, {"params": [small]}], min_8bit_size=100)
    run(opt, [big, small], 0, 1, **GRADS)
    assert opt.state[big]["state1"].dtype == torch.float32
    assert opt.state[small]["state1"].dtype == torch.uint8
    for p, g in ((big, opt.param_groups[0]), (small, opt.param_groups[1])):
        own = AdamW8bit.state_bytes(tuple(p.shape), g, torch.float32)
        assert state_bytes_of(opt, p) == own + AdamW8bit.shared_state_bytes(tuple(p.shape), g, torch.float32)
    # The maps are one pair for the optimizer: counted once in its total.
    assert AdamW8bit.shared_state_bytes(tuple(big.shape), opt.param_groups[0], torch.float32) == 0
    assert (
        optimizers.measured_state_bytes(opt)
        == 8 * big.numel() + 2 * small.numel() + 8 * (-(-small.numel() // 256)) + 2 * 4 * 256
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_formula_worked_value(dtype):
    params = _params(4, dtype)
    opt = AdamW8bit(params)
    run(opt, params, 0, 2, **GRADS)
    # 128 x 64 is 8-bit: 2 * 8192 + 2 * 4 * 32 (absmax per 256 block), and it refers to the
    # optimizer's two maps (2 * 4 * 256), which every 8-bit parameter shares.
    assert AdamW8bit.state_bytes((128, 64), {}, dtype) == 16640
    assert AdamW8bit.shared_state_bytes((128, 64), {}, dtype) == 2048
    assert state_bytes_of(opt, params[0]) == 16640 + 2048
    assert opt.state[params[0]]["qmap1"] is opt.state[params[1]]["qmap1"]


def test_clear_import_error_without_bitsandbytes(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    monkeypatch.delitem(sys.modules, "optimizers.adamw_8bit")
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        importlib.import_module("optimizers.adamw_8bit")

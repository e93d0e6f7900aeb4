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


def test_steps_as_bitsandbytes_without_its_per_parameter_synchronisation(monkeypatch):
    """Our step loop is bitsandbytes' own (the same kernels in the same order: bitwise equal to
    bnb.optim.AdamW8bit), without the ``sync_gpu`` (torch.cuda.synchronize on CUDA) that
    bitsandbytes' ``Optimizer8bit.step`` makes after every parameter."""
    import bitsandbytes as bnb
    import bitsandbytes.optim.optimizer as bnb_optimizer

    calls = []
    real = bnb_optimizer.sync_gpu
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", lambda t: (calls.append(1), real(t)))
    ours, ref = _params(6), _params(6)
    run(AdamW8bit(ours, lr=1e-2), ours, 0, 3, **GRADS)
    assert calls == []
    run(bnb.optim.AdamW8bit(ref, lr=1e-2), ref, 0, 3, **GRADS)
    assert len(calls) == 3 * len(ref)  # what bitsandbytes' own loop does
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def test_resume_shares_the_quantile_maps_again():
    """A checkpoint whose parameters hold their own copies of the maps (bitsandbytes' load moves
    each parameter's maps to the device one by one; DCP keys every tensor apart): after loading,
    the optimizer holds one pair again, so the measured state equals the estimate (the maps
    counted once), and a later step and a parameter that starts later refer to that pair."""
    params = _params(7)
    opt = AdamW8bit(params[:2], lr=1e-2, min_8bit_size=100)
    run(opt, params[:2], 0, 2, **GRADS)
    want = optimizers.measured_state_bytes(opt)
    sd = opt.state_dict()
    for st in sd["state"].values():  # each parameter's own copy, as after .to("cuda") per tensor
        quant = st[AdamW8bit._FSDP_WRAPPED_QUANT_STATE_KEY]
        quant["qmap1"], quant["qmap2"] = quant["qmap1"].clone(), quant["qmap2"].clone()
    sd = harness.roundtrip(sd)

    fresh = _params(7)
    resumed = AdamW8bit([{"params": fresh[:2]}, {"params": fresh[2:], "min_8bit_size": 10}], lr=1e-2)
    resumed.load_state_dict(
        {**sd, "param_groups": [*sd["param_groups"], resumed.state_dict()["param_groups"][1]]}
    )
    a, b = (resumed.state[p] for p in fresh[:2])
    assert a["qmap1"] is b["qmap1"] and a["qmap2"] is b["qmap2"]
    assert optimizers.measured_state_bytes(resumed) == want
    group = resumed.param_groups[0]
    estimate = sum(AdamW8bit.state_bytes(tuple(p.shape), group, p.dtype) for p in fresh[:2])
    assert want == estimate + AdamW8bit.shared_state_bytes(tuple(fresh[0].shape), group, torch.float32)
    run(resumed, fresh, 2, 3, **GRADS)  # the third parameter's state starts now, 8-bit
    assert resumed.state[fresh[2]]["qmap1"] is a["qmap1"]
    assert resumed.state[fresh[0]]["qmap1"] is a["qmap1"]


def test_clear_import_error_without_bitsandbytes(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    monkeypatch.delitem(sys.modules, "optimizers.adamw_8bit")
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        importlib.import_module("optimizers.adamw_8bit")

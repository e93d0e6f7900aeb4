"""Claims about optimizers.adamw_8bit.AdamW8bit (bitsandbytes' 8-bit AdamW, on CPU)."""

from __future__ import annotations

import importlib
import io
import sys

import pytest
import torch

pytest.importorskip("bitsandbytes")

from optimizers.adamw_8bit import AdamW8bit  # noqa: E402

# 8-bit (>= 4096 entries, one with a partial last block) and fp32-state (small) tensors.
SHAPES = [(128, 64), (5000,), (10, 7)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These tensors are tiny: a second intra-op thread only adds synchronisation, which stalls
    # badly when the machine is busy. Restored after the module.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _run(opt: torch.optim.Optimizer, params, start: int, stop: int) -> None:
    for t in range(start, stop):
        gen = torch.Generator().manual_seed(3000 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _real_bytes(opt: torch.optim.Optimizer, p: torch.Tensor) -> int:
    return sum(v.numel() * v.element_size() for v in opt.state[p].values() if torch.is_tensor(v))


def test_is_the_bitsandbytes_optimizer():
    import bitsandbytes as bnb

    assert issubclass(AdamW8bit, bnb.optim.AdamW8bit)
    assert issubclass(AdamW8bit, torch.optim.Optimizer)


def test_steps_on_cpu_with_8bit_state():
    params = _params(0)
    before = [p.detach().clone() for p in params]
    opt = AdamW8bit(params, lr=1e-2)
    _run(opt, params, 0, 3)
    assert opt.state[params[0]]["state1"].dtype == torch.uint8
    assert opt.state[params[2]]["state1"].dtype == torch.float32  # below min_8bit_size
    assert opt.state[params[0]]["step"] == 3
    assert all(not torch.equal(a, b) for a, b in zip(before, params))


def test_close_to_torch_adamw_over_a_few_steps():
    """The 8-bit round trip of m and v perturbs AdamW only slightly."""
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    ours, ref = _params(1), _params(1)
    _run(AdamW8bit(ours, **kw), ours, 0, 5)
    _run(torch.optim.AdamW(ref, **kw), ref, 0, 5)
    start = _params(1)
    for a, b, s in zip(ours, ref, start):
        moved = (b - s).abs().max()
        assert (a - b).abs().max() < 0.05 * moved


def test_loss_goes_down_least_squares():
    gen = torch.Generator().manual_seed(0)
    A, x_true = torch.randn(256, 64, generator=gen), torch.randn(64, 64, generator=gen)
    B = A @ x_true
    x = torch.nn.Parameter(torch.zeros(64, 64))  # 4096 entries: 8-bit state
    opt = AdamW8bit([x], lr=0.1, weight_decay=0.0)
    first = None
    for _ in range(40):  # bitsandbytes' CPU 8-bit kernel takes ~40 ms a step here
        loss = ((A @ x - B) ** 2).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert opt.state[x]["state1"].dtype == torch.uint8
    assert ((A @ x - B) ** 2).mean().item() < 0.05 * first


def test_two_seeded_runs_are_bitwise_equal():
    runs = []
    for _ in range(2):
        params = _params(2)
        _run(AdamW8bit(params, lr=1e-2), params, 0, 6)
        runs.append([p.detach().clone() for p in params])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_only_resume_is_exact(dtype):
    straight = _params(3, dtype)
    _run(AdamW8bit(straight, lr=1e-2), straight, 0, 8)

    first = _params(3, dtype)
    opt = AdamW8bit(first, lr=1e-2)
    _run(opt, first, 0, 3)
    sd = _roundtrip(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = AdamW8bit(resumed, lr=1e-2)
    opt2.load_state_dict(sd)
    _run(opt2, resumed, 3, 8)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_formula_matches_real_state(dtype):
    params = _params(4, dtype)
    opt = AdamW8bit(params)
    _run(opt, params, 0, 2)
    for p in params:
        assert _real_bytes(opt, p) == AdamW8bit.state_bytes(tuple(p.shape), {}, dtype)
        assert _real_bytes(opt, p) == AdamW8bit.state_bytes(tuple(p.shape), opt.param_groups[0], dtype)
    # Worked value for a 128 x 64 matrix: 2 * 8192 + 2 * 4 * 32 + 2 * 4 * 256.
    assert AdamW8bit.state_bytes((128, 64), {}, dtype) == 18688


def test_group_min_8bit_size_is_honoured_and_counted():
    big, small = _params(5)[:2]
    opt = AdamW8bit([{"params": [big], "min_8bit_size": 10**6}, {"params": [small]}], min_8bit_size=100)
    _run(opt, [big, small], 0, 1)
    assert opt.state[big]["state1"].dtype == torch.float32
    assert opt.state[small]["state1"].dtype == torch.uint8
    for p, g in ((big, opt.param_groups[0]), (small, opt.param_groups[1])):
        assert _real_bytes(opt, p) == AdamW8bit.state_bytes(tuple(p.shape), g, torch.float32)


def test_clear_import_error_without_bitsandbytes(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    monkeypatch.delitem(sys.modules, "optimizers.adamw_8bit")
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        importlib.import_module("optimizers.adamw_8bit")

"""Rounding a weight's new value to its storage (optimizers/rounding.py): the counter-based noise is
a pure function of (seed, parameter, step, element offset), so a shard draws its rows' share of the
whole tensor's draws; stochastic rounding to bf16 and to INT8 groups is unbiased (the mean of 10^4
roundings equals the value within 1e-3 relative), and keeps the expectation of an update that
round-to-nearest loses. The noise is integer arithmetic, the same bits on any CPU or GPU, so every
figure below is the same on every machine."""

from __future__ import annotations

import pytest
import torch

from optimizers import rounding as R


def test_noise_is_uniform_and_keyed_by_seed_parameter_and_step():
    k = R.stream_key(0, 3, 7)
    u = R.uniform(k, 0, (1000, 100))
    assert u.dtype == torch.float32 and 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 2e-3 and abs(float(u.var()) - 1 / 12) < 2e-3
    assert torch.equal(u, R.uniform(R.stream_key(0, 3, 7), 0, (1000, 100)))  # a pure function
    for other in (R.stream_key(1, 3, 7), R.stream_key(0, 4, 7), R.stream_key(0, 3, 8)):
        assert not torch.equal(u, R.uniform(other, 0, (1000, 100)))
    # Neighbouring streams are uncorrelated.
    v = R.uniform(R.stream_key(0, 3, 8), 0, (1000, 100))
    assert abs(float(torch.corrcoef(torch.stack([u.flatten(), v.flatten()]))[0, 1])) < 0.01


def test_a_shard_draws_its_rows_share_of_the_whole_tensors_noise():
    """Bitwise: the same integer hash of the same element offsets."""
    k = R.stream_key(5, 0, 1)
    whole = R.uniform(k, 0, (10, 12))
    assert torch.equal(R.uniform(k, 4 * 12, (3, 12)), whole[4:7])


def test_noise_keys_elements_past_four_billion():
    """Offsets past 2^32 fold their high bits into the key: still in [0, 1), and distinct."""
    k = R.stream_key(0, 0, 0)
    a, b = R.uniform(k, 2**32 - 5, (10,)), R.uniform(k, 2 * 2**32 - 5, (10,))
    assert float(a.max()) < 1.0 and not torch.equal(a, b)


@pytest.mark.parametrize("x", [1.0 + 2**-10, -3.3e-3, 7.1e4, 0.3])
def test_stochastic_rounding_to_bf16_is_unbiased(x):
    n = 10_000
    value = torch.full((n,), x, dtype=torch.float32)
    out = torch.empty(n, dtype=torch.bfloat16)
    R.round_bf16_(out, value, R.uniform(R.stream_key(0, 0, 0), 0, (n,)))
    # Only the two bf16 values around x: its magnitude truncated to bf16, and one bf16 step up.
    bits = torch.tensor([x], dtype=torch.float32).view(torch.int32)
    down = (bits & ~0xFFFF).view(torch.float32)
    up = ((bits & ~0xFFFF) + 0x10000).view(torch.float32)
    assert set(out.float().unique().tolist()) == {float(down), float(up)}
    assert abs(float(out.double().mean()) - x) <= 1e-3 * abs(x)
    nearest = torch.empty(n, dtype=torch.bfloat16)
    R.round_bf16_(nearest, value, None)
    assert torch.equal(nearest, value.to(torch.bfloat16))  # None: round to nearest, torch's cast


def test_stochastic_rounding_to_bf16_keeps_non_finite_values():
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    out = torch.empty(5, dtype=torch.bfloat16)
    R.round_bf16_(out, x, R.uniform(R.stream_key(0, 0, 0), 0, (5,)))
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2].isnan() and out[3] == 0 == out[4]


def _int8(x: torch.Tensor, group: int, u: torch.Tensor | None) -> torch.Tensor:
    m, n = x.shape
    codes = torch.empty(m, n, dtype=torch.int8)
    scales = torch.empty(m, R.int8_groups(n, group))
    R.quantize_int8_(codes, scales, x, group, u)
    assert int(codes.abs().max()) <= 127
    return R.dequantize_int8(codes, scales, group)


@pytest.mark.parametrize("n, group", [(128, 128), (200, 64), (50, 128)])
def test_stochastic_rounding_of_an_int8_group_is_unbiased(n, group):
    """10^4 roundings of the same row (each with its own draws): their mean is the row, within
    1e-3 of its absmax (and of each value's own size for the larger ones)."""
    torch.manual_seed(0)
    row = torch.randn(1, n)
    trials = 10_000
    x = row.expand(trials, n).contiguous()
    got = _int8(x, group, R.uniform(R.stream_key(0, 0, 0), 0, (trials, n))).double().mean(0)
    err = (got - row[0].double()).abs()
    assert float(err.max()) <= 1e-3 * float(row.abs().max())
    big = row[0].abs() > 0.5 * row.abs().max()
    assert bool((err[big] <= 1e-3 * row[0].abs()[big].double()).all())


def test_round_to_nearest_loses_a_small_int8_update_and_stochastic_rounding_keeps_it():
    """A group whose values sit on its grid; a 1e-4-relative update to its second largest element
    (the largest sets the group's scale). To nearest, the code does not move (the update is lost,
    every time); stochastically, the mean of 10^4 writes moves by the update (within 10%: the
    mean of 10^4 Bernoulli draws of p ~ 0.01)."""
    group, trials = 128, 10_000
    torch.manual_seed(1)
    w = _int8(torch.randn(1, group), group, None)  # on its own grid: it re-quantizes to itself
    assert torch.equal(_int8(w, group, None), w)
    j = int(w.abs().argsort(descending=True)[0, 1])
    delta = 1e-4 * float(w[0, j])
    new = w.clone()
    new[0, j] += delta
    assert torch.equal(_int8(new, group, None), w)  # lost
    x = new.expand(trials, group).contiguous()
    got = _int8(x, group, R.uniform(R.stream_key(0, 1, 0), 0, (trials, group))).double().mean(0)
    assert abs(float(got[j] - w[0, j]) - delta) <= 0.1 * abs(delta)


def test_int8_bytes_and_dequantization():
    assert R.int8_nbytes((4096, 11008), 128) == 4096 * 11008 + 4 * 4096 * 86
    assert R.int8_nbytes((64, 50), 128) == 64 * 50 + 4 * 64
    x = torch.randn(3, 256)
    codes, scales = torch.empty(3, 256, dtype=torch.int8), torch.empty(3, 2)
    R.quantize_int8_(codes, scales, x, 128, None)
    assert torch.allclose(scales, x.reshape(3, 2, 128).abs().amax(2) / 127)
    assert float((R.dequantize_int8(codes, scales, 128) - x).abs().max()) <= float(scales.max()) / 2 + 1e-7
    assert R.dequantize_int8(codes, scales, 128, torch.bfloat16).dtype == torch.bfloat16

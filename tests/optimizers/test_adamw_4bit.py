"""Claims about optimizers.adamw_4bit.AdamW4bit (AdamW with 4-bit moments, pure PyTorch) and its
quantizers (optimizers/moments_4bit.py) beyond the contract (test_contract.py): the codec, the maps,
the step against Li et al.'s quantizer transcribed (tests/optimizers/reference_4bit.py) and against
torchao's AdamW4bit, the state formula by hand, the zero-gradient step, a 100-step tiny run."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness
import pytest
import torch
from _common import TINY
from harness import ADAMW_SETTINGS, Case, Reduction, Variant, make_params, roundtrip, run, state_bytes_of
from reference_4bit import DE_MAP, LINEAR_MAP, PaperAdamW4bit, fake_blockwise, fake_rank1

import optimizers
from optimizers import moments_4bit
from optimizers.adamw_4bit import AdamW4bit
from optimizers.moments_4bit import (
    SIGNED_DE_MAP,
    UNSIGNED_LINEAR_MAP,
    blockwise_dequantize,
    blockwise_quantize_,
    pack_,
    rank1_dequantize,
    rank1_quantize_,
    unpack,
)

#: How the contract runs "adamw_4bit" (test_contract.py).
CONTRACT = Case(
    # Moments below min_4bit_size stay fp32: then it is torch's AdamW (the torch convention).
    reduces=(Reduction("fp32_moments", ADAMW_SETTINGS, {"min_4bit_size": 10**9}),),
    variants={
        "rank1": Variant(kwargs={"min_4bit_size": 0}),
        "blockwise": Variant(kwargs={"min_4bit_size": 0, "quant_scheme": "blockwise"}),
        "fp32_small": Variant(),
    },
    # 4-bit moments round the small late gradients of the least-squares problem coarsely: 60 steps
    # where fp32 AdamW needs 30 (measured at lr 0.2: 21% of the first loss after 30 steps, 1.8%
    # after 60; blockwise 18% and 1.3%).
    loss_steps=60,
)

# Odd sizes: 80 x 97 (7,760 entries: 60 whole blocks and a partial one), 33 x 130 (an odd number of
# entries: a half-used last byte), a vector of 5,001 (odd, partial block: V block-wise) and a
# small matrix below min_4bit_size (fp32 moments).
SHAPES = [(80, 97), (33, 130), (5001,), (10, 7)]
MIN_SIZE = 1000


def _codes(values: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    return (values.unsqueeze(-1) - qmap).abs().argmin(-1)


def test_maps_are_the_papers() -> None:
    """M's map is the 4-bit signed dynamic-exponent map (to fp32 rounding of its decimal values)
    and V's the linear map without zero, (k + 1) / 16."""
    torch.testing.assert_close(SIGNED_DE_MAP, DE_MAP, rtol=0, atol=2e-8)
    assert torch.equal(UNSIGNED_LINEAR_MAP, LINEAR_MAP) and UNSIGNED_LINEAR_MAP.min() > 0


@pytest.mark.parametrize("numel", [1, 7, 256, 257])
def test_pack_puts_two_codes_in_a_byte_high_nibble_first(numel: int) -> None:
    codes = torch.arange(numel) % 16
    packed = torch.empty(-(-numel // 2), dtype=torch.uint8)
    pack_(codes, packed)
    assert int(packed[0]) == (0 << 4 | (1 if numel > 1 else 0))
    assert torch.equal(unpack(packed, numel), codes.int())


#: The codec's chunk (`moments_4bit.CHUNK`) as shipped, and small enough that the tensors below
#: span several chunks, the last one partial (and, for rank-1 scales, one row per chunk).
CHUNKS = [moments_4bit.CHUNK, 256]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("shape", [(33, 130), (5001,), (128, 64)])
def test_blockwise_codec_reads_as_the_papers_quantizer(
    shape: tuple[int, ...], chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Block-wise quantize and dequantize read every entry as Li et al.'s nearest rounding does
    (the fp32 maps differ by at most one rounding of their decimals); a zero block reads 0."""
    monkeypatch.setattr(moments_4bit, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen) * torch.logspace(-6, 0, shape[-1])
    x.view(-1)[128:256] = 0.0  # the second block is zero
    for qmap, ref_map, y in ((SIGNED_DE_MAP, DE_MAP, x), (UNSIGNED_LINEAR_MAP, LINEAR_MAP, x.square())):
        numel = y.numel()
        codes = torch.empty(-(-numel // 2), dtype=torch.uint8)
        absmax = torch.empty(-(-numel // 128))
        blockwise_quantize_(y.clone(), qmap, codes, absmax)
        got = blockwise_dequantize(codes, absmax, qmap, shape)
        torch.testing.assert_close(got, fake_blockwise(y, ref_map), rtol=1e-6, atol=0)
        assert not got.view(-1)[128:256].any()


@pytest.mark.parametrize("chunk", CHUNKS)
def test_rank1_codec_reads_as_the_papers_quantizer_and_never_reads_zero(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank-1 normalised V reads as the paper's min(row max, column max) scaling rounded to the
    linear map; a nonzero V never reads 0 (the map has no zero), a zero row does."""
    monkeypatch.setattr(moments_4bit, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(2)
    v = (torch.randn(33, 130, generator=gen) * torch.logspace(-4, 0, 130)).square()
    v[5] = 0.0
    codes, rows, cols = torch.empty(2145, dtype=torch.uint8), torch.empty(33), torch.empty(130)
    rank1_quantize_(v.clone(), UNSIGNED_LINEAR_MAP, codes, rows, cols)
    got = rank1_dequantize(codes, rows, cols, UNSIGNED_LINEAR_MAP, (33, 130))
    torch.testing.assert_close(got, fake_rank1(v, LINEAR_MAP), rtol=1e-6, atol=0)
    assert torch.equal(rows, v.amax(1)) and torch.equal(cols, v.amax(0))
    assert ((got > 0) == (v > 0)).all() and not got[5].any()


def _beside(ours: AdamW4bit, ref: torch.optim.Optimizer, shapes, steps: int, dtype=torch.float32):
    """Steps two optimizers on the same weights and gradients; returns (ours, ref, start)."""
    start = make_params(shapes, seed=3, std=1.0, dtype=dtype)
    a = [torch.nn.Parameter(w.detach().clone()) for w in start]
    b = [torch.nn.Parameter(w.detach().clone()) for w in start]
    opt_a, opt_b = ours(a), ref(b)
    run(opt_a, a, 0, steps, growth=0.0)
    run(opt_b, b, 0, steps, growth=0.0)
    return opt_a, a, opt_b, b, start


@pytest.mark.parametrize("scheme", ["rank1", "blockwise"])
def test_steps_as_adamw_with_the_papers_quantizer(scheme: str) -> None:
    """20 steps beside textbook AdamW whose fp32 moments are fake-quantized with the transcribed
    quantizer: the same weights to within 1e-3 of their movement (norm of the difference over the
    norm of the movement, per tensor; measured 2e-7 to 6e-7). The two compute Adam in another
    order (torch's fused kernel, the textbook formula), so the moments differ in the last bit;
    where one sits on a rounding midpoint a code flips, moving one entry by a fraction of a step:
    the bound allows a few such flips and nothing else (the other scheme's V: 1e-2 and more)."""
    kw = {"lr": 1e-2, "weight_decay": 0.1, "min_4bit_size": MIN_SIZE, "quant_scheme": scheme}
    _, ours, _, ref, start = _beside(
        lambda p: AdamW4bit(p, **kw), lambda p: PaperAdamW4bit(p, **kw), SHAPES, 20
    )
    for a, b, w in zip(ours, ref, start):
        assert float((a - b).detach().norm()) <= 1e-3 * float((b - w).detach().norm()), tuple(w.shape)


@pytest.fixture
def torchao_optim(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """torchao.optim, from the folder `make` installs it in (``.venv/lowbit-ref``: the 'lowbit-ref'
    extra, off every other process's import path), or an installed torchao; for this test only
    (its modules leave sys.modules after it, so transformers never sees them)."""
    folder = Path(sys.prefix) / "lowbit-ref"
    if folder.is_dir():
        monkeypatch.syspath_prepend(str(folder))
    before = set(sys.modules)
    yield pytest.importorskip(
        "torchao.optim", reason="torchao: the 'lowbit-ref' extra (make test installs it)"
    )
    for name in set(sys.modules) - before:
        if name == "torchao" or name.startswith("torchao."):
            del sys.modules[name]


def test_blockwise_scheme_is_torchaos_adamw4bit(monkeypatch: pytest.MonkeyPatch, torchao_optim: Any) -> None:
    """``quant_scheme="blockwise"`` beside torchao's AdamW4bit (eager: its torch.compile of the
    step is replaced by the plain function, the same operations): after every step the block
    scales agree to fp32 rounding and the 4-bit codes in at least 99.9% of the bytes (measured:
    all), the weights to within 1e-3 of their movement at the end. The two compute Adam in another
    order (torch's fused kernel with (1 - beta2) g g, torchao's lerp to g^2), so V differs in the
    last bit; a code flips where a moment sits on a rounding midpoint (see the test above). State
    bytes: ours equal torchao's codes and scales, 2 (L / 2 + 4 L / 128); torchao holds a 16-entry
    fp32 map per moment and an fp32 step beside them."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    shapes = [(64, 128), (128, 96), (24,)]  # torchao quantizes sizes >= 4096 that 128 divides
    ours_kw = {"lr": 1e-2, "weight_decay": 0.1, "quant_scheme": "blockwise"}
    opt, ours, ref_opt, ref, start = _beside(
        lambda p: AdamW4bit(p, **ours_kw),
        lambda p: torchao_optim.AdamW4bit(p, lr=1e-2, weight_decay=0.1),
        shapes,
        0,
    )
    for t in range(20):
        harness.set_grads(ours, t, growth=0.0)
        harness.set_grads(ref, t, growth=0.0)
        opt.step()
        ref_opt.step()
        for p, q in zip(ours[:2], ref[:2]):
            st, ao = opt.state[p], ref_opt.state[q]
            for key, ours_key in (("exp_avg", "exp_avg_absmax"), ("exp_avg_sq", "exp_avg_sq_absmax")):
                same = (st[key] == ao[key].codes).float().mean()
                assert same >= 0.999, (t, key, float(same))
                torch.testing.assert_close(st[ours_key], ao[key].scale, rtol=1e-6, atol=0)
    for a, b, w in zip(ours, ref, start):
        assert float((a - b).detach().norm()) <= 1e-3 * float((b - w).detach().norm()), tuple(w.shape)
    for p, q in zip(ours[:2], ref[:2]):
        ao = ref_opt.state[q]
        held = sum(
            t.numel() * t.element_size()
            for k in ("exp_avg", "exp_avg_sq")
            for t in (ao[k].codes, ao[k].scale)
        )
        numel = p.numel()
        assert state_bytes_of(opt, p) == held == 2 * (numel // 2 + 4 * numel // 128)
        assert AdamW4bit.state_bytes(tuple(p.shape), opt.param_groups[0], p.dtype) == held
        assert ao["exp_avg"].qmap.numel() == ao["exp_avg_sq"].qmap.numel() == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_formula_worked_values(dtype: torch.dtype) -> None:
    """By hand, any parameter dtype. Rank-1 V: 2 ceil(L / 2) + 4 ceil(L / 128) + 4 (a + b);
    block-wise V (and a vector): 2 ceil(L / 2) + 8 ceil(L / 128); below min_4bit_size: 8 L."""
    rank1, blockwise = {"min_4bit_size": MIN_SIZE}, {"min_4bit_size": MIN_SIZE, "quant_scheme": "blockwise"}
    f = AdamW4bit.state_bytes
    assert f((80, 97), rank1, dtype) == 2 * 3880 + 4 * 61 + 4 * (80 + 97) == 8712
    assert f((33, 130), rank1, dtype) == 2 * 2145 + 4 * 34 + 4 * (33 + 130) == 5078
    assert f((80, 97), blockwise, dtype) == 2 * 3880 + 8 * 61 == 8248
    assert f((5001,), rank1, dtype) == f((5001,), blockwise, dtype) == 2 * 2501 + 8 * 40 == 5322
    assert f((10, 7), rank1, dtype) == 8 * 70
    assert f((4096, 4096), {}, dtype) == 2**24 + 4 * 2**17 + 4 * 8192  # defaults: rank1, 4096
    for scheme in ("rank1", "blockwise"):
        params = make_params(SHAPES, dtype=dtype)
        opt = AdamW4bit(params, min_4bit_size=MIN_SIZE, quant_scheme=scheme)
        run(opt, params, 0, 2)
        want = [f(tuple(p.shape), opt.param_groups[0], dtype) for p in params]
        assert [state_bytes_of(opt, p) for p in params] == want
        assert optimizers.measured_state_bytes(opt) == sum(want)
        assert optimizers.method_spec("adamw_4bit").shared_state_bytes((80, 97), {}, dtype) == 0


def test_state_is_codes_and_scales_and_loads_weights_only() -> None:
    params = make_params(SHAPES)
    opt = AdamW4bit(params, min_4bit_size=MIN_SIZE)
    run(opt, params, 0, 2)
    state = roundtrip(opt.state_dict())["state"]
    assert set(state[0]) == {
        "step",
        "exp_avg",
        "exp_avg_absmax",
        "exp_avg_sq",
        "exp_avg_sq_row_max",
        "exp_avg_sq_col_max",
    }
    assert state[0]["exp_avg"].dtype == torch.uint8 and state[0]["exp_avg"].shape == (3880,)
    assert state[0]["exp_avg_sq_row_max"].shape == (80,) and state[0]["exp_avg_sq_col_max"].shape == (97,)
    assert set(state[2]) == {"step", "exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"}
    assert state[3]["exp_avg"].dtype == torch.float32 and state[3]["exp_avg"].shape == (10, 7)
    g = opt.param_groups[0]
    assert (g["eps"], g["weight_decay"], g["adam_convention"], g["min_4bit_size"]) == (
        1e-8,
        1e-2,
        "torch",
        MIN_SIZE,
    )


def test_zero_gradient_step_allocates_the_state_and_moves_nothing() -> None:
    """A step on all-zero gradients (a distributed checkpoint loader's) allocates every state
    tensor at its final size (the formula's bytes, all zero) and advances no counter; the run
    then equals a fresh one bitwise."""
    params, fresh = make_params(SHAPES), make_params(SHAPES)
    opt = AdamW4bit(params, min_4bit_size=MIN_SIZE)
    fresh_opt = AdamW4bit(fresh, min_4bit_size=MIN_SIZE)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    harness.assert_same(params, fresh, what="weights after the dummy step")
    for p in params:
        st = opt.state[p]
        assert st["step"] == 0 and not any(v.any() for v in st.values() if torch.is_tensor(v))
        assert state_bytes_of(opt, p) == AdamW4bit.state_bytes(tuple(p.shape), opt.param_groups[0], p.dtype)
    run(opt, params, 0, 4)
    run(fresh_opt, fresh, 0, 4)
    harness.assert_same(params, fresh, what="after a dummy first step")


def test_bad_groups_are_refused() -> None:
    params = make_params(SHAPES[:1])
    with pytest.raises(ValueError, match="quant_scheme must be one of"):
        AdamW4bit(params, quant_scheme="rank2")
    with pytest.raises(ValueError, match="AdamW4bit does not project"):
        AdamW4bit([{"params": params, "rank": 4}])
    with pytest.raises(TypeError, match="unknown option.*basis"):
        AdamW4bit(params, basis="svd")


def test_transient_formula_is_the_measured_one() -> None:
    """The registry's step transient (`Moments4bit.step_transient_bytes`) is what one step of a
    4-bit tensor allocates, by tensor accounting, to within the per-block scales (1%): fp32
    (12 L + one chunk's int32 codes) and bf16 (16 L: x's fp32 copy at the fused kernel), for a
    tensor larger than a chunk and one smaller."""
    from effpretrain.memory.accounting import accounting

    spec = optimizers.method_spec("adamw_4bit")
    for dtype in (torch.float32, torch.bfloat16):
        for shape in [(256, 384), (5001,)]:
            p = make_params([shape], dtype=dtype)[0]
            opt = AdamW4bit([p])
            run(opt, [p], 0, 1)
            harness.set_grads([p], 1)
            with accounting(p, p.grad, *opt.state[p].values()) as log:
                opt.step()
            measured = log.replay(include_existing=False)[0]
            want = spec.step_transient_bytes(shape, opt.param_groups[0], dtype)
            assert want <= measured <= want + 4 * math.ceil(math.prod(shape) / 128) + 64, (dtype, shape)


@pytest.mark.run
@pytest.mark.parametrize("scheme", ["rank1", "blockwise"])
def test_100_tiny_steps_end_within_2_percent_of_the_paper_quantizer(scheme, tmp_path, tiny_overrides):
    """Acceptance: the tiny recipe trained 100 steps with ``adamw_4bit`` and with the reference
    (`PaperAdamW4bit`, registered for this test) ends at a validation loss within 2%; the
    measured state is the estimate, and 4-bit state is about a quarter of fp32 state plus the
    scales."""
    from effpretrain.config import load_config
    from effpretrain.trainer import train

    spec = optimizers.MethodSpec(name="paper_adamw_4bit", target="reference_4bit:PaperAdamW4bit")
    optimizers.register(spec)
    try:
        over = [*tiny_overrides, "train.max_steps=100", "train.eval_every=100", "train.memory_steps=[]"]
        over.append(f"optim.extra.quant_scheme={scheme}")
        recipe = TINY / "adamw_4bit.yaml"
        ours = train(load_config(recipe, over), tmp_path / "ours")
        ref = train(load_config(recipe, [*over, "optim.name=paper_adamw_4bit"]), tmp_path / "ref")
    finally:
        optimizers.unregister(spec.name)
    assert abs(ours["final_val_loss"] - ref["final_val_loss"]) <= 0.02 * ref["final_val_loss"]
    assert ours["optimizer_state_bytes"] == ours["estimated"]["optimizer_state"]
    assert ours["optimizer_state_bytes"] < 0.3 * ref["optimizer_state_bytes"]


def test_estimator_counts_the_scheme_set_in_optim_extra() -> None:
    """``optim.extra: {quant_scheme: blockwise}`` reaches every group the estimator counts, as it
    reaches the optimizer's groups (its constructor defaults): the tiny model's state is the sum of
    the block-wise formula, not the rank-1 default's."""
    from effpretrain.config import OptimConfig
    from effpretrain.memory import estimate, model_param_shapes

    def total(**extra) -> int:
        cfg = OptimConfig(name="adamw_4bit", extra=extra)
        return estimate("tiny", "adamw_4bit", dtype="fp32", optim_cfg=cfg).optimizer_state

    shapes = [s.shape for s in model_param_shapes("tiny")]
    for scheme in ("rank1", "blockwise"):
        want = sum(AdamW4bit.state_bytes(shape, {"quant_scheme": scheme}, torch.float32) for shape in shapes)
        assert total(quant_scheme=scheme) == want
    assert total(quant_scheme="blockwise") != total()

"""Claims about optimizers.projected_adam: its one Adam kernel (fused fast path and op-by-op
path), the single required hook, and the pluggable moment storage."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from optimizers.apollo import APOLLOAdamW
from optimizers.fira import FiraAdamW
from optimizers.galore import GaLoreAdamW
from optimizers.projected_adam import (
    EXP_AVG,
    EXP_AVG_SQ,
    AdamMoments,
    Direction,
    ProjectedAdam,
    ProjectedStep,
    adam_update,
)

BETAS = (0.9, 0.999)
EPS = 1e-6
# Relative tolerance of the fused-vs-op-by-op comparisons: ~8 fp32 ulps. Measured: at most ~1.2
# ulps of the magnitude of the terms (one step) and ~1.6 ulps of max |W| (ten optimizer steps).
RTOL = 1e-6


def _group(convention: str, correct_bias: bool = True) -> dict[str, Any]:
    return {
        "lr": 1e-2,
        "betas": BETAS,
        "eps": EPS,
        "weight_decay": 0.0,
        "correct_bias": correct_bias,
        "adam_convention": convention,
    }


@pytest.mark.parametrize("convention", ["reference", "torch"])
def test_op_by_op_adam_equals_the_fused_kernel_step_by_step(convention: str) -> None:
    # Each step both paths start from the same (M, V) along a 30-step trajectory. Errors are
    # bounded by the magnitude of the terms each result sums, not by the result itself: M is a
    # sum of two terms that may cancel (the kernel computes it as a lerp, the op-by-op path as
    # beta1 M + (1 - beta1) x), so a per-element rtol on M would measure cancellation.
    gen = torch.Generator().manual_seed(0)
    group = _group(convention)
    beta1, beta2 = BETAS
    m, v = torch.zeros(64, 8), torch.zeros(64, 8)
    for t in range(1, 31):
        x = torch.randn(64, 8, generator=gen) * (1.0 + 0.1 * t)
        m_f, v_f, m_o, v_o = m.clone(), v.clone(), m.clone(), v.clone()
        n_f, eta_f = adam_update(m_f, v_f, x, t, group, fused=True)
        n_o, eta_o = adam_update(m_o, v_o, x, t, group, fused=False)
        assert eta_f == eta_o
        terms_m = beta1 * m.abs() + (1 - beta1) * x.abs()
        terms_v = beta2 * v + (1 - beta2) * x * x
        bc2 = 1.0 - beta2**t
        denom = (v_o.sqrt() if convention == "reference" else (v_o / bc2).sqrt()) + EPS
        terms_n = n_o.abs() + terms_m / denom
        for fused, plain, terms in ((m_f, m_o, terms_m), (v_f, v_o, terms_v), (n_f, n_o, terms_n)):
            assert bool(((fused - plain).abs() <= RTOL * terms).all())
        # The quantities themselves, against float64 maths: N = M / (sqrt(V) + eps) (reference)
        # or M / (sqrt(V / (1 - beta2^t)) + eps) (torch).
        m64 = beta1 * m.double() + (1 - beta1) * x.double()
        v64 = beta2 * v.double() + (1 - beta2) * x.double() ** 2
        root = v64.sqrt() if convention == "reference" else (v64 / bc2).sqrt()
        torch.testing.assert_close(n_o.double(), m64 / (root + EPS), rtol=1e-5, atol=1e-6)
        m, v = m_o, v_o


@pytest.mark.parametrize("convention", ["reference", "torch"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("cls", [GaLoreAdamW, FiraAdamW, APOLLOAdamW])
def test_optimizers_on_the_op_by_op_path_equal_the_fused_path(
    cls: type[ProjectedAdam], convention: str, weight_decay: float
) -> None:
    # Ten steps (refreshes at steps 1, 4, 7, 10) of a tall and a wide projected matrix and a
    # plain-AdamW vector, with each path forced; fused=True raises where the kernel cannot run,
    # so the first run really took the fused path.
    runs = []
    for fused in (True, False):
        gen = torch.Generator().manual_seed(0)
        params = [
            torch.nn.Parameter(0.02 * torch.randn(s, generator=gen)) for s in [(24, 16), (12, 20), (7,)]
        ]
        groups = [{"params": params[:2], "rank": 4, "update_proj_gap": 3}, {"params": params[2:]}]
        opt = cls(groups, lr=1e-2, weight_decay=weight_decay, adam_convention=convention, fused=fused)
        for t in range(10):
            gen = torch.Generator().manual_seed(100 + t)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs.append([p.detach().clone() for p in params])
    for fused, plain in zip(*runs):
        assert not torch.equal(fused, plain), "the two paths should differ by rounding somewhere"
        torch.testing.assert_close(fused, plain, rtol=RTOL, atol=RTOL * float(plain.abs().max()))


def test_forcing_the_fused_kernel_where_it_cannot_run_is_an_error() -> None:
    m, v, x = torch.zeros(6, 4), torch.zeros(6, 4), torch.randn(6, 4)
    with pytest.raises(ValueError, match="fused Adam needs bias correction"):
        adam_update(m, v, x, 1, _group("reference", correct_bias=False), fused=True)
    with pytest.raises(ValueError, match="contiguous"):
        adam_update(m, v, torch.randn(4, 6).t(), 1, _group("reference"), fused=True)


def test_default_takes_the_fused_path_where_it_applies_and_op_by_op_elsewhere() -> None:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    for group, expected in ((_group("torch"), True), (_group("torch", correct_bias=False), False)):
        results = {}
        for fused in (None, expected):
            m, v = torch.full((6, 4), 0.1), torch.full((6, 4), 0.2)
            n, eta = adam_update(m, v, x, 3, group, fused=fused)
            results[fused] = (n, m, v, eta)
        auto, forced = results[None], results[expected]
        # Bitwise exactly when the default took the forced path: then the same kernels ran.
        assert all(torch.equal(a, b) for a, b in zip(auto[:3], forced[:3])) and auto[3] == forced[3]


class _BackOnly(ProjectedAdam):
    """A method written as nothing but the required hook: W <- W - eta_t back(N)."""

    def _projected_update(self, s: ProjectedStep) -> tuple[Direction, float]:
        return s.back(s.norm), float(s.group["scale"])


def test_one_hook_makes_a_method() -> None:
    # GaLore's hook returns the factor pair (N, P) applied by addmm_; the toy one materialises
    # back(N) = N P: the same rule, up to where rounding happens.
    runs = []
    for cls in (GaLoreAdamW, _BackOnly):
        gen = torch.Generator().manual_seed(1)
        params = [torch.nn.Parameter(0.02 * torch.randn(s, generator=gen)) for s in [(24, 16), (12, 20)]]
        opt = cls([{"params": params, "rank": 4, "update_proj_gap": 2, "scale": 0.5}], lr=1e-2)
        for t in range(5):
            gen = torch.Generator().manual_seed(200 + t)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs.append(params)
    for ours, toy in zip(*runs):
        torch.testing.assert_close(ours.detach(), toy.detach(), rtol=1e-5, atol=1e-7)
    w = torch.nn.Parameter(torch.zeros(6, 4))
    w.grad = torch.ones(6, 4)
    with pytest.raises(NotImplementedError, match="_projected_update"):
        ProjectedAdam([{"params": [w], "rank": 2}]).step()


class _Fp64Moments(AdamMoments):
    """Moment storage in float64 whatever the parameter dtype (8 bytes per entry each)."""

    def init(self, state: dict[str, Any], p: torch.Tensor, shape: Any, group: dict[str, Any]) -> None:
        for key in (EXP_AVG, EXP_AVG_SQ):
            state[key] = torch.zeros(tuple(p.shape) if shape is None else shape, dtype=torch.float64)

    def update(
        self, state: dict[str, Any], x: torch.Tensor, group: dict[str, Any]
    ) -> tuple[torch.Tensor, float]:
        norm, eta = super().update(state, x.double(), group)
        return norm.to(x.dtype), eta

    @classmethod
    def nbytes(
        cls, numel: int, dtype: torch.dtype, group: dict[str, Any], shape: tuple[int, ...] | None = None
    ) -> int:
        return 2 * 8 * numel


class _GaLoreFp64(GaLoreAdamW):
    MOMENTS: ClassVar[type[AdamMoments]] = _Fp64Moments


def test_moment_storage_is_one_class_attribute() -> None:
    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(24, 16), (7,)]]
    opt = _GaLoreFp64([{"params": params[:1], "rank": 4}, {"params": params[1:]}], lr=1e-2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    for p, group in zip(params, opt.param_groups):
        state = opt.state[p]
        assert state[EXP_AVG].dtype == state[EXP_AVG_SQ].dtype == torch.float64
        measured = sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        assert measured == _GaLoreFp64.state_bytes(tuple(p.shape), group, p.dtype)
    # 24 x 16 at rank 4, right side: fp64 moments 24 x 4 each plus an fp32 4 x 16 basis.
    assert _GaLoreFp64.state_bytes((24, 16), {"rank": 4}, torch.float32) == 2 * 8 * 96 + 4 * 64


@pytest.mark.parametrize("cls", [GaLoreAdamW, FiraAdamW, APOLLOAdamW])
def test_a_negative_scale_is_rejected_by_every_projected_method(cls: type[ProjectedAdam]) -> None:
    w = torch.nn.Parameter(torch.zeros(6, 4))
    with pytest.raises(ValueError, match=">= 0"):
        cls([{"params": [w], "rank": 2, cls.SCALE_KEY: -1.0}])

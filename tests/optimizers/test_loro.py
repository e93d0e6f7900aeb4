"""Claims about optimizers.loro.LOROAdamW (LORO, Mo et al., ICLR 2025) beyond the contract
(test_contract.py): the exact step against a dense reference written from the paper, the lazy
step against textbook Adam, the exact-step schedule with the restarts' state refresh, exact
resume across an exact step, the state formula on pairs, and how the toolkit builds its groups."""

from __future__ import annotations

import harness
import pytest
import torch
from _common import assert_resumed_from
from harness import roundtrip, state_bytes_of

import optimizers
from optimizers import Restarts
from optimizers.loro import LOROAdamW, riemannian_step

#: How the contract runs "loro". Its generic parameters are no (B, A) pairs (a 24 x 16 and a
#: 12 x 20 matrix do not chain), so the contract runs LORO's plain groups, which are Adam in LORO's
#: convention, and reduces them to torch.optim.AdamW; the pair path (lazy and exact steps) is
#: checked by the tests below: determinism, resume across an exact step, state bytes.
CONTRACT = harness.Case(
    reduces=(
        harness.Reduction("torch_convention", {"lr": 1e-2, "eps": 1e-6}, {"adam_convention": "torch"}),
        harness.Reduction(
            "torch_convention_decay",
            {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.1},
            {"adam_convention": "torch"},
        ),
        harness.Reduction(
            "reference_convention_eps0", {"lr": 1e-3, "eps": 0.0, "weight_decay": 0.01}, std=0.02
        ),
    ),
)

M, N, R = 64, 48, 8


def _pair(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    B = torch.randn(M, R, generator=gen) / R**0.5
    A = torch.randn(R, N, generator=gen) / N**0.5
    return torch.nn.Parameter(B.to(dtype)), torch.nn.Parameter(A.to(dtype))


def _dense_reference(W: torch.Tensor, G: torch.Tensor, lr: float, r: int) -> torch.Tensor:
    """The paper's exact step on the dense matrix (fp64): W = U S V^T of rank r, the tangent-space
    projection P(G) = U U^T G + G V V^T - U U^T G V V^T, then the rank-r truncated SVD of W - lr P(G)."""
    U, _, Vh = torch.linalg.svd(W, full_matrices=False)
    U, V = U[:, :r], Vh[:r].T
    PU, PV = U @ U.T, V @ V.T
    stepped = W - lr * (PU @ G + G @ PV - PU @ G @ PV)
    U2, S2, Vh2 = torch.linalg.svd(stepped, full_matrices=False)
    return U2[:, :r] @ torch.diag(S2[:r]) @ Vh2[:r]


@pytest.mark.parametrize("lr", [1e-3, 0.1, 1.0])
def test_exact_step_equals_the_dense_tangent_projection_and_truncated_svd(lr: float) -> None:
    B, A = _pair()
    G = torch.randn(M, N, generator=torch.Generator().manual_seed(5))
    dB, dA = G @ A.detach().T, B.detach().T @ G  # the factor gradients of a loss with dL/dW = G
    new_B, new_A = riemannian_step(B, A, dB, dA, lr)
    want = _dense_reference((B @ A).double().detach(), G.double(), lr, R)
    got = (new_B @ new_A).double()
    assert new_B.shape == (M, R) and new_A.shape == (R, N)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    # The retraction's split is the balanced one: B^T B = A A^T = diag(S).
    gram_B, gram_A = new_B.T @ new_B, new_A @ new_A.T
    assert torch.allclose(gram_B, gram_A, atol=1e-5 * float(gram_B.abs().max()))
    off = gram_B - torch.diag(torch.diagonal(gram_B))
    assert float(off.abs().max()) <= 1e-5 * float(gram_B.abs().max())


def test_exact_step_moves_only_along_the_manifold() -> None:
    """A gradient normal to the tangent space (U_perp X V_perp^T) leaves W where it is."""
    B, A = _pair()
    U, _, Vh = torch.linalg.svd((B @ A).detach().double())
    U_perp, V_perp = U[:, R:], Vh[R:].T
    G = (U_perp @ torch.randn(M - R, N - R, dtype=torch.float64) @ V_perp.T).float()
    new_B, new_A = riemannian_step(B, A, G @ A.detach().T, B.detach().T @ G, 0.5)
    W = (B @ A).detach()
    assert float((new_B @ new_A - W).abs().max()) <= 1e-5 * float(W.abs().max())


def _adam_direction(g: torch.Tensor, betas=(0.9, 0.999), eps=1e-6) -> tuple[torch.Tensor, float]:
    """Adam's first step in LORO's convention: N = M / (sqrt(V) + eps), and the factor
    sqrt(1 - beta2) / (1 - beta1) of the step size."""
    m, v = (1 - betas[0]) * g, (1 - betas[1]) * g * g
    return m / (v.sqrt() + eps), (1 - betas[1]) ** 0.5 / (1 - betas[0])


def _set_pair_grads(B: torch.Tensor, A: torch.Tensor, t: int) -> None:
    gen = torch.Generator().manual_seed(100 + t)
    G = torch.randn(M, N, generator=gen) * 0.1
    B.grad = (G @ A.detach().float().T).to(B.dtype)
    A.grad = (B.detach().float().T @ G).to(A.dtype)


def test_an_exact_step_is_the_riemannian_step_of_the_adam_directions() -> None:
    """As LORO's code: the exact step takes the pair's Adam directions and the bias-corrected step size."""
    B, A = _pair()
    B0, A0 = B.detach().clone(), A.detach().clone()
    opt = LOROAdamW([{"params": [B, A], "factor_pairs": True}], lr=0.05, exact_every=1)
    _set_pair_grads(B, A, 0)
    (nB, c), (nA, _) = _adam_direction(B.grad), _adam_direction(A.grad)
    want_B, want_A = riemannian_step(B0, A0, nB, nA, 0.05 * c)
    opt.step()
    # fp32 rounding of the two Adam computations, through the QRs and the SVD: 1e-5 of the entries.
    for got, want in ((B, want_B), (A, want_A)):
        assert float((got.detach() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert not torch.allclose(B.detach(), B0, atol=1e-3)


def test_a_lazy_step_is_adam_at_the_scaled_learning_rate() -> None:
    """Between exact steps each factor is Adam at lr r / min(m, n) (LORO's lr_scaler -1: r / d_model)."""
    B, A = _pair()
    ref = [B.detach().clone(), A.detach().clone()]
    states = [{"m": torch.zeros_like(p), "v": torch.zeros_like(p), "k": 0} for p in ref]
    opt = LOROAdamW(
        [{"params": [B, A], "factor_pairs": True}], lr=1e-2, adam_convention="torch", exact_every=100
    )
    for t in range(4):
        _set_pair_grads(B, A, t)
        for w, g, st in zip(ref, (B.grad, A.grad), states):
            st["k"] += 1
            harness.reference_adamw_step(w, g, st, 1e-2, (0.9, 0.999), 1e-6, 0.0, lr_mult=R / min(M, N))
        opt.step()
        assert torch.allclose(B.detach(), ref[0], atol=1e-7) and torch.allclose(A.detach(), ref[1], atol=1e-7)


def _loro_run(dtype: torch.dtype = torch.float32, every: int = 3):
    """A pair, a vector and a dense matrix, LORO wrapped in the toolkit's restarts (refresh every K)."""
    B, A = _pair(dtype=dtype)
    extra = [p.to(dtype) for p in harness.make_params(((10, 7), (7,)))]
    extra = [torch.nn.Parameter(p.detach()) for p in extra]
    groups = [{"params": [B, A], "factor_pairs": True}, {"params": extra, "weight_decay": 0.0}]
    opt = Restarts(
        LOROAdamW(groups, lr=1e-2, exact_every=every), [], every, refactorize=False, reset_momentum=True
    )
    return opt, [B, A, *extra]


def _steps(opt, params, start: int, stop: int) -> None:
    for t in range(start, stop):
        _set_pair_grads(params[0], params[1], t)
        for p, g in zip(params[2:], harness.make_grads([tuple(p.shape) for p in params[2:]], t)):
            p.grad = g.to(p.dtype)
        opt.step()


def test_exact_steps_follow_k_and_the_restarts_refresh_adam_but_not_the_schedule() -> None:
    opt, params = _loro_run(every=3)
    B, A = params[:2]
    inner = opt.optimizer
    for t in range(7):
        before = (B @ A).detach().clone()
        _steps(opt, params, t, t + 1)
        st = inner.state[B]
        assert st["loro_step"] == t + 1
        exact = (t + 1) % 3 == 0
        assert st["step"] == (0 if exact else (t + 1) % 3), t  # refreshed right after an exact step
        if exact:  # the exact step leaves the balanced split
            gram_B, gram_A = B.detach().T @ B.detach(), A.detach() @ A.detach().T
            assert torch.allclose(gram_B, gram_A, atol=1e-5 * float(gram_B.abs().max()))
        assert not torch.equal(before, (B @ A).detach())
    assert opt.num_restarts == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_resume_across_an_exact_step_is_bitwise_exact(dtype: torch.dtype) -> None:
    """Saved after 2 updates (weights_only), resumed, and run through the exact steps at 3 and 6.
    Bitwise: the resumed run executes the same kernels in the same order as the straight one."""
    opt, straight = _loro_run(dtype)
    _steps(opt, straight, 0, 2)
    saved = roundtrip(opt.state_dict())
    resumed_values = [p.detach().clone() for p in straight]
    _steps(opt, straight, 2, 7)
    opt2, resumed = _loro_run(dtype)
    with torch.no_grad():
        for p, v in zip(resumed, resumed_values):
            p.copy_(v)
    opt2.load_state_dict(saved)
    _steps(opt2, resumed, 2, 7)
    harness.assert_same(straight, resumed, what="resumed across an exact step")
    for p, q in zip(straight, resumed):
        harness.assert_same_state(opt2.state[q], opt.state[p])
    assert opt2.num_restarts == 2 and opt2.state[resumed[0]]["loro_step"] == 7


def test_two_runs_are_bitwise_equal() -> None:
    """The same code twice: the same kernels in the same order."""
    finals = []
    for _ in range(2):
        opt, params = _loro_run()
        _steps(opt, params, 0, 7)
        finals.append([p.detach().clone() for p in params])
    harness.assert_same(*finals, what="second run")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_bytes_equal_the_formula(dtype: torch.dtype) -> None:
    opt, params = _loro_run(dtype)
    _steps(opt, params, 0, 4)
    spec = optimizers.method_spec("loro")
    total = 0
    for group in opt.param_groups:
        for p in group["params"]:
            real = state_bytes_of(opt, p)
            assert real == spec.state_bytes(tuple(p.shape), group, dtype) == 2 * p.numel() * dtype.itemsize
            total += real
    assert optimizers.measured_state_bytes(opt) == total
    assert set(opt.state[params[0]]) == {"step", "exp_avg", "exp_avg_sq", "loro_step"}


def test_first_step_on_zero_gradients_only_allocates_state() -> None:
    """A checkpoint loader's dummy step: state allocated, nothing moved, nothing counted. Bitwise:
    the allocated (zero) state is stepped by the same kernels as a fresh optimizer's."""
    opt, params = _loro_run()
    fresh_opt, fresh = _loro_run()
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    harness.assert_same(params, fresh, what="after the dummy step")
    assert opt.state[params[0]]["loro_step"] == 0 and opt.num_steps == 0
    _steps(opt, params, 0, 4)
    _steps(fresh_opt, fresh, 0, 4)
    harness.assert_same(params, fresh, what="after a dummy first step")


def test_pair_groups_are_validated() -> None:
    B, A = _pair()
    with pytest.raises(ValueError, match="even number"):
        LOROAdamW([{"params": [B, A, torch.nn.Parameter(B.detach().clone())], "factor_pairs": True}])
    with pytest.raises(ValueError, match="B \\(m x r\\) and A \\(r x n\\)"):
        LOROAdamW([{"params": [A, B], "factor_pairs": True}])
    with pytest.raises(ValueError, match="exact_every"):
        LOROAdamW([B], exact_every=0)


def test_exact_step_transient_formula_worked_value() -> None:
    m, n, r = 2048, 5461, 512
    got = optimizers.method_spec("loro").pair_step_transient_bytes(m, n, r, torch.bfloat16)
    assert got == 2 * 2 * r * (m + n) + 4 * (9 * r * (m + n) + 24 * r * r)
    assert optimizers.method_spec("adamw").pair_step_transient_bytes(m, n, r, torch.bfloat16) == 0


# ----------------------------------------------------------------------------- the toolkit


def _tiny_recipe() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "loro.yaml")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("factor.kind=none", "steps the (B, A) factor pairs of a factorized model"),
        ("factor.kind=relora", "steps the (B, A) factor pairs of a factorized model"),
        ("restarts.every=0", "takes its exact_every from restarts.every"),
        ("optim.extra.exact_every=7", "optim.extra.exact_every would disagree with restarts.every"),
    ],
)
def test_train_refuses_loro_without_pairs_or_period_exit_2_one_line(tmp_path, capsys, override, needle):
    from effpretrain import cli

    rc = cli.main(["train", _tiny_recipe(), "--set", override, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err
    assert not (tmp_path / "run").exists()


def test_the_trainer_gives_loro_every_factor_pair_and_the_restart_period() -> None:
    from effpretrain.config import load_config
    from effpretrain.models import apply_factorization, build_model, factor_pairs
    from effpretrain.optim_setup import build_optimizer_and_schedule

    cfg = load_config(_tiny_recipe())
    model = build_model(cfg.model.preset)
    f = cfg.factor
    apply_factorization(model, f.kind, f.rank, f.alpha, f.targets)
    opt, _ = build_optimizer_and_schedule(model, cfg)
    assert isinstance(opt, Restarts) and opt.every == cfg.restarts.every and not opt.refactorize
    inner = opt.optimizer
    assert isinstance(inner, LOROAdamW)
    paired = [g for g in inner.param_groups if g["factor_pairs"]]
    assert len(paired) == 1 and paired[0]["exact_every"] == cfg.restarts.every
    want = [p for pair in factor_pairs(model) for p in pair]
    assert [id(p) for p in paired[0]["params"]] == [id(p) for p in want]
    others = {id(p) for g in inner.param_groups if not g["factor_pairs"] for p in g["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert others == trainable - {id(p) for p in want}


def test_estimated_peak_matches_measured_across_an_exact_step() -> None:
    """The tiny recipe with an exact step in the measured steps (restarts.every = 2): weights,
    gradients and state exact, the peak (the optimizer step) within 5%."""
    from effpretrain.config import load_config
    from effpretrain.memory import estimate_from_config
    from effpretrain.memory.measure import measure_run

    over = ["train.batch_size=1", "data.seq_len=16", "restarts.every=2", "data.shuffle_buffer=0"]
    cfg = load_config(_tiny_recipe(), over)
    est = estimate_from_config(cfg, cfg.data.vocab_size)
    measured = max(measure_run(cfg, cfg.data.vocab_size, 2), key=lambda r: r["peak"])
    assert (measured["weights"], measured["gradients"]) == (est.weights, est.grads)
    assert measured["optimizer_state"] == est.optimizer_state
    assert est.detail["peak_phase"] == measured["phase_at_peak"] == "optimizer_step"
    assert measured["peak"] == pytest.approx(est.peak, rel=0.05)


def test_trainer_resume_across_an_exact_step_is_bitwise_exact(tmp_path, tiny_overrides) -> None:
    """The trainer resumed from step 2's checkpoint crosses the exact steps (and refreshes) at 3
    and 6 and ends on the straight run's weights, bit for bit (the resumed run executes the same
    kernels in the same order as the straight one)."""
    from safetensors.torch import load_file

    from effpretrain.config import load_config
    from effpretrain.trainer import train

    over = [
        *tiny_overrides,
        "train.max_steps=6",
        "train.eval_every=6",
        "train.save_every=2",
        "train.keep_checkpoints=3",
        "restarts.every=3",
        "train.log_every=1",
    ]
    straight = train(load_config(_tiny_recipe(), over), tmp_path / "straight")
    assert straight["opt/restarts"] == 2
    resumed_dir = tmp_path / "resumed"
    resumed = train(
        load_config(_tiny_recipe(), over),
        resumed_dir,
        resume=str(tmp_path / "straight" / "checkpoints" / "step-2"),
    )
    assert resumed["steps"] == 6
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step-6" / "model.safetensors"))
    b = load_file(str(resumed_dir / "checkpoints" / "step-6" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same operations, in order
    assert_resumed_from(tmp_path / "straight", resumed_dir, 2)

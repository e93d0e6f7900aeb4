"""The optimizers' matrix math runs at full fp32 whatever the process's TF32 setting (docs/gpu.md, G9):
`optimizers.precision.full_fp32` turns every TF32 (and oneDNN bf16) setting off inside and puts the
caller's back after, and each projection, orthogonalisation, whitening and refactorization entry
point runs inside it; the model's own products keep the run's setting (`train.tf32`).

No GPU here: the flags are process-wide settings that a CPU build of torch holds and reports the
same way, and cuBLAS reads them at each launch, so what the math sees is what the flags read when
it is called (recorded by a spy around an inner function).
"""

from __future__ import annotations

import pytest
import torch

from optimizers import precision
from optimizers import projection as proj


def _reset() -> None:
    """torch's defaults: legacy matmul "highest", cuDNN TF32 on, every other precision unset."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    for backend, op in [("generic", "all"), ("cuda", "all"), ("cuda", "matmul")] + [
        ("mkldnn", op) for op in ("all", "matmul", "conv", "rnn")
    ]:
        torch._C._set_fp32_precision_setter(backend, op, "none")


@pytest.fixture(autouse=True)
def _default_flags():
    _reset()
    yield
    _reset()


def _raw() -> dict:
    """Every per-backend precision torch resolves (the legacy views are derived from these)."""
    pairs = [("generic", "all")] + [
        (b, o) for b in ("cuda", "mkldnn") for o in ("all", "matmul", "conv", "rnn")
    ]
    return {f"{b}.{o}": torch._C._get_fp32_precision_getter(b, o) for b, o in pairs}


#: Ways a user turns TF32 on (the legacy flags, the legacy precision, the per-backend API).
TF32_ON = {
    "allow_tf32": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "precision_high": lambda: torch.set_float32_matmul_precision("high"),
    "precision_medium": lambda: torch.set_float32_matmul_precision("medium"),
    "matmul_fp32_precision": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    "generic_fp32_precision": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
}


def _full_fp32_inside() -> bool:
    state = precision.tf32_state()
    return (
        state["cuda_matmul_allow_tf32"] is False
        and state["cudnn_allow_tf32"] is False
        and state["matmul_precision"] == "highest"
        and all(state[f"{b}.{o}"] == "ieee" for b, o in precision._OPS)
    )


@pytest.mark.parametrize("turn_on", list(TF32_ON))
def test_full_fp32_turns_tf32_off_inside_and_restores_the_callers_setting(turn_on):
    TF32_ON[turn_on]()
    before, raw = precision.tf32_state(), _raw()
    assert before["cuda.matmul"] == "tf32"  # the caller's setting is on
    with precision.full_fp32():
        assert _full_fp32_inside()
        assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
        with precision.full_fp32():  # nested: still off, and leaving it restores nothing yet
            pass
        assert _full_fp32_inside()
    assert precision.tf32_state() == before and _raw() == raw


def test_full_fp32_restores_after_an_exception():
    TF32_ON["allow_tf32"]()
    with pytest.raises(RuntimeError), precision.full_fp32():
        raise RuntimeError("boom")
    assert torch.backends.cuda.matmul.allow_tf32 is True


def _recorder(monkeypatch, owner, name):
    """Replaces owner.name by a spy that records whether the math it wraps runs at full fp32."""
    seen: list[bool] = []
    real = getattr(owner, name)

    def spy(*a, **kw):
        seen.append(_full_fp32_inside())
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, spy)
    return seen


def _grad(m=24, n=16, seed=0):
    return torch.randn(m, n, generator=torch.Generator().manual_seed(seed))


def test_basis_and_projection_functions_run_at_fp32_under_a_tf32_caller(monkeypatch):
    TF32_ON["precision_high"]()
    inner = _recorder(monkeypatch, proj, "_randomized_left_vectors")
    proj.compute_basis(_grad(), 4, "right", "randomized_svd")
    svd = _recorder(monkeypatch, torch.linalg, "svd")
    proj.compute_basis(_grad(), 4, "right", "svd")
    mm = _recorder(monkeypatch, torch, "mm")
    basis = proj.compute_basis(_grad(), 4, "left", "svd")
    low = proj.project(_grad(), basis, "left")
    proj.project_back(low, basis, "left")
    from optimizers.golore import orthonormal_basis

    qr = _recorder(monkeypatch, torch.linalg, "qr")
    orthonormal_basis((24, 16), 4, "right", 3)
    assert inner and svd and mm and qr
    assert all(inner + svd + mm + qr)
    assert torch.backends.cuda.matmul.allow_tf32 is True  # the caller's setting is back


def test_orthogonalisation_and_whitening_run_at_fp32_under_a_tf32_caller(monkeypatch):
    from optimizers._matrix import newton_schulz_orthogonalise
    from optimizers.swan import grad_whitening

    TF32_ON["allow_tf32"]()
    addmm = _recorder(monkeypatch, torch, "addmm")
    newton_schulz_orthogonalise(_grad(), (3.4445, -4.7750, 2.0315), 2, 1e-7)
    eye = _recorder(monkeypatch, torch, "eye")
    grad_whitening(_grad(8, 16), 3)
    assert addmm and eye and all(addmm + eye)


def test_refactorization_and_loro_run_at_fp32_under_a_tf32_caller(monkeypatch):
    from optimizers import refactorization
    from optimizers.loro import riemannian_step

    TF32_ON["generic_fp32_precision"]()
    core = _recorder(monkeypatch, refactorization, "_core_svd")
    B, A = _grad(12, 4, 1), _grad(4, 10, 2)
    refactorization.refactorize_([(B, A)])
    riemannian_step(B, A, _grad(12, 4, 3), _grad(4, 10, 4), 0.1)
    assert len(core) == 2 and all(core)


def _step_records(monkeypatch, opt_cls, owner, name, groups, **kw):
    """One step of `opt_cls` with a closure, recording the precision inside `owner.name` (the
    method's math) and inside the closure (the model's)."""
    seen = _recorder(monkeypatch, owner, name)
    params = [p for g in groups for p in g["params"]]
    opt = opt_cls(groups, lr=1e-2, **kw)
    in_closure = []

    def closure():
        in_closure.append(_full_fp32_inside())
        for i, p in enumerate(params):
            p.grad = _grad(*p.shape, seed=i)
        return 0.0

    opt.step(closure)
    return seen, in_closure


@pytest.mark.parametrize("method", ["galore", "fira", "apollo", "golore", "muon", "swan", "loro"])
def test_an_optimizer_step_runs_its_math_at_fp32_and_its_closure_at_the_callers_setting(monkeypatch, method):
    import optimizers.loro
    import optimizers.muon
    import optimizers.swan
    from optimizers.apollo import APOLLOAdamW
    from optimizers.fira import FiraAdamW
    from optimizers.galore import GaLoreAdamW
    from optimizers.golore import GoLoreAdamW
    from optimizers.loro import PAIRS_KEY as PAIRS

    TF32_ON["precision_high"]()
    p = [torch.nn.Parameter(_grad(24, 16, 9)), torch.nn.Parameter(_grad(16, 24, 8))]
    projected = [{"params": p, "rank": 4, "update_proj_gap": 2}]
    cases = {
        "galore": (GaLoreAdamW, proj, "project", projected, {}),
        "fira": (FiraAdamW, proj, "project", projected, {}),
        "apollo": (APOLLOAdamW, proj, "project", projected, {}),
        "golore": (GoLoreAdamW, proj, "project", [{**projected[0], "rand_ratio": 0.0}], {}),
        "muon": (
            optimizers.muon.Muon,
            optimizers.muon,
            "newton_schulz_orthogonalise",
            [{"params": p, "matrix": True}],
            {},
        ),
        "swan": (
            optimizers.swan.SWAN,
            optimizers.swan,
            "grad_whitening",
            [{"params": p, "matrix": True}],
            {},
        ),
        "loro": (
            optimizers.loro.LOROAdamW,
            optimizers.loro,
            "riemannian_step",
            [
                {
                    "params": [torch.nn.Parameter(_grad(12, 4, 1)), torch.nn.Parameter(_grad(4, 10, 2))],
                    PAIRS: True,
                }
            ],
            {"exact_every": 1},
        ),
    }
    opt_cls, owner, name, groups, kw = cases[method]
    seen, in_closure = _step_records(monkeypatch, opt_cls, owner, name, groups, **kw)
    assert seen and all(seen), seen
    assert in_closure == [False]  # the model's forward and backward keep the caller's TF32
    assert torch.backends.cuda.matmul.allow_tf32 is True


@pytest.mark.parametrize("tf32", [True, False])
def test_train_tf32_sets_the_models_products_for_the_run_and_restores_after(monkeypatch, tmp_path, tf32):
    from _common import ROOT

    from effpretrain import trainer
    from effpretrain.config import load_config

    seen = []

    class Stub:
        def __init__(self, *a, **kw):
            pass

        def fit(self, stop):
            seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
            return {}

    monkeypatch.setattr(trainer, "Trainer", Stub)
    # The process set the opposite; the run's setting wins while it runs.
    torch.backends.cuda.matmul.allow_tf32 = not tf32
    torch.backends.cudnn.allow_tf32 = not tf32
    cfg = load_config(ROOT / "recipes" / "tiny" / "adamw.yaml", [f"train.tf32={str(tf32).lower()}"])
    trainer.train(cfg, tmp_path / "run")
    assert seen == [(tf32, tf32)]
    assert torch.backends.cuda.matmul.allow_tf32 is (not tf32) and torch.backends.cudnn.allow_tf32 is (
        not tf32
    )

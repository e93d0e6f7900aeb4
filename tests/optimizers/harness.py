"""The one optimizer-test harness: tiny parameters and gradients, training loops, weights_only round
trips, state accounting, and the optimizer contract (docs/architecture.md: the optimizer contract, house style) as check functions.

The contract checks take a registry name and a `Case` (how to run that method: its schedule, its
variants, its degenerate settings) and build param groups the way the toolkit does: the registry's
`projection_group` for the attention/MLP-like matrices of a projecting method, a decayed group for
the other matrices and an undecayed one for vectors. `CONTRACT_CHECKS` lists them once:
tests/optimizers/test_contract.py runs each for every registered method (the `Case` is the
module-level ``CONTRACT`` of that method's own tests/optimizers/test_<name>.py), and
tests/test_registry.py runs the same list (`run_contract`) on toy methods registered at run time.
Per-method test files import the helpers for their own claims (reference matches, rules).
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import io
import itertools
import math
import sys
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import optimizers
from optimizers import projection as proj

#: The reference matches' layout: a tall matrix (right side), a wide one (left side), a vector.
REF_SHAPES: tuple[tuple[int, ...], ...] = ((24, 16), (12, 20), (7,))
# A tall matrix (projected on the right side), a wide one (left side), a matrix a projecting method
# leaves dense (like an embedding), and a vector (a norm or bias: no weight decay).
SHAPES: tuple[tuple[int, ...], ...] = ((24, 16), (12, 20), (10, 7), (7,))
#: Options of the contract's projected groups (built with the registry's `projection_group`).
RANK, GAP, SCALE, SEED = 4, 3, 0.5, 3
#: The Adam settings of every contract run (each method's own defaults fill the rest).
ADAM: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.01}


# ----------------------------------------------------------------------------- tensors and loops


def make_params(
    shapes: Sequence[tuple[int, ...]] = SHAPES,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    std: float = 0.02,
) -> list[torch.nn.Parameter]:
    """Seeded parameters; std 0.02 (LLaMA init) keeps the fp32 rounding of W + dW far below the
    tolerances of the AdamW and reference comparisons."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((std * torch.randn(s, generator=gen)).to(dtype)) for s in shapes]


def make_grads(
    shapes: Sequence[tuple[int, ...]],
    t: int,
    seed: int = 1000,
    growth: float = 0.1,
    spike: tuple[int, int, float] | None = None,
) -> list[torch.Tensor]:
    """Deterministic fp32 gradients for step index `t` (from 0), one per shape.

    Args:
        shapes: the shapes, in a fixed order (one generator feeds them in turn).
        t: the step index; the generator is seeded with ``seed + t``.
        seed: base seed.
        growth: gradients are scaled by ``1 + growth t`` (growing norms make Fira's and APOLLO's
            norm-growth limiters act).
        spike: ``(every, phase, factor)``: when ``t % every == phase``, entry ``t % numel`` of each
            gradient is multiplied by `factor` (the spikes SPAM and Stable-SPAM clip).
    """
    gen = torch.Generator().manual_seed(seed + t)
    out = []
    for shape in shapes:
        g = torch.randn(shape, generator=gen) * (1.0 + growth * t)
        if spike is not None and t % spike[0] == spike[1]:
            g.view(-1)[t % g.numel()] *= spike[2]
        out.append(g)
    return out


def set_grads(params: Sequence[torch.Tensor], t: int, **grads: Any) -> None:
    """Sets ``p.grad`` to `make_grads` (`grads` are its options), in each parameter's dtype."""
    for p, g in zip(params, make_grads([tuple(p.shape) for p in params], t, **grads)):
        p.grad = g.to(p.dtype)


def run(
    opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], start: int, stop: int, **grads: Any
) -> None:
    """Steps `opt` for step indices start .. stop - 1 with `set_grads(params, t, **grads)`."""
    for t in range(start, stop):
        set_grads(params, t, **grads)
        opt.step()


def reference_groups(params: Sequence[torch.Tensor], rank: int = RANK, **keys: Any) -> list[dict[str, Any]]:
    """Groups in the reference packages' format (galore-torch, fira, apollo-torch): the first two
    params projected (``rank``, ``update_proj_gap`` `GAP`, plus `keys`), the rest plain."""
    return [
        {"params": list(params[:2]), "rank": rank, "update_proj_gap": GAP, **keys},
        {"params": list(params[2:])},
    ]


def roundtrip(obj: Any) -> Any:
    """`obj` through torch.save and torch.load(weights_only=True), as a checkpoint is."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def state_bytes_of(opt: torch.optim.Optimizer, p: torch.Tensor) -> int:
    """Bytes of the tensors `opt` holds in state for `p`."""
    return sum(v.numel() * v.element_size() for v in opt.state[p].values() if torch.is_tensor(v))


def snapshot(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    """A copy of `p`'s state (tensors cloned)."""
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}


def assert_same_state(got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    """One parameter's state, key by key: tensors bitwise, numbers equal (for the same uses as
    `assert_same`)."""
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v, k


def group_options(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """A deep copy of every param group without its params."""
    return copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


def assert_same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], what: str = "") -> None:
    """Bitwise equality, tensor by tensor. Only for two sides that run the same operations in the
    same order (the same run twice, a resume, a no-op, code written op for op as a reference's);
    each caller says which. Other comparisons take a tolerance (`run_beside`)."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), (
            f"{what}: tensor {i} differs by {float((x.detach().float() - y.detach().float()).abs().max())}"
        )


def run_beside(
    opt: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    ref_opt: torch.optim.Optimizer,
    ref_params: Sequence[torch.Tensor],
    steps: int,
    *,
    tol: float = 1e-5,
    relative_to: str = "moved",
    after: Callable[[int], None] | None = None,
    **grads: Any,
) -> None:
    """A reference match: steps ours and a reference optimizer on the same gradients (`set_grads`
    with `grads`); after every step each of ours is within `tol` (max-abs) of the reference's
    tensor, relative to how far the reference has moved from its start (``"moved"``) or to the
    reference's largest entry (``"weights"``). ``after(t)`` adds the caller's per-step checks."""
    start = [p.detach().clone() for p in ref_params]
    for t in range(steps):
        set_grads(params, t, **grads)
        set_grads(ref_params, t, **grads)
        opt.step()
        ref_opt.step()
        for i, (a, b, b0) in enumerate(zip(params, ref_params, start, strict=True)):
            a, b = a.detach(), b.detach()
            scale = (b - b0) if relative_to == "moved" else b
            assert float((a - b).abs().max()) <= tol * float(scale.abs().max()), f"step {t + 1}, tensor {i}"
        if after is not None:
            after(t)


def assert_projected_defaults(opt: torch.optim.Optimizer, scale_key: str = "scale") -> None:
    """`opt` was built over `reference_groups` with only ``lr=1e-2``: the projected group records
    the GaLore-family defaults (std sides, scale 1, randomized SVD, the reference Adam settings),
    the plain group no projection keys."""
    g0, g1 = opt.param_groups
    assert g0["project"] is True and g1["project"] is False
    assert g0["proj_type"] == "std" and g0[scale_key] == 1.0 and g0["basis"] == "randomized_svd"
    assert "rank" not in g1 and "update_proj_gap" not in g1
    adam = ("lr", "betas", "eps", "weight_decay", "correct_bias")
    assert tuple(g0[k] for k in adam) == (1e-2, (0.9, 0.999), 1e-6, 0.0, True)


def saved_projected_state(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The first parameter's state after two steps and a weights_only round trip of the state
    dict; its counters (``step``, ``refresh``, ``seed``) are checked to be python ints."""
    run(opt, params, 0, 2)
    st = roundtrip(opt.state_dict())["state"][0]
    assert all(type(st[k]) is int for k in ("step", "refresh", "seed"))
    return st


def step_with(opt: torch.optim.Optimizer, p: torch.Tensor, grads: Sequence[torch.Tensor | float]) -> None:
    """One step per entry of `grads` on the single parameter `p` (a number: a constant gradient)."""
    for g in grads:
        p.grad = g if torch.is_tensor(g) else torch.full_like(p, float(g))
        opt.step()


def reference_adamw_step(
    w: torch.Tensor,
    g: torch.Tensor,
    st: dict[str, Any],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    lr_mult: float = 1.0,
) -> None:
    """Textbook decoupled AdamW for the rule transcriptions (written independently of the code
    under test): ``st`` holds ``m``, ``v`` and the Adam step ``k`` (already advanced)."""
    b1, b2 = betas
    w.mul_(1 - lr * weight_decay)
    st["m"] = b1 * st["m"] + (1 - b1) * g
    st["v"] = b2 * st["v"] + (1 - b2) * g * g
    mh = st["m"] / (1 - b1 ** st["k"])
    vh = st["v"] / (1 - b2 ** st["k"])
    w -= lr * lr_mult * mh / (vh.sqrt() + eps)


def least_squares_losses(
    make_opt: Callable[[torch.nn.Parameter, torch.nn.Parameter], torch.optim.Optimizer],
    steps: int,
    out_features: int = 24,
    in_features: int = 20,
    batch: int = 64,
    seed: int = 7,
    target_rank: int | None = None,
) -> list[float]:
    """Losses of ``mean((x W^T + b - y)^2)`` from W = 0, b = 0, with y from a random W*.

    Args:
        make_opt: builds the optimizer over (W, b).
        steps: optimizer steps (one loss each, taken before the step).
        out_features, in_features: the shape of W.
        batch: rows of x.
        seed: seeds x and W*.
        target_rank: the rank of W* (full when None). A rank-r W* keeps every gradient in one
            r-dimensional row space, which a rank-r projection captures.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, in_features, generator=gen)
    if target_rank is None:
        w_star = torch.randn(out_features, in_features, generator=gen)
    else:
        w_star = torch.randn(out_features, target_rank, generator=gen) @ torch.randn(
            target_rank, in_features, generator=gen
        )
    y = x @ w_star.t()
    w = torch.nn.Parameter(torch.zeros(out_features, in_features))
    b = torch.nn.Parameter(torch.zeros(out_features))
    opt = make_opt(w, b)
    losses = []
    for _ in range(steps):
        # The gradients in closed form (autograd would cost more than the tiny step itself):
        # with r = x W^T + b - y, dL/dW = 2 r^T x / (B m) and dL/db = 2 sum_rows(r) / (B m).
        r = x @ w.detach().t() + b.detach() - y
        losses.append(float((r**2).mean()))
        w.grad = (2.0 / r.numel()) * (r.t() @ x)
        b.grad = (2.0 / r.numel()) * r.sum(0)
        opt.step()
    return losses


def reference_module(package: str, module: str) -> types.ModuleType:
    """Imports `package.module` of a reference package without running the package's __init__.

    galore_torch/__init__ imports its 8-bit class and with it bitsandbytes (10-20 s on a small CPU
    box); its AdamW and its projector need neither.
    """
    name = f"{package}.{module}"
    if name in sys.modules or package in sys.modules:
        return importlib.import_module(name)
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.fail(
            f"{package} is not installed: the reference tests need the dev extras (pip install -e '.[dev]')"
        )
    shell = types.ModuleType(package)
    shell.__path__ = list(spec.submodule_search_locations or [])
    sys.modules[package] = shell
    try:
        return importlib.import_module(name)
    finally:
        # A later real `import package` runs __init__ and reuses the submodules loaded here.
        if sys.modules.get(package) is shell:
            del sys.modules[package]


# ----------------------------------------------------------------------------- the contract table


@dataclass(frozen=True)
class Variant:
    """One configuration the contract runs a method in.

    Attributes:
        basis: the projected groups' ``basis`` (``"default"``: the class's own).
        kwargs: extra constructor keywords (e.g. ``min_8bit_size``, ``random_stream``).
    """

    basis: str = "default"
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reduction:
    """Degenerate settings under which a method is torch.optim.AdamW, step for step.

    Attributes:
        label: what the settings are (the test id).
        adam: lr, betas, eps, weight_decay: given to both optimizers (the vector group keeps 0 decay).
        kwargs: keywords for ours only (features switched off, the convention).
        basis: for a projecting method, the projected groups' basis, at full rank k = min(m, n) (one
            group per matrix) and scale 1.
        tol: the largest absolute difference allowed after every step.
        steps: how many steps are compared.
        std: the initial weights' scale (fp32 rounding of W + dW grows with it; a second-order
            difference such as the decay order needs small weights to stay below `tol`).
    """

    label: str
    adam: Mapping[str, Any]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    basis: str | None = None
    tol: float = 1e-6
    steps: int = 25
    std: float = 1.0


@dataclass(frozen=True)
class Case:
    """How the contract runs one registered method (test-only knowledge, keyed by registry name).

    Attributes:
        reduces: its `Reduction`s to AdamW, or ``"does not reduce: <reason>"``.
        kwargs: constructor keywords of every contract run (on top of `ADAM`), e.g. a short reset
            interval so that the runs cross a reset.
        variants: named configurations run by determinism, resume and state-bytes checks; the
            first one also runs the loss check.
        grads: `set_grads` options (spikes for the spike-clipping methods).
        split: resume checkpoints after this many steps; the resumed half must cross a schedule
            event (a basis refresh, on steps 1, GAP + 1, 2 GAP + 1, ...; or a momentum reset).
            The default, GAP + 2, resumes mid-period: the loaded basis is used as it is for a step,
            then the refresh at 2 GAP + 1 starts from the loaded counters (and warm start).
        steps: length of the determinism and resume runs (and the run length, ``total_steps``, for
            methods that need it).
        loss_lr: learning rate of the loss check.
        loss_steps: steps of the loss check, which must end below `loss_below` of the first loss.
        loss_below: that fraction (5%); a method whose update cannot reach the least-squares
            solution says why it needs more (SWAN: its update has zero row mean).
        state_keys: keys every parameter's state must hold (torch's names unless the class is
            another package's, unchanged).
    """

    reduces: tuple[Reduction, ...] | str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    variants: Mapping[str, Variant] = field(default_factory=lambda: {"default": Variant()})
    grads: Mapping[str, Any] = field(default_factory=dict)
    split: int = GAP + 2
    steps: int = 2 * GAP + 1
    loss_lr: float = 0.2
    loss_steps: int = 30
    loss_below: float = 0.05
    state_keys: tuple[str, ...] = ("step", "exp_avg", "exp_avg_sq")


# Building blocks of the methods' CONTRACTs (shared by the test files of related methods).

#: torch.optim.AdamW settings for the reductions of the non-projecting methods.
ADAMW_SETTINGS: dict[str, Any] = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
# Identity basis at full rank, scale 1: the projection is exact, so the torch convention is
# torch.optim.AdamW; the reference convention differs from it only in where eps enters and in the
# order of weight decay (eta_t eta lambda |D| per step: ~1e-8 at lr 1e-3), so it is AdamW at eps 0.
PROJECTED_ADAM: tuple[Reduction, ...] = (
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
#: The bases of the SVD-based projecting methods (GaLore, Fira), each a contract variant.
SVD_FAMILY: dict[str, Variant] = {
    "randomized_svd": Variant("randomized_svd"),
    "svd": Variant("svd"),
    "random": Variant("random"),
}
#: APOLLO's two random streams (its own "mix" default and apollo-torch's seed chain).
APOLLO_STREAMS: dict[str, Variant] = {
    "mix": Variant(),
    "apollo_torch_stream": Variant(kwargs={"random_stream": "apollo_torch"}),
}


def param_groups(
    name: str,
    matrices: Sequence[torch.Tensor],
    dense: Sequence[torch.Tensor],
    vectors: Sequence[torch.Tensor],
    *,
    basis: str = "default",
    weight_decay: float = ADAM["weight_decay"],
) -> list[dict[str, Any]]:
    """The toolkit's groups for method `name`: `matrices` projected (the registry's
    `projection_group`) when the method projects, in a whole-matrix group (`matrix_group`) for a
    whole-matrix method, decayed otherwise; `dense` decayed (a "head" matrix group for a method
    that takes every matrix); `vectors` undecayed."""
    spec = optimizers.method_spec(name)
    groups: list[dict[str, Any]] = []
    if spec.projects:
        opts = spec.projection_group(
            rank=RANK, update_proj_gap=GAP, scale=SCALE, basis=basis, extra={"seed": SEED}
        )
        groups.append({"params": list(matrices), "weight_decay": weight_decay, **opts})
        decayed = list(dense)
    elif spec.matrix_params is not None:
        # A whole-matrix method (the registry's `matrix_role`): `matrices` as hidden weights, and
        # `dense` as the head (its own role) where the method takes every matrix (SCALE).
        decayed = list(dense)
        for params, role in (
            (matrices, spec.matrix_role(target=True, embedding=False, ndim=2)),
            (dense, spec.matrix_role(target=False, embedding=False, ndim=2)),
        ):
            if params and role is not None:
                groups.append(
                    {"params": list(params), "weight_decay": weight_decay, **spec.matrix_group(role)}
                )
                decayed = [] if params is dense else decayed
    else:
        decayed = [*matrices, *dense]
    if decayed:
        groups.append({"params": decayed, "weight_decay": weight_decay})
    if vectors:
        groups.append({"params": list(vectors), "weight_decay": 0.0})
    return groups


def constructor_kwargs(name: str, case: Case, variant: str) -> dict[str, Any]:
    """The keywords the contract passes: `ADAM`, the case's, the variant's, completed by the
    registry (method defaults, the run length)."""
    kw = {**ADAM, **case.kwargs, **case.variants[variant].kwargs}
    return optimizers.method_spec(name).constructor_kwargs(kw, total_steps=case.steps)


def build(name: str, params: Sequence[torch.Tensor], case: Case, variant: str) -> torch.optim.Optimizer:
    """Method `name` over `params` (laid out as `SHAPES`) in `variant`, as the toolkit builds it."""
    groups = param_groups(name, params[:2], params[2:3], params[3:], basis=case.variants[variant].basis)
    return optimizers.build_optimizer(name, groups, **constructor_kwargs(name, case, variant))


def _run_case(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], case: Case, start: int, stop: int):
    run(opt, params, start, stop, **case.grads)


# ----------------------------------------------------------------------------- contract checks


def check_case(name: str, case: Case) -> None:
    """The case decides whether the method reduces to AdamW: `Reduction` rows, or
    ``"does not reduce: <reason>"`` with a reason; and it names at least one variant."""
    if isinstance(case.reduces, str):
        assert (
            case.reduces.startswith("does not reduce: ") and case.reduces[len("does not reduce: ") :].strip()
        ), f"{name}: reduces={case.reduces!r} must read 'does not reduce: <reason>'"
    else:
        assert case.reduces and all(isinstance(r, Reduction) for r in case.reduces), (
            f"{name}: reduces must be Reduction rows or 'does not reduce: <reason>'"
        )
    assert case.variants, f"{name}: a case needs at least one variant"


def check_determinism(name: str, case: Case, variant: str) -> None:
    """Two runs from the same seeds are bitwise equal (the same code twice: the same kernels in
    the same order)."""
    finals = []
    for _ in range(2):
        params = make_params()
        _run_case(build(name, params, case, variant), params, case, 0, case.steps)
        finals.append([p.detach().clone() for p in params])
    assert_same(*finals, what=f"{name}/{variant}: second run")


def check_resume(name: str, case: Case, variant: str, dtype: torch.dtype = torch.float32) -> None:
    """A run checkpointed after `split` steps (torch.save of its state dict, loaded with
    weights_only into a fresh optimizer over fresh copies of the weights) and finished from there
    is bitwise the straight run, across the schedule event after the split; every state tensor
    keeps its saved dtype. Bitwise: the resumed run executes the same kernels in the same order as
    the straight one, on the saved values."""
    straight = make_params(dtype=dtype)
    opt = build(name, straight, case, variant)
    _run_case(opt, straight, case, 0, case.split)
    saved = roundtrip(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in straight]
    _run_case(opt, straight, case, case.split, case.steps)
    opt2 = build(name, resumed, case, variant)
    opt2.load_state_dict(saved)
    for p, q in zip(straight, resumed):
        want = {k: v.dtype for k, v in opt.state[p].items() if torch.is_tensor(v)}
        assert {k: v.dtype for k, v in opt2.state[q].items() if torch.is_tensor(v)} == want
    _run_case(opt2, resumed, case, case.split, case.steps)
    assert_same(straight, resumed, what=f"{name}/{variant}: resumed after {case.split} steps")
    for p, q in zip(straight, resumed):  # the counters (step, refresh, seeds) and tensors too
        assert_same_state(opt2.state[q], opt.state[p])
    if optimizers.method_spec(name).projects:
        assert opt2.refresh_count > 0, "the resumed half must refresh the basis"


def check_state_bytes(name: str, case: Case, variant: str, dtype: torch.dtype = torch.float32) -> None:
    """The registry formula ``METHODS[name].state_bytes(shape, group, dtype)`` is the real state:
    per parameter (with the group as recorded, and as the plain dict the toolkit built), and
    summed (`optimizers.measured_state_bytes`)."""
    spec = optimizers.method_spec(name)
    params = make_params(dtype=dtype)
    opt = build(name, params, case, variant)
    built = param_groups(name, params[:2], params[2:3], params[3:], basis=case.variants[variant].basis)
    plain_kw = {k: v for k, v in constructor_kwargs(name, case, variant).items() if k not in ADAM}
    _run_case(opt, params, case, 0, 2)
    shared = _shared_state_tensors(opt)
    total, shared_want = 0, 0
    for group, plain in zip(opt.param_groups, built, strict=True):
        plain = {**plain_kw, **{k: v for k, v in plain.items() if k != "params"}}
        for p in group["params"]:
            own = [v for v in opt.state[p].values() if torch.is_tensor(v) and id(v) not in shared]
            real = sum(v.numel() * v.element_size() for v in own)
            where = f"{variant}, {dtype}, {tuple(p.shape)}"
            assert real == spec.state_bytes(tuple(p.shape), group, dtype), f"{where}: recorded group"
            assert real == spec.state_bytes(tuple(p.shape), plain, dtype), f"{where}: plain group"
            assert spec.shared_state_bytes(tuple(p.shape), group, dtype) == spec.shared_state_bytes(
                tuple(p.shape), plain, dtype
            ), f"{where}: shared state, recorded vs plain group"
            shared_want = max(shared_want, spec.shared_state_bytes(tuple(p.shape), group, dtype))
            total += real
    # State that several parameters refer to (8-bit AdamW's quantile maps) is held, and counted, once.
    assert sum(v.numel() * v.element_size() for v in shared.values()) == shared_want
    assert optimizers.measured_state_bytes(opt) == total + shared_want
    assert total > 0


def _shared_state_tensors(opt: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """The state tensors (by id) that more than one parameter's state refers to."""
    refs: dict[int, list[torch.Tensor]] = {}
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                refs.setdefault(id(v), []).append(v)
    return {k: vs[0] for k, vs in refs.items() if len(vs) > 1}


def check_state_and_groups(name: str, case: Case, variant: str) -> None:
    """State holds tensors and ints only, under the case's key names (torch's: docs/architecture.md);
    step() never changes param_groups (docs/architecture.md)."""
    params = make_params()
    opt = build(name, params, case, variant)
    before = group_options(opt)
    _run_case(opt, params, case, 0, GAP + 1)
    assert group_options(opt) == before
    assert len(opt.state) == len(params)
    for st in opt.state.values():
        assert all(torch.is_tensor(v) or type(v) is int for v in st.values()), st
        assert set(case.state_keys) <= set(st), sorted(st)


def check_loss_goes_down(name: str, case: Case) -> None:
    """On a least-squares problem whose solution has rank `RANK` (so a rank-`RANK` projection can
    reach it) the loss falls below `Case.loss_below` (5%) of its first value in `Case.loss_steps`
    steps."""
    variant = next(iter(case.variants))

    def make(w: torch.nn.Parameter, b: torch.nn.Parameter) -> torch.optim.Optimizer:
        groups = param_groups(name, [w], [], [b], basis=case.variants[variant].basis, weight_decay=0.0)
        kw = {**constructor_kwargs(name, case, variant), "lr": case.loss_lr, "weight_decay": 0.0}
        return optimizers.build_optimizer(name, groups, **kw)

    losses = least_squares_losses(make, case.loss_steps, target_rank=RANK)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < case.loss_below * losses[0], (losses[0], losses[-1])


def check_reduces_to_adamw(name: str, red: Reduction, grads: Mapping[str, Any] | None = None) -> None:
    """Under `red`'s settings the method is torch.optim.AdamW (foreach=False) within `red.tol`
    after every step, on every parameter (gradients from `set_grads` with `grads`, e.g. the
    case's spikes, which must then pass unclipped)."""
    spec = optimizers.method_spec(name)
    ours, ref = make_params(std=red.std), make_params(std=red.std)
    wd = red.adam.get("weight_decay", 0.0)
    if spec.projects:
        assert red.basis is not None, "a projecting method reduces with a full-rank basis"
        groups = [
            {
                "params": [p],
                "weight_decay": wd,
                **spec.projection_group(rank=min(p.shape), update_proj_gap=2, scale=1.0, basis=red.basis),
            }
            for p in ours[:2]
        ]
        groups += param_groups(name, [], ours[2:3], ours[3:], weight_decay=wd)
    else:
        groups = param_groups(name, ours[:2], ours[2:3], ours[3:], weight_decay=wd)
    kw = spec.constructor_kwargs({**red.adam, **red.kwargs}, total_steps=red.steps)
    opt = optimizers.build_optimizer(name, groups, **kw)
    index = {id(p): i for i, p in enumerate(ours)}
    ref_groups = [
        {"params": [ref[index[id(p)]] for p in g["params"]], "weight_decay": g["weight_decay"]}
        for g in groups
    ]
    ref_opt = torch.optim.AdamW(ref_groups, **{**red.adam, "foreach": False})
    for t in range(red.steps):
        set_grads(ours, t, **(grads or {}))
        set_grads(ref, t, **(grads or {}))
        opt.step()
        ref_opt.step()
        for i, (a, b) in enumerate(zip(ours, ref)):
            diff = float((a.detach() - b.detach()).abs().max())
            assert diff <= red.tol, f"{red.label}: step {t + 1}, param {i}: {diff:.3g} > {red.tol}"


# ----------------------------------------------------------------------------- projected methods


def _zero_grads(params: Sequence[torch.Tensor]) -> None:
    for p in params:
        p.grad = torch.zeros_like(p)


def check_zero_gradient_dummy_step(name: str, case: Case) -> None:
    """A step on all-zero gradients (what distributed checkpoint loaders do) materialises the
    state with its final shapes (the formula's bytes, floating tensors zero) but runs no basis
    computation, moves no weight and advances no counter; the run then equals a fresh one. In
    the middle of a run, just before a refresh, it changes nothing at all (docs/architecture.md).
    Bitwise: a state that the dummy step only allocated (zeros) is stepped by the same kernels as
    a fresh one, so any difference is the dummy step's doing."""
    spec = optimizers.method_spec(name)
    variant = next(iter(case.variants))
    params, fresh_params = make_params(), make_params()
    opt, fresh = build(name, params, case, variant), build(name, fresh_params, case, variant)
    _zero_grads(params)
    opt.step()
    assert opt.refresh_count == 0 and opt.refresh_seconds == 0.0
    assert_same(params, fresh_params, what="weights after the dummy step")
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            assert st["step"] == 0 and st.get("refresh", 0) == 0
            assert state_bytes_of(opt, p) == spec.state_bytes(tuple(p.shape), group, p.dtype)
            assert not any(v.any() for v in st.values() if torch.is_tensor(v) and v.is_floating_point())
    _run_case(opt, params, case, 0, GAP + 1)
    _run_case(fresh, fresh_params, case, 0, GAP + 1)
    assert_same(params, fresh_params, what="after a dummy first step")
    projected = sum(len(g["params"]) for g in opt.param_groups if g["project"])
    assert opt.refresh_count == fresh.refresh_count == 2 * projected  # steps 1 and GAP + 1
    _run_case(opt, params, case, GAP + 1, 2 * GAP)  # the next real step, 2 GAP + 1, refreshes
    _run_case(fresh, fresh_params, case, GAP + 1, 2 * GAP)
    weights = [p.detach().clone() for p in params]
    states, count = [snapshot(opt, p) for p in params], opt.refresh_count
    _zero_grads(params)
    opt.step()
    assert opt.refresh_count == count
    assert_same(params, weights, what="weights after a mid-run dummy step")
    for p, before in zip(params, states):
        assert_same_state(opt.state[p], before)
    _run_case(opt, params, case, 2 * GAP, case.steps)
    _run_case(fresh, fresh_params, case, 2 * GAP, case.steps)
    assert_same(params, fresh_params, what="after a mid-run dummy step")


def check_refresh_schedule(name: str, case: Case, variant: str) -> None:
    """Refreshes happen on steps 1, GAP + 1, 2 GAP + 1, ... per projected parameter, and the
    telemetry counts them (with their time) and no failure."""
    params = make_params()
    opt = build(name, params, case, variant)
    assert (opt.refresh_count, opt.refresh_seconds, opt.failed_refreshes) == (0, 0.0, 0)
    projected = [p for g in opt.param_groups if g["project"] for p in g["params"]]
    assert [id(p) for p in projected] == [id(p) for p in params[:2]]
    _run_case(opt, params, case, 0, 2 * GAP + 1)
    assert [opt.state[p]["refresh"] for p in projected] == [3] * len(projected)
    assert opt.refresh_count == 3 * len(projected) and opt.failed_refreshes == 0, variant
    if case.variants[variant].basis != "random":
        # A basis="random" request is regenerated every step from (seed, refresh): ProjectedAdam
        # does not time it as a refresh (APOLLO's own random projection, its default, is timed).
        assert opt.refresh_seconds > 0.0


def check_non_finite_gradient_keeps_basis(name: str, case: Case) -> None:
    """With a stored (SVD) basis, a refresh on a non-finite gradient keeps the previous basis,
    warns once for the process and is counted in ``failed_refreshes``."""
    proj.reset_failure_warning()
    params = make_params()
    groups = param_groups(name, params[:2], params[2:3], params[3:], basis="svd")
    opt = optimizers.build_optimizer(
        name, groups, **constructor_kwargs(name, case, next(iter(case.variants)))
    )
    run(opt, params, 0, GAP)
    kept = opt.state[params[0]]["basis"].clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in (GAP, 2 * GAP):  # two refresh steps (GAP + 1 and 2 GAP + 1), both non-finite
            set_grads(params, t)
            params[0].grad[1, 1] = float("nan") if t == GAP else float("inf")
            opt.step()
            assert torch.equal(opt.state[params[0]]["basis"], kept)
            run(opt, params, t + 1, t + GAP)
    assert len([w for w in caught if "basis refresh failed" in str(w.message)]) == 1
    assert opt.failed_refreshes == 2
    assert opt.state[params[0]]["refresh"] == 1 and opt.state[params[1]]["refresh"] == 3


def check_projected_groups_are_validated(name: str) -> None:
    """A vector in a projected group and an unknown constructor option are errors."""
    opts = optimizers.method_spec(name).projection_group(rank=RANK, update_proj_gap=GAP, scale=SCALE)
    with pytest.raises(ValueError, match="only 2-D weight matrices can be projected"):
        optimizers.build_optimizer(name, [{"params": [torch.nn.Parameter(torch.zeros(5))], **opts}])
    with pytest.raises(TypeError, match="unknown option.*rnak"):
        optimizers.build_optimizer(name, make_params()[:1], rnak=3)


# ----------------------------------------------------------------------------- the contract, listed once

#: The dtypes of the resume and state-bytes checks, by test id.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _axis(kind: str, case: Case) -> list[tuple[str | None, Any]]:
    """The values one argument of a check takes for `case`, each with its test id (None: no id)."""
    if kind == "case":
        return [(None, case)]
    if kind == "grads":
        return [(None, case.grads)]
    if kind == "variant":
        return [(v, v) for v in case.variants]
    if kind == "dtype":
        return list(DTYPES.items())
    if kind == "reduction":
        return [] if isinstance(case.reduces, str) else [(r.label, r) for r in case.reduces]
    raise ValueError(f"unknown contract argument {kind!r}")


@dataclass(frozen=True)
class ContractCheck:
    """One check of the contract and how it is run for a method.

    Attributes:
        test: the name of its parametrized test in tests/optimizers/test_contract.py.
        check: the function, called as ``check(name, *args)``; its docstring is the test's.
        args: what follows the name, each one of ``"case"``, ``"grads"`` (the case's), ``"variant"``
            (one run per variant), ``"dtype"`` (one per `DTYPES`), ``"reduction"`` (one per
            `Reduction` row; none for a method that does not reduce).
        projected_only: only for methods whose registry entry projects.
    """

    test: str
    check: Callable[..., None]
    args: tuple[str, ...] = ("case",)
    projected_only: bool = False

    def applies(self, name: str) -> bool:
        """Whether the check runs for registered method `name`."""
        return not self.projected_only or optimizers.method_spec(name).projects

    def runs(self, name: str, case: Case) -> list[tuple[str, Callable[[], None]]]:
        """The runs for method `name`: (test id, call), e.g. ``("galore-svd-fp32", ...)``."""
        out = []
        for combo in itertools.product(*(_axis(kind, case) for kind in self.args)):
            ids = [name, *(i for i, _ in combo if i is not None)]
            out.append(("-".join(ids), functools.partial(self.check, name, *(v for _, v in combo))))
        return out


#: The contract: test_contract.py makes one parametrized test of each (for every registered
#: method) and `run_contract` runs the same list, so a check added here runs everywhere.
CONTRACT_CHECKS: tuple[ContractCheck, ...] = (
    ContractCheck("test_case_decides_whether_it_reduces_to_adamw", check_case),
    ContractCheck("test_two_seeded_runs_are_bitwise_equal", check_determinism, ("case", "variant")),
    ContractCheck(
        "test_resume_across_a_refresh_or_reset_is_bitwise_exact", check_resume, ("case", "variant", "dtype")
    ),
    ContractCheck(
        "test_state_bytes_equal_the_registry_formula", check_state_bytes, ("case", "variant", "dtype")
    ),
    ContractCheck(
        "test_state_is_plain_and_step_never_changes_param_groups", check_state_and_groups, ("case", "variant")
    ),
    ContractCheck("test_loss_goes_down_on_least_squares", check_loss_goes_down),
    ContractCheck("test_reduces_to_torch_adamw", check_reduces_to_adamw, ("reduction", "grads")),
    ContractCheck(
        "test_zero_gradient_dummy_step_computes_no_basis_and_keeps_the_schedule",
        check_zero_gradient_dummy_step,
        projected_only=True,
    ),
    ContractCheck(
        "test_refresh_schedule_and_telemetry",
        check_refresh_schedule,
        ("case", "variant"),
        projected_only=True,
    ),
    ContractCheck(
        "test_non_finite_gradient_keeps_the_previous_basis_with_one_warning",
        check_non_finite_gradient_keeps_basis,
        projected_only=True,
    ),
    ContractCheck(
        "test_projected_groups_reject_vectors_and_unknown_options",
        check_projected_groups_are_validated,
        (),
        projected_only=True,
    ),
)


def run_contract(name: str, case: Case) -> list[str]:
    """Runs every check of `CONTRACT_CHECKS` that applies to registered method `name`, as
    test_contract.py does; returns the ids of the runs, ``"<test>[<id>]"``."""
    done = []
    for contract_check in CONTRACT_CHECKS:
        if contract_check.applies(name):
            for run_id, call in contract_check.runs(name, case):
                call()
                done.append(f"{contract_check.test}[{run_id}]")
    return done
